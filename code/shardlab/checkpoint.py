"""Checkpoints of sharded state: every rank writes its own pieces, any world size and any
strategy reads them back, and so does PyTorch.

A checkpoint is PyTorch's distributed checkpoint (`torch.distributed.checkpoint`, DCP):
one folder, a file of chunks per rank written in parallel, and a `.metadata` file that
says which bytes of which file hold which chunk of which tensor. DCP reads a chunk back
into any other cut of the same tensor, so what each strategy must say is only which part
of every parameter this rank holds. They all say it the same way (`Wrapped.pieces`, see
`shardlab.strategy.Piece`): a contiguous range [start, stop) of the flattened parameter.

    ZeRO-1/2   a bucket's chunk holds the end of one parameter and the start of the next
    ZeRO-3     the same, over a unit's flat buffer
    FSDP2      rows [r*R, (r+1)*R) of dim 0: the range [r*R*cols, (r+1)*R*cols)
    DDP        [0, numel) on every rank (a replicated tensor, written once)

The file keeps every parameter under its own name and its own shape, as PyTorch's
`get_state_dict` writes a `fully_shard` model:

    model.<name>                  the parameter (the fp32 master copy under "bf16-mixed",
                                  as FSDP2 keeps fp32 shards), and each persistent buffer
    optim.state.<name>.<state>    Adam's exp_avg, exp_avg_sq (the parameter's shape), step
    optim.param_groups.0.<key>    the hyperparameters (PyTorch's loaders ask for them)
    progress.step, rng.rank<r>    where training resumes: the next step, each rank's RNG

A range of a flattened N-D tensor is not one rectangle, but it is always a few: a
partial first row, whole rows, a partial last row, each of them (recursively) contiguous
in memory. `boxes` cuts a piece so; each box is one chunk in the file and a view of the
live tensor, so loading writes in place. A plain PyTorch program therefore reads the
checkpoint into a `fully_shard` model (`get_state_dict`, `dcp.load`, `set_state_dict`) or
into one file (`dcp_to_torch_save`), and a checkpoint PyTorch wrote resumes here.

Nothing is read before it is verified (`shardlab.manifest`): a save ends with a manifest
of every file's size and SHA-256; a load checks it first and reads the metadata with an
unpickler that admits only DCP's metadata classes. Saves are atomic: every rank writes
into `step-000012.tmp/`; rank 0 writes the manifest and the `COMPLETE` marker and renames
the folder to `step-000012/`. `latest()` returns the newest checkpoint that verifies and
says which newer ones it skipped; a save or a resume removes what an interrupted save left.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                              TensorProperties)

from shardlab.manifest import (METADATA, CheckpointError, SafeReader, describe,
                               safe_load_metadata, verify, write_manifest)
from shardlab.strategy import Piece, inner_optimizer

MARKER = "COMPLETE"  # written last, inside the folder, before it gets its final name
TMP_SUFFIX = ".tmp"


@contextlib.contextmanager
def _quiet():
    # ShardedTensor warns that it is deprecated in favour of DTensor on every use. DTensor
    # describes only even dim-0 cuts, not the ranges a flat ZeRO buffer gives a parameter,
    # which is what the file must describe.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead",
                                category=FutureWarning)
        # one process (world 1) saves without a process group, which is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _agree(value):
    """Every rank's `value`, as a list in rank order (one rank: [value])."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


