"""What a checkpoint folder holds, verified before a byte of it is trusted.

Reading a checkpoint is reading files someone else may have written, truncated, or
corrupted. PyTorch's distributed checkpoint (DCP) trusts its folder: its `.metadata` file
is a pickle (unpickling can run any code the file names), and its shard files are read
without a checksum (a flipped byte becomes a wrong weight, and training goes on). So
before `shardlab.checkpoint` hands a folder to DCP:

* `write_manifest` records every file's size and SHA-256 when the save is complete
  (`MANIFEST.json`, written atomically, like the completion marker);
* `verify` recomputes them and names the first file that differs, is missing, or is not
  in the manifest;
* `SafeReader` is DCP's `FileSystemReader` whose metadata is read by `safe_load_metadata`,
  an unpickler that admits only the classes DCP's metadata is made of, so a crafted
  `.metadata` cannot run code. DCP reads tensors with `torch.load(weights_only=True)`
  already; the checkpoint asks for tensors only, and `SafeReader` refuses to read an
  entry as pickled bytes (DCP would unpickle it with `weights_only=False`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

MANIFEST = "MANIFEST.json"
METADATA = ".metadata"
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or read: the message names folder and file."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe(paths: list[Path]) -> dict[str, dict]:
    """{file name: {"bytes": size, "sha256": hash}} for the given files."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in paths}


def write_manifest(folder: Path, files: dict[str, dict]) -> None:
    """Write the manifest atomically: a reader sees the whole file or none."""
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> dict[str, dict] | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        if not all(isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
                   for v in files.values()):
            raise ValueError
        return files
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is damaged (not the "
                              f"manifest shardlab writes); the checkpoint cannot be "
                              f"verified") from None


def verify(folder: Path, names: list[str] | None = None) -> None:
    """Raise `CheckpointError` naming the first file of `folder` (or of `names`) whose
    size or hash differs from the manifest, that is missing, or that the manifest lacks."""
    files = read_manifest(folder)
    if files is None:
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}: it was not written "
                              f"(completely) by shardlab, so nothing vouches for its files")
    present = {p.name for p in folder.iterdir() if p.is_file()}
    unlisted = sorted(n for n in present if (n.endswith(".distcp") or n == METADATA)
                      and n not in files)
    if unlisted:
        raise CheckpointError(f"checkpoint {folder}: file {unlisted[0]} is not in its "
                              f"manifest (added after the save?)")
    for name in sorted(files) if names is None else names:
        expected = files[name]
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder}: file {name} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint {folder}: file {name} has {size} bytes, the "
                                  f"manifest says {expected['bytes']} (truncated or "
                                  f"overwritten)")
        if sha256(path) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {folder}: file {name} does not match its "
                                  f"SHA-256 in the manifest (its bytes changed after the "
                                  f"save)")


# ----------------------------------------------------------------------------- metadata

# DCP's metadata is made of these, and nothing else (checked on checkpoints written by
# torch.distributed.checkpoint for plain tensors, ShardedTensors and DTensors).
_METADATA_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by its name
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in _ALLOWED or isinstance(dtype, (torch.dtype, torch.layout,
                                                             torch.memory_format)) \
                or (module in _METADATA_MODULES and not name.startswith("__")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's "
                                     f"metadata")


def safe_load_metadata(path: Path):
    """DCP's `Metadata` from `path`, unpickled with only the classes it is made of."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path.parent}: file {path.name} is missing") \
            from None
    except Exception as exc:  # noqa: BLE001 - any failure to parse is one message
        raise CheckpointError(f"checkpoint {path.parent}: file {path.name} is not valid "
                              f"checkpoint metadata ({type(exc).__name__}: {exc}); it was "
                              f"not loaded") from None
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(f"checkpoint {path.parent}: file {path.name} holds a "
                              f"{type(metadata).__name__}, not checkpoint metadata")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's reader, with its metadata read by `safe_load_metadata`, that reads tensors
    only: DCP unpickles an entry the metadata declares as bytes with
    `torch.load(weights_only=False)`, which runs any code the bytes name. A crafted
    `.metadata` (made of DCP's own classes, so the safe unpickler admits it) can declare
    any key so and point it at a payload in a shard file; such a read is refused."""

    def read_data(self, plan, planner):
        from torch.distributed.checkpoint.planner import LoadItemType
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                where = getattr(getattr(self, "storage_data", {}).get(item.storage_index),
                                "relative_path", "a shard file")
                raise CheckpointError(
                    f"checkpoint {self.path}: file {METADATA} declares "
                    f"{item.storage_index.fqn!r} as pickled bytes (in {where}), where a "
                    f"tensor belongs; a checkpoint is read as tensors only, so it was "
                    f"not unpickled")
        return super().read_data(plan, planner)

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta
        metadata = safe_load_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
