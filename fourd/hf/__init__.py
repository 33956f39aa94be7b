"""Hugging Face interop: checkpoint conversion (convert.py), tokenizer files (tokenizers.py), generation and
perplexity (generate.py)."""
