"""Checkpoints of sharded state: every rank writes its own shards, any world size reads them.

A checkpoint is PyTorch's distributed checkpoint (`torch.distributed.checkpoint`, DCP):
one folder, one file of shards per rank, written in parallel, and a `.metadata` file
(written by rank 0) that says which bytes of which file hold which piece of which tensor.
DCP can read a piece back into any other cut of the same tensor, as long as every tensor
is described by its *global* shape and the piece this rank holds.

So the question for each strategy is only: what global tensor does this rank hold a
piece of? The answer is the same for all of them, the flattened 1-D view of each
original parameter (and of each of its optimizer states):

    ZeRO-1/2   a bucket's chunk holds the end of one parameter and the start of the next:
               rank r holds [a, b) of each parameter it touches
    ZeRO-3     the same, over a unit's flat buffer
    FSDP2      rank r holds rows [r*R, (r+1)*R) of dim 0, which is the contiguous range
               [r*R*cols, (r+1)*R*cols) of the flattened parameter
    DDP        every rank holds [0, numel) (a replicated tensor, saved once)

Each piece becomes a `ShardedTensor` with one shard `[a, b)` of a 1-D tensor of `numel`
elements, keyed by the parameter's original name: the padding of flat buffers and of
dim-0 chunks never reaches the file, so a checkpoint saved by one strategy on N ranks
loads into any of these strategies on any number of ranks. `torch-fsdp2` (PyTorch's
`fully_shard`) uses PyTorch's own `get_state_dict` / `set_state_dict` (DTensors).

Keys: `model.<name>`, `optim.<name>.<state>` (Adam's `exp_avg`, `exp_avg_sq`, `step`),
`optim.<name>.master` (fp32 master weights of "bf16-mixed"), `buffer.<name>`,
`rng.rank<r>` and `progress.step` (the next step to run: the data position, since
`get_batch` is a function of the step).

Saves are atomic: every rank writes into `step-000012.tmp/`; after a barrier rank 0
writes the completion marker and renames the folder to `step-000012/`. `latest()`
takes only complete folders, so a save cut short is never resumed from.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                              TensorProperties)

from shardlab.strategy import Piece, inner_optimizer

MARKER = "COMPLETE"  # written last, inside the folder, before it gets its final name


@contextlib.contextmanager
def _quiet_sharded_tensor():
    # ShardedTensor warns that it is deprecated in favour of DTensor on every use. DTensor
    # describes only torch.chunk-style even cuts, not the arbitrary [a, b) ranges a flat
    # ZeRO buffer gives a parameter, which is what the file must describe.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead",
                                category=FutureWarning)
        # one process (world 1) saves without a process group, which is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ============================================================================ the layout


def _pieces(wrapped) -> list[Piece]:
    """This rank's pieces, as the strategy declares them (`Wrapped.pieces`)."""
    if wrapped.pieces is None:
        raise ValueError(f"cannot checkpoint this run: {wrapped.checkpoint_refusal}")
    return wrapped.pieces()


def parameter_names(wrapped) -> set[str]:
    """The names of all the model's parameters (each tied weight once)."""
    return {piece.name for piece in _pieces(wrapped)}


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


# ============================================================================ state dicts


def _sharded(piece: Piece, tensor: torch.Tensor) -> ShardedTensor:
    """A 1-D tensor of `piece.numel` elements of which this rank holds `tensor`."""
    rank = dist.get_rank()

    def placement(r):
        return f"rank:{r}/{tensor.device.type}" + (f":{r % torch.cuda.device_count()}"
                                                    if tensor.device.type == "cuda" else "")
    shards = [ShardMetadata([a], [b - a], placement(r)) for r, a, b in piece.ranges]
    meta = ShardedTensorMetadata(shards, torch.Size([piece.numel]),
                                 TensorProperties(dtype=tensor.dtype, requires_grad=False))
    local = [Shard(tensor, m) for m in shards if m.placement.rank() == rank]
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def course_state_dict(wrapped, for_load: bool = False) -> dict[str, object]:
    """{key: tensor or ShardedTensor}: views of the live state, no copies. A parameter is
    stored as its fp32 master copy where the optimizer keeps one ("bf16-mixed"), so the
    file holds the weights the optimizer steps; `load` casts them into the model."""
    optimizer = inner_optimizer(wrapped.optimizer)
    ensure_optimizer_state(optimizer)
    sharded = dist.is_initialized() and dist.get_world_size() > 1
    state: dict[str, object] = {}

    def put(key, piece, tensor):
        state[key] = _sharded(piece, tensor) if (piece.ranges is not None and sharded) \
            else tensor

    for piece in _pieces(wrapped):
        if not piece.writer:  # another rank writes it (and holds its optimizer state)
            if for_load:
                state[f"model.{piece.name}"] = piece.values
            continue
        put(f"model.{piece.name}", piece,
            piece.master if piece.master is not None else piece.values)
        for k, v in piece.optimizer_state().items():
            if v.dim() > 0:
                put(f"optim.{piece.name}.{k}", piece, v)
            else:  # Adam's step counter: one number, the same for every piece
                state[f"optim.{piece.name}.{k}"] = v
    for name, b in wrapped.module.named_buffers():
        state[f"buffer.{name}"] = b
    return state


