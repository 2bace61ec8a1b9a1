"""Built-in cycle-time cost models."""
