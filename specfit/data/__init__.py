"""Text data: the corpora and GSM problems of ../shared/data, their fixed splits, and held-out prompts."""
