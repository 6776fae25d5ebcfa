"""Where each parameter's elements are, across the ranks and in what this rank steps.

Every strategy of the course cuts a parameter into contiguous ranges of its flattened
elements (`shardlab.strategy.Piece` says the same for checkpoints): ZeRO-1/2 and ZeRO-3
by cutting a flat buffer, FSDP2 by cutting rows. A `Place` is that cut, seen by an
optimizer: every rank's range, and where this rank's range sits in the tensor it steps.
It is all a whole-matrix optimizer needs to know of a strategy, and the same on every
rank but for the window.

Which rank orthogonalizes a matrix is decided here too, the same way on every rank:
`owners_by_size` (the owner design: each matrix to the least loaded rank, largest
first) and `sole_holders` (whole-matrix shards: the one rank that holds it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Ranges = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, eq=False)
class Place:
    """One parameter as a strategy laid it out: every rank's (rank, start, stop) of its
    flattened elements (ranks of the strategy's group; ranks holding none left out), and
    this rank's elements as `window` of `tensor` flattened, the tensor the optimizer
    steps (a ZeRO chunk, a ZeRO-3 flat shard, an FSDP2 row shard, a DTensor). A rank
    that holds none of it has an empty window in the tensor every rank steps for it."""

    name: str
    shape: torch.Size
    tensor: torch.Tensor
    window: slice
    ranges: Ranges

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's elements of `t` (the stepped tensor, or its gradient): a 1-D view."""
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.view(-1)[self.window]


def dim0_ranges(shape: tuple[int, ...], world: int) -> Ranges:
    """FSDP2's cut (ours and PyTorch's `fully_shard`, as `torch.chunk`): ceil(d0/N) rows a
    rank, as ranges of the flattened parameter."""
    rows = -(-shape[0] // world)
    cols = math.prod(shape[1:])
    out = []
    for r in range(world):
        a, z = min(r * rows, shape[0]) * cols, min((r + 1) * rows, shape[0]) * cols
        if z > a:
            out.append((r, a, z))
    return tuple(out)


def owners_by_size(matrices: list[tuple[str, int]], world: int) -> dict[str, int]:
    """{name: rank} for (name, elements) pairs: largest first, each to the rank with the
    fewest elements so far (the lowest rank on a tie), so every rank orthogonalizes about
    1/N of the elements and every rank computes the same answer."""
    load = [0] * world
    owner = {}
    for name, numel in sorted(matrices, key=lambda m: -m[1]):
        r = min(range(world), key=lambda k: (load[k], k))
        owner[name] = r
        load[r] += numel
    return owner


def sole_holders(places: list[Place]) -> dict[str, int]:
    """{name: the one rank that holds it} for a layout that cuts between matrices;
    refused in one line, naming the matrix, where a layout cuts through one."""
    owner = {}
    for p in places:
        if len(p.ranges) != 1:
            raise ValueError(
                f"muon:whole needs each matrix whole on one rank, and {p.name!r} is cut "
                f"across ranks {[r for r, _, _ in p.ranges]}: use muon:gather or "
                f"muon:owner with this strategy")
        owner[p.name] = p.ranges[0][0]
    return owner
