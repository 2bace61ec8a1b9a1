"""Fitting and persisting per-setup state: the cost model's constants, what selectors learned."""
