"""FSDP2's dim-0 split at any world size: the rows, elements and bytes of each rank.

`model_states` assumes the even split of one flat buffer: ceil(Ψ/N) elements a rank,
which is exact for ZeRO-3 (it pads the buffer) and for FSDP2 when N divides every
parameter's first dimension. FSDP2 cuts each parameter on its own, as `torch.chunk` cuts
dim 0: ceil(d0/N) rows a rank, the last ranks fewer, some none. A router of 4 experts on
3 ranks is rows 2, 2, 0. Each rank's storage is padded to ceil(d0/N) rows (so that the
all-gather is one even collective); the rows that exist are what each rank's optimizer
steps. So at a world size that does not divide some d0 the per-rank model states differ
from Ψ/N, and differ between ranks; this module says by how much, per rank.

    rows_of(d0, world, rank)              the rows of one parameter that rank holds
    shard_elements(shapes, world, rank)   the elements (padded, or the rows that exist)
    dim0_states(shapes, world, rank, ...) its parameters, gradients and optimizer bytes

`shapes` lists each parameter once (a tied weight once) as a shape, or as (shape,
trainable) where a frozen parameter holds its parameter bytes and nothing else;
`parameter_shapes(model)` reads them off a model.
"""

from __future__ import annotations

from math import prod
from typing import Any, Iterable

from shardlab.memory.states import (Breakdown, bytes_per_param, check_world)


def rows_of(d0: int, world: int, rank: int) -> int:
    """Rows of a parameter with `d0` rows that `rank` holds under a dim-0 `torch.chunk`
    cut: ceil(d0/N) for the first ranks, what is left for the next, 0 after that."""
    check_world(world)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank!r}")
    chunk = -(-d0 // world)
    return max(0, min(chunk, d0 - rank * chunk))


def _entries(shapes: Iterable[Any]) -> list[tuple[tuple[int, ...], bool]]:
    out = []
    for entry in shapes:
        if len(entry) == 2 and isinstance(entry[1], bool):
            shape, trainable = tuple(entry[0]), entry[1]
        else:
            shape, trainable = tuple(entry), True
        out.append((shape or (1,), trainable))  # a scalar is one row of one element
    return out


def shard_elements(shapes: Iterable[Any], world: int, rank: int, padded: bool = True,
                   trainable_only: bool = False) -> int:
    """Elements `rank` holds of these parameters: padded (its storage, ceil(d0/N) rows of
    each) or only the rows that exist there."""
    total = 0
    for shape, trainable in _entries(shapes):
        if trainable_only and not trainable:
            continue
        rows = -(-shape[0] // world) if padded else rows_of(shape[0], world, rank)
        total += rows * prod(shape[1:])
    return total


def dim0_states(shapes: Iterable[Any], world: int, rank: int,
                precision: str = "bf16-mixed", optimizer: str = "adamw",
                optimizer_padded: bool = True) -> Breakdown:
    """Bytes of model states `rank` holds under FSDP2's dim-0 split. Parameters and
    gradients live in padded storage; the optimizer's states are made from each rank's
    shards: the course's FSDP2 pads them too (`optimizer_padded=True`), PyTorch's
    `fully_shard` makes them from the unpadded local tensors (False)."""
    entries = _entries(shapes)
    per = bytes_per_param(precision, optimizer)
    return Breakdown(
        params=per.params * shard_elements(entries, world, rank),
        grads=per.grads * shard_elements(entries, world, rank, trainable_only=True),
        optimizer=per.optimizer * shard_elements(entries, world, rank, optimizer_padded,
                                                 trainable_only=True))


def dim0_states_per_rank(shapes: Iterable[Any], world: int, precision: str = "bf16-mixed",
                         optimizer: str = "adamw",
                         optimizer_padded: bool = True) -> list[Breakdown]:
    """`dim0_states` of every rank, in rank order."""
    entries = _entries(shapes)
    return [dim0_states(entries, world, r, precision, optimizer, optimizer_padded)
            for r in range(world)]


def parameter_shapes(model) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, trainable) of each parameter of a model, a tied weight once."""
    return [(tuple(p.shape), bool(p.requires_grad)) for p in model.parameters()]
