"""Checkpoints: a manifest plus torch.distributed.checkpoint files, written atomically (see store.py)."""

from fourd.ckpt.store import (
    latest,
    load_model_checkpoint,
    model_digest,
    read_manifest,
    resolve,
    save_model_checkpoint,
    verify,
)

__all__ = [
    "latest",
    "load_model_checkpoint",
    "model_digest",
    "read_manifest",
    "resolve",
    "save_model_checkpoint",
    "verify",
]