# ============================================================================ save / load


def step_folder(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def _rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save(root: str | os.PathLike, step: int, wrapped, info: dict | None = None) -> Path:
    with _quiet_sharded_tensor():
        return _save(root, step, wrapped, info)


def _save(root, step, wrapped, info) -> Path:
    """Save the state after `step` steps into `root/step-<step>/`, atomically. Called on
    every rank; returns the folder."""
    rank, world = _rank_world()
    final = step_folder(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left behind
        tmp.mkdir(parents=True)
    _barrier()
    state = course_state_dict(wrapped)
    state["progress.step"] = torch.tensor(step, device="cpu")
    state[f"rng.rank{rank}"] = torch.get_rng_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp),
             no_dist=not dist.is_initialized())
    _barrier()  # every rank's shards are on disk
    if rank == 0:
        marker = {"step": step, "world": world, **(info or {})}
        (tmp / MARKER).write_text(json.dumps(marker))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # one rename: the folder is complete or it does not exist
    _barrier()
    return final


def is_complete(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return (folder.is_dir() and not folder.name.endswith(".tmp")
            and (folder / MARKER).is_file() and (folder / ".metadata").is_file())


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root` (None if there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [f for f in root.glob("step-*") if is_complete(f)]
    return max(done, key=lambda f: int(f.name.split("-")[1]), default=None)


def info(folder: str | os.PathLike) -> dict:
    """The completion marker: step, world size and what the run recorded."""
    return json.loads((Path(folder) / MARKER).read_text())


def _check_matches(folder: Path, state: dict, names: set[str]) -> None:
    """Refuse a checkpoint of another model, naming the first parameter that differs."""
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    for key, value in state.items():
        if not key.startswith(("model.", "buffer.")):
            continue
        size = tuple(value.size() if isinstance(value, ShardedTensor) else value.shape)
        if key not in saved:
            raise ValueError(f"checkpoint {folder.name} does not match the model: it has no "
                             f"parameter {key.split('.', 1)[1]!r}; resume with the model "
                             f"it was saved from")
        if tuple(saved[key].size) != size:
            raise ValueError(f"checkpoint {folder.name} does not match the model: parameter "
                             f"{key.split('.', 1)[1]!r} has {tuple(saved[key].size)} elements "
                             f"in the checkpoint and {size} in the model")
    extra = sorted(k.split(".", 1)[1] for k in saved
                   if k.startswith("model.") and k.split(".", 1)[1] not in names)
    if extra:
        raise ValueError(f"checkpoint {folder.name} does not match the model: it has "
                         f"parameter {extra[0]!r}, which the model lacks")


def load(folder: str | os.PathLike, wrapped) -> int:
    """Load a checkpoint into a freshly wrapped model and optimizer, on any world size;
    return the step to continue from. Called on every rank."""
    with _quiet_sharded_tensor(), torch.no_grad():
        return _load(folder, wrapped)


def _load(folder, wrapped) -> int:
    folder = Path(folder)
    if not is_complete(folder):
        raise ValueError(f"{folder} is not a complete checkpoint (no {MARKER} marker): "
                         f"pick one with shardlab.checkpoint.latest(root)")
    rank, _ = _rank_world()
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    state = course_state_dict(wrapped, for_load=True)
    _check_matches(folder, state, parameter_names(wrapped))
    state["progress.step"] = torch.tensor(0, device="cpu")
    rng_key = f"rng.rank{rank}"
    if rng_key in saved:  # a rank the saving run did not have keeps its own seed
        state[rng_key] = torch.get_rng_state()
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder),
             no_dist=not dist.is_initialized())
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    for piece in _pieces(wrapped):
        if piece.master is not None:  # the file holds the master: the model computes
            piece.values.copy_(piece.master)  # with its cast
    wrapped.after_load()
    return int(state["progress.step"])


# ============================================================================ export


def export_full_state_dict(wrapped, path: str | os.PathLike, model_name: str,
                           seed: int = 0) -> None:
    """Write the full, unsharded state dict for `build_model(model_name)` as a plain
    `torch.save` file on rank 0 (every rank must call it: the shards are gathered).
    Load it with `model.load_state_dict(torch.load(path, weights_only=True))`."""
    from shardlab.models import build_model
    full = wrapped.full_parameters() if wrapped.full_parameters else \
        {n: p.detach() for n, p in wrapped.module.named_parameters()}
    rank, _ = _rank_world()
    if rank == 0:
        plain = build_model(model_name, seed)
        with torch.no_grad():
            for name, p in plain.named_parameters():  # each tied weight once, first name
                p.copy_(full[name])
            buffers = dict(wrapped.module.named_buffers())
            for name, b in plain.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(plain.state_dict(), path)
    _barrier()


# ============================================================================ a worker


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

    from shardlab.models import build_model, get_batch, loss_fn
    from shardlab.precision import get_precision
    from shardlab.launch import rank_device
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
