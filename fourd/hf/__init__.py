"""Hugging Face interop: checkpoint conversion (convert.py), generation and perplexity
(inference.py, generate.py)."""
