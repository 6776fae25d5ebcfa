"""Saving and loading, safely: atomic saves, verified loads, the newest good checkpoint.

Nothing is read before it is verified (`shardlab.manifest`): a save ends with a manifest
of every file's size and SHA-256; a load checks it first and reads the metadata with an
unpickler that admits only DCP's metadata classes. Saves are atomic: every rank writes
into `step-000012.tmp/`; rank 0 writes the manifest and the `COMPLETE` marker and renames
the folder to `step-000012/`. `latest()` returns the newest checkpoint that verifies and
says which newer ones it skipped; a save or a resume removes what an interrupted save left.

What is written is `shardlab.checkpoint.layout`'s state dict; this module is the folders
and the order of the steps that make a save all-or-nothing and a load safe. A save that
fails says why in one line (`shardlab.checkpoint.failures`) and leaves no `.tmp` behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardlab.checkpoint.failures import save_failed
from shardlab.checkpoint.layout import (agree, barrier, pieces_of, quiet_warnings,
                                        rank_world, state_dict)
from shardlab.manifest import (METADATA, CheckpointError, SafeReader, describe,
                               safe_load_metadata, verify, write_manifest)


MARKER = "COMPLETE"  # written last, inside the folder, before it gets its final name
TMP_SUFFIX = ".tmp"


def step_folder(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def _missing_files(folder: Path) -> list[str]:
    """What a finished save writes last (the marker) and what every read needs (the
    metadata), of those absent from `folder`."""
    return [name for name in (MARKER, METADATA) if not (folder / name).is_file()]


def is_complete(folder: str | os.PathLike) -> bool:
    """Written to the end by shardlab (marker and metadata present); not yet verified."""
    folder = Path(folder)
    return (folder.is_dir() and not folder.name.endswith(TMP_SUFFIX)
            and not _missing_files(folder))


def info(folder: str | os.PathLike) -> dict:
    """The completion marker: step, world size and what the run recorded."""
    try:
        return json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder}: its {MARKER} marker cannot be read "
                              f"({exc})") from None


def _steps_newest_first(root: Path) -> list[Path]:
    """Every finished save's folder (`step-N`, not an interrupted `step-N.tmp`), newest
    first, complete or not: one that lost a file is reported, not passed over in silence."""
    steps = [f for f in root.glob("step-*") if f.is_dir() and not f.name.endswith(TMP_SUFFIX)
             and f.name.split("-", 1)[1].isdigit()]
    return sorted(steps, key=lambda f: int(f.name.split("-", 1)[1]), reverse=True)


def complete_steps(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoint folders under `root`, oldest first (not verified: `latest`
    reads their files' hashes); [] for a folder that holds none, or no folder."""
    root = Path(root)
    return [f for f in reversed(_steps_newest_first(root)) if is_complete(f)] \
        if root.is_dir() else []


def _check_complete(folder: Path) -> None:
    missing = _missing_files(folder)
    if missing:
        raise CheckpointError(f"checkpoint {folder}: file {missing[0]} is missing")


def latest(root: str | os.PathLike, say=print) -> Path | None:
    """The newest complete checkpoint under `root` that verifies (None if none does).
    Newer ones that fail verification are skipped, and `say` (rank 0's) tells which."""
    root = Path(root)
    if not root.is_dir():
        return None
    rank, _ = rank_world()
    for folder in _steps_newest_first(root):
        try:
            _check_complete(folder)
            verify(folder)
            info(folder)  # the marker itself must read: resume takes its step from it
            return folder
        except CheckpointError as exc:
            if rank == 0 and say is not None:
                say(f"skipping checkpoint {folder.name}: {exc}")
    return None


def clean_interrupted(root: str | os.PathLike) -> list[Path]:
    """Remove the `.tmp` folders of saves that never finished (rank 0 only)."""
    root = Path(root)
    rank, _ = rank_world()
    removed = []
    if rank == 0 and root.is_dir():
        for tmp in root.glob(f"step-*{TMP_SUFFIX}"):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def save(root: str | os.PathLike, step: int, wrapped, info: dict | None = None) -> Path:
    """Save the state after `step` steps into `root/step-<step>/`, atomically, with a
    manifest. Called on every rank; returns the folder."""
    root = Path(root)
    with quiet_warnings(), torch.no_grad():
        try:
            return _save(root, step, wrapped, info or {})
        except CheckpointError:
            raise  # refused before a byte was written: already says why
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - told plainly
            # DCP's CheckpointException is a BaseException, caught by name
            raise save_failed(root, step, _tmp_folder(root, step), exc,
                              is_complete) from exc


def _tmp_folder(root: Path, step: int) -> Path:
    final = step_folder(root, step)
    return final.with_name(final.name + TMP_SUFFIX)


