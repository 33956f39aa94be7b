"""Checkpoints: a manifest plus torch.distributed.checkpoint files, written atomically (see store.py)."""

from fourd.ckpt.store import (
    load_model_checkpoint,
    model_digest,
    read_manifest,
    save_model_checkpoint,
    verify,
)

__all__ = ["load_model_checkpoint", "model_digest", "read_manifest", "save_model_checkpoint", "verify"]