# ============================================================================ the layout


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[list[int],
                                                                        list[int], int]]:
    """The elements [start, stop) of a row-major tensor of `shape` as rectangles:
    (offsets, sizes, first flat index) each, in order; each is contiguous in memory."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [([start], [stop - start], start)] if shape else [([], [], 0)]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)

    def in_row(row: int, a: int, b: int):
        return [([row, *o], [1, *s], row * inner + f) for o, s, f in boxes(shape[1:], a, b)]

    if first == last:
        return in_row(first, head, tail)
    out = []
    if head:
        out += in_row(first, head, inner)
        first += 1
    if last > first:
        out.append(([first] + [0] * (len(shape) - 1), [last - first, *shape[1:]],
                    first * inner))
    if tail:
        out += in_row(last, 0, tail)
    return out


def _pieces(wrapped) -> list[Piece]:
    if wrapped.pieces is None:
        raise ValueError(f"cannot checkpoint this run: {wrapped.checkpoint_refusal}")
    return wrapped.pieces()


def _placement(rank: int, device: torch.device) -> str:
    if device.type == "cuda":
        return f"rank:{rank}/cuda:{device.index if device.index is not None else 0}"
    return f"rank:{rank}/{device.type}"


def _chunked(piece: Piece, flat: torch.Tensor, sharded: bool):
    """The tensor to put in the state dict for `flat`, this rank's elements of the piece:
    the whole parameter as itself, or a ShardedTensor of this rank's boxes."""
    shape = tuple(piece.shape)
    if piece.ranges is None or not sharded:
        return flat.view(shape) if flat.numel() == piece.numel else flat
    rank = dist.get_rank()
    metadata, local = [], []
    for r, a, b in piece.ranges:
        for offsets, sizes, first in boxes(shape, a, b):
            m = ShardMetadata(offsets, sizes, _placement(r, flat.device))
            metadata.append(m)
            if r == rank:
                local.append(Shard(flat[first - a:first - a + math.prod(sizes)].view(sizes),
                                   m))
    meta = ShardedTensorMetadata(metadata, torch.Size(shape),
                                 TensorProperties(dtype=flat.dtype, requires_grad=False))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


