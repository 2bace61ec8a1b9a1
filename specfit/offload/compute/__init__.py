"""Expert compute over the device slot pool (loop, grouped, Triton)."""
