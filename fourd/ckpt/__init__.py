"""Checkpoints: a manifest plus torch.distributed.checkpoint files, written atomically (see
store.py)."""