@torch.no_grad()
def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (Adam's m, v and step) where it does not exist yet,
    so that a checkpoint has somewhere to load into: one step with zero gradients at
    lr 0, which changes no parameter (PyTorch's set_state_dict does the same)."""
    params = [p for g in optimizer.param_groups for p in g["params"]
              if not optimizer.state.get(p)]
    if not params:
        return
    saved = [(g, g["lr"]) for g in optimizer.param_groups]
    grads = {p: p.grad for p in params}
    for p in params:
        p.grad = torch.zeros_like(p)
    for g, _ in saved:
        g["lr"] = 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in saved:
            g["lr"] = lr
        for p, grad in grads.items():
            p.grad = grad


def _hyperparameters(optimizer: torch.optim.Optimizer, names: list[str]) -> dict:
    """PyTorch's `param_groups` entry for the checkpoint: the first group's settings over
    every trainable parameter's name (the course steps one group of settings)."""
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return {f"optim.param_groups.0.{k}": v for k, v in group.items()
            if isinstance(v, (int, float, bool, str, tuple, type(None)))} | \
        {"optim.param_groups.0.params": names}


def state_dict(wrapped, for_load: bool = False) -> dict[str, object]:
    """{key: tensor, ShardedTensor or value}: views of the live state, no copies."""
    pieces = _pieces(wrapped)  # refuse an undeclared layout before changing anything
    optimizer = inner_optimizer(wrapped.optimizer)
    ensure_optimizer_state(optimizer)
    sharded = dist.is_initialized() and dist.get_world_size() > 1
    state: dict[str, object] = {}
    trainable = []
    for piece in pieces:
        names = (piece.name, *piece.aliases)
        if not piece.writer:  # another rank writes it (and holds its optimizer state)
            if for_load:
                for name in names:
                    state[f"model.{name}"] = piece.values.view(piece.shape)
            continue
        weights = piece.master if piece.master is not None else piece.values
        for name in names:  # a tied weight under each of its names, as PyTorch writes it
            state[f"model.{name}"] = _chunked(piece, weights, sharded)
        optimizer_state = piece.optimizer_state()
        if optimizer_state:
            trainable.append(piece.name)
        for key, value in optimizer_state.items():
            state[f"optim.state.{piece.name}.{key}"] = (
                _chunked(piece, value, sharded) if value.dim() > 0 else value)
    persistent = {k for k in wrapped.module.state_dict(keep_vars=True)}
    for name, buffer in wrapped.module.named_buffers():
        if name in persistent:
            state[f"model.{name}"] = buffer
    if not for_load:
        names = list(dict.fromkeys(n for part in _agree(trainable) for n in part))
        if names:
            state.update(_hyperparameters(optimizer, names))
    return state


# ============================================================================ folders


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
    rank, _ = _rank_world()
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
    rank, _ = _rank_world()
    removed = []
    if rank == 0 and root.is_dir():
        for tmp in root.glob(f"step-*{TMP_SUFFIX}"):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


# ============================================================================ save / load


def save(root: str | os.PathLike, step: int, wrapped, info: dict | None = None) -> Path:
    """Save the state after `step` steps into `root/step-<step>/`, atomically, with a
    manifest. Called on every rank; returns the folder."""
    with _quiet(), torch.no_grad():
        return _save(Path(root), step, wrapped, info or {})


def _save(root: Path, step: int, wrapped, extra: dict) -> Path:
    rank, world = _rank_world()
    final = step_folder(root, step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    state = state_dict(wrapped)  # refuses an undeclared layout before touching the disk
    if rank == 0:
        clean_interrupted(root)
        tmp.mkdir(parents=True)
    _barrier()
    state["progress.step"] = torch.tensor(step, device="cpu")
    state[f"rng.rank{rank}"] = torch.get_rng_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp),
             no_dist=not dist.is_initialized())
    _barrier()  # every rank's files are on disk: each hashes its own
    mine = describe(sorted(tmp.glob(f"__{rank}_*.distcp")))
    files = {k: v for part in _agree(mine) for k, v in part.items()}
    if rank == 0:
        files.update(describe([tmp / METADATA]))
        write_manifest(tmp, files)
        (tmp / MARKER).write_text(json.dumps({"step": step, "world": world, **extra}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # one rename: the folder is complete or it does not exist
    _barrier()
    return final


def _check_matches(folder: Path, metadata, state: dict) -> None:
    """Refuse a checkpoint of another model, naming the first tensor that differs."""
    saved = metadata.state_dict_metadata
    for key, value in state.items():
        if not key.startswith("model."):
            continue
        if key not in saved:
            raise CheckpointError(f"checkpoint {folder} does not match the model: it has no "
                                  f"{key.split('.', 1)[1]!r}; resume with the model it was "
                                  f"saved from")
        size = tuple(value.size())
        have = tuple(getattr(saved[key], "size", ()))
        if have != size:
            raise CheckpointError(f"checkpoint {folder} does not match the model: "
                                  f"{key.split('.', 1)[1]!r} has shape {have} in the "
                                  f"checkpoint and {size} in the model")
    extra = sorted(k.split(".", 1)[1] for k in saved
                   if k.startswith("model.") and k not in state)
    if extra:
        raise CheckpointError(f"checkpoint {folder} does not match the model: it has "
                              f"{extra[0]!r}, which the model lacks")
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
    with _quiet(), torch.no_grad():
        return _load(Path(folder), wrapped, trusted)


def _load(folder: Path, wrapped, trusted: bool) -> int:
    rank, _ = _rank_world()
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
    for piece in _pieces(wrapped):
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


# ============================================================================ export


def export_full_state_dict(wrapped, path: str | os.PathLike) -> None:
    """Write the full, unsharded state dict of the model, under the model's own names (a
    tied weight under each of its names) with its persistent buffers, as a plain
    `torch.save` file on rank 0. Every rank must call it: the shards are gathered. Any
    model: `model.load_state_dict(torch.load(path, weights_only=True))` reads it into a
    model built the same way."""
    full = wrapped.full_parameters() if wrapped.full_parameters else \
        {n: p.detach() for n, p in wrapped.module.named_parameters()}
    names = [(piece.name, piece.aliases) for piece in _pieces(wrapped)]
    rank, _ = _rank_world()
    if rank == 0:
        out = {}
        for name, aliases in names:
            for key in (name, *aliases):
                out[key] = full[name].detach().cpu().clone()
        persistent = set(wrapped.module.state_dict(keep_vars=True))
        for name, buffer in wrapped.module.named_buffers():
            if name in persistent:
                out[name] = buffer.detach().cpu().clone()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, path)
    _barrier()


# ============================================================================ workers


def files_per_rank(folder: str | os.PathLike) -> dict[int, int]:
    """Bytes on disk of each rank's shard file (DCP names them `__<rank>_<n>.distcp`)."""
    sizes: dict[int, int] = {}
    for f in Path(folder).glob("__*_*.distcp"):
        rank = int(f.name[2:].split("_")[0])
        sizes[rank] = sizes.get(rank, 0) + f.stat().st_size
    return sizes


def timed_save_load(cases: list[dict], root: str, repeats: int = 3) -> list[dict]:
    """Run on every rank (with `shardlab.launch.launch`): for each case {strategy, model,
    precision}, train one step, then save and load the state `repeats` times; return the
    median seconds of a save and of a load (all ranks together, barrier to barrier) and
    the bytes each rank wrote."""
    import statistics
    import time

    from shardlab.launch import rank_device
    from shardlab.models import build_model, get_batch, loss_fn
    from shardlab.precision import get_precision
    from shardlab.strategy import get_strategy, optimizer_spec

    rank, world = _rank_world()
    out = []
    for i, case in enumerate(cases):
        wrapped = get_strategy(case["strategy"])(
            build_model(case.get("model", "gpt-tiny"), seed=0).to(rank_device()),
            get_precision(case.get("precision", "fp32")), optimizer_spec("adamw", 1e-3), {})
        x, y = (t.to(rank_device()) for t in get_batch(0, rank, world, 8, 16))
        loss_fn(wrapped.model(x), y).backward()
        wrapped.optimizer.step()
        wrapped.optimizer.zero_grad()
        saves, loads = [], []
        for r in range(repeats):
            _barrier()
            start = time.perf_counter()
            folder = save(Path(root) / f"case{i}", r + 1, wrapped)
            saves.append(time.perf_counter() - start)
            _barrier()
            start = time.perf_counter()
            load(folder, wrapped)
            _barrier()
            loads.append(time.perf_counter() - start)
        out.append({"case": case, "save_s": statistics.median(saves),
                    "load_s": statistics.median(loads), "files": files_per_rank(folder)})
    return out


def open_with_pytorch_fsdp2(folder: str, model: str, model_config: dict | None = None,
                            wrap: str = "auto") -> dict:
    """Run on every rank: build `model`, shard it with PyTorch's own `fully_shard` (per
    unit of the wrap policy), and read the checkpoint with nothing but PyTorch's API
    (`get_state_dict`, `dcp.load`, `set_state_dict`). Returns the full parameters it
    loaded and the step count of Adam's state, on every rank."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardlab.launch import rank_device
    from shardlab.models import build_model
    from shardlab.wrap import unit_modules

    module = build_model(model, seed=1, config=model_config).to(rank_device())  # other
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))  # weights
    for unit in unit_modules(module, wrap):
        fully_shard(unit, mesh=mesh)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    full = {n: p.full_tensor().detach().cpu() for n, p in module.named_parameters()}
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return {"params": full, "adam_step": steps[0] if steps else 0.0}


__all__ = ["save", "load", "latest", "is_complete", "info", "step_folder",
           "clean_interrupted", "export_full_state_dict", "files_per_rank",
           "timed_save_load", "open_with_pytorch_fsdp2", "boxes", "state_dict",
           "CheckpointError", "MARKER"]
