"""The layout of a checkpoint: every rank's pieces as DCP chunks, under PyTorch's names.

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
live tensor, so loading writes in place.

Apart from saving and loading because it is the part that knows tensors and never the
disk: what is in a checkpoint, not how it gets there safely. The few rank helpers the
other parts share (`rank_world`, `barrier`, `agree`: each works with one process and no
process group too) are here, at the bottom of the package.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                              TensorProperties)

from shardlab.optimizers import inner_optimizer
from shardlab.strategy import Piece


@contextlib.contextmanager
def quiet_warnings():
    # ShardedTensor warns that it is deprecated in favour of DTensor on every use. DTensor
    # describes only even dim-0 cuts, not the ranges a flat ZeRO buffer gives a parameter,
    # which is what the file must describe.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead",
                                category=FutureWarning)
        # one process (world 1) saves without a process group, which is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def agree(value):
    """Every rank's `value`, as a list in rank order (one rank: [value])."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


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


def pieces_of(wrapped) -> list[Piece]:
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
    pieces = pieces_of(wrapped)  # refuse an undeclared layout before changing anything
    optimizer = inner_optimizer(wrapped.optimizer)
    ensure_optimizer_state(optimizer)
    sharded = dist.is_initialized() and dist.get_world_size() > 1
    state: dict[str, object] = {}
    trainable = []
    for piece in pieces:
        names = (piece.name, *piece.aliases)
        if not piece.writer and not for_load:  # another rank writes the same elements
            continue
        if not piece.writer and piece.ranges is None:
            # a whole parameter whose master copy and optimizer state another rank holds
            # (ZeroRedundancyOptimizer): read back the values alone
            for name in names:
                state[f"model.{name}"] = piece.values.view(piece.shape)
            continue
        # (a replica's piece, HSDP's, is read back whole: values and optimizer state)
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
        names = list(dict.fromkeys(n for part in agree(trainable) for n in part))
        if names:
            state.update(_hyperparameters(optimizer, names))
    return state