def _save(root: Path, step: int, wrapped, extra: dict) -> Path:
    rank, world = rank_world()
    final = step_folder(root, step)
    tmp = _tmp_folder(root, step)
    state = state_dict(wrapped)  # refuses an undeclared layout before touching the disk
    if rank == 0:
        clean_interrupted(root)
        tmp.mkdir(parents=True)
    barrier()
    state["progress.step"] = torch.tensor(step, device="cpu")
    state[f"rng.rank{rank}"] = torch.get_rng_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp),
             no_dist=not dist.is_initialized())
    barrier()  # every rank's files are on disk: each hashes its own
    mine = describe(sorted(tmp.glob(f"__{rank}_*.distcp")))
    files = {k: v for part in agree(mine) for k, v in part.items()}
    if rank == 0:
        files.update(describe([tmp / METADATA]))
        write_manifest(tmp, files)
        (tmp / MARKER).write_text(json.dumps({"step": step, "world": world, **extra}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # one rename: the folder is complete or it does not exist
    barrier()
    return final


def _check_matches(folder: Path, metadata, state: dict) -> None:
    """Refuse a checkpoint of another model, naming the first few tensors that differ."""
    saved = metadata.state_dict_metadata
    found = []
    for key, value in state.items():
        if not key.startswith("model."):
            continue
        name = key.split(".", 1)[1]
        if key not in saved:
            found.append(f"it has no {name!r}")
            continue
        size = tuple(value.size())
        have = tuple(getattr(saved[key], "size", ()))
        if have != size:
            found.append(f"{name!r} has shape {have} in the checkpoint and {size} in the "
                         f"model")
    found += [f"it has {k.split('.', 1)[1]!r}, which the model lacks" for k in sorted(saved)
              if k.startswith("model.") and k not in state]
    if found:
        shown = 3
        more = f" and {len(found) - shown} more" if len(found) > shown else ""
        raise CheckpointError(f"checkpoint {folder} does not match the model: "
                              f"{'; '.join(found[:shown])}{more}; resume with the model it "
                              f"was saved from")
    missing = sorted(k for k in state if k.startswith("optim.state.") and k not in saved)
    if missing:
        raise CheckpointError(f"checkpoint {folder} holds no optimizer state "
                              f"{missing[0][len('optim.state.'):]!r}: it was saved without "
                              f"that optimizer (or by another one); resume with the same "
                              f"optimizer")


def load(folder: str | os.PathLike, wrapped, trusted: bool = False) -> int:
    """Load a checkpoint into a freshly wrapped model and optimizer, on any world size and
    with any of the course's strategies; return the step to continue from. Called on every
    rank. A folder shardlab did not write (PyTorch's own, say) has no manifest: it loads
    only with `trusted=True` (its metadata is still read without running code)."""
    with quiet_warnings(), torch.no_grad():
        return _load(Path(folder), wrapped, trusted)


def _load(folder: Path, wrapped, trusted: bool) -> int:
    rank, _ = rank_world()
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint folder {folder}")
    if not trusted:
        if not (folder / MARKER).is_file():
            raise CheckpointError(f"{folder} is not a complete shardlab checkpoint (no "
                                  f"{MARKER} marker): pick one with "
                                  f"shardlab.checkpoint.latest(root), or pass trusted=True "
                                  f"to load a checkpoint written by PyTorch itself")
        _check_complete(folder)
        verify(folder)
    metadata = safe_load_metadata(folder / METADATA)
    state = state_dict(wrapped, for_load=True)
    _check_matches(folder, metadata, state)
    saved = metadata.state_dict_metadata
    if "progress.step" in saved:
        state["progress.step"] = torch.tensor(0, device="cpu")
    rng_key = f"rng.rank{rank}"
    if rng_key in saved:  # a rank the saving run did not have keeps its own seed
        state[rng_key] = torch.get_rng_state()
    try:
        dcp.load(state, storage_reader=SafeReader(folder), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - read, but unreadable
        raise _read_error(folder, exc) from None
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    for piece in pieces_of(wrapped):
        if piece.master is not None:  # the file holds the master: the model computes
            piece.values.copy_(piece.master)  # with its cast
    wrapped.after_load()
    if "progress.step" in state:
        return int(state["progress.step"])
    # PyTorch's own checkpoints have no progress entry; Adam counts the steps it took
    counters = [v for k, v in state.items() if k.endswith(".step")
                and isinstance(v, torch.Tensor) and v.dim() == 0]
    return int(counters[0]) if counters else 0


def _read_error(folder: Path, exc: BaseException) -> CheckpointError:
    """One error naming the checkpoint for whatever DCP raised while reading it. DCP's
    own CheckpointException (a BaseException, not an Exception) carries each rank's
    failure: ours (a refused read) as it is, any other by its type and first line."""
    if isinstance(exc, CheckpointException):  # {rank: (exception, traceback)}
        causes = [cause for cause, _ in exc.failures.values()] or [exc]
    else:
        causes = [exc]
    for cause in causes:
        if isinstance(cause, CheckpointError):
            return cause
    first = causes[0]
    line = (str(first).strip().splitlines() or [""])[0][:300]
    return CheckpointError(f"checkpoint {folder} could not be read: {type(first).__name__}"
                           f"{': ' + line if line else ''}")
