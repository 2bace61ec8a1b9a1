"""The decode loop: the engine, one cycle, sampling and the acceptance rule."""
