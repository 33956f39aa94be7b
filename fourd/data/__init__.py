"""Data: corpus discovery, tokenization into a memory-mapped cache, and samples by global index."""
