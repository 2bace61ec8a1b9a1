"""Trainers for the built-in demo models: data (corpus, GSM problems), tokenizer, MoE target.

Submodules are imported on demand; torch and transformers load only where a trainer runs.
"""
