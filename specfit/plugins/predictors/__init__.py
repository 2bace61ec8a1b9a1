"""Built-in expert predictors."""
