"""The Hugging Face target: loading (local checkpoints, streamed safetensors, quantized formats, built-in models), numerics, its forward passes."""
