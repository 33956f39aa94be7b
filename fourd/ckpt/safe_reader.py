"""Reading DCP's `.metadata` (a pickle) with an unpickler that builds only DCP's metadata
classes."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fourd.errors import FourdError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("pathlib", "PosixPath")}
_ALLOWED.add(("torch.serialization", "_get_layout"))  # looks a layout up by name


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES:
            found = super().find_class(module, name)
            if isinstance(
                found, type
            ):  # DCP's metadata dataclasses and enums, nothing callable else
                return found
        elif module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.memory_format)
        ):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose `.metadata` unpickling can only build DCP's metadata classes."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
            if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
                raise pickle.UnpicklingError("not DCP metadata")
        except (
            pickle.UnpicklingError,
            EOFError,
            AttributeError,
            ImportError,
            ValueError,
            TypeError,
        ) as e:
            raise FourdError(f"{path}: refused ({e}); load only checkpoints fourd wrote") from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
