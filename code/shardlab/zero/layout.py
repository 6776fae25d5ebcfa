"""The layout of ZeRO-1 and ZeRO-2: which elements of which parameters each bucket holds,
and which of them each rank owns (DeepSpeed's layout; the buckets are cut as DDP's).

The trainable parameters of one parameter group are cut into buckets of whole parameters
(`shardlab.buckets`: about `bucket_mb` MB each, filled in the order backward produces the
gradients). A group's buckets sit back to back in one flat 1-D buffer, in model order,
and the model's parameters become views of it. Each bucket is padded to a multiple of N,
so it splits into N equal chunks, and rank r owns chunk r of every bucket; a rank's
chunks, back to back, are its shard of the group. With one bucket per group this is
exactly "concatenate the group's parameters, pad to a multiple of N, rank r owns elements
[r*S, (r+1)*S)".

Layout only: numbers and orders, fixed when the optimizer is built; no buffer, no
collective. Lab 5 cuts a model into buckets with `fill_buckets` alone, and the flat
buffers, the all-gather and both stages' gradients all read the same cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from shardlab.buckets import fill_in_backward_order
from shardlab.muon import owners_by_size
from shardlab.strategy import owned_ranges
from shardlab.units import MiB


def padded_size(numel: int, world: int) -> int:
    """The smallest multiple of `world` that holds `numel` elements."""
    return -(-numel // world) * world


# eq=False: a bucket is equal only to itself (and hashes by identity), so it can key
# the runtime state the optimizer's parts keep per bucket.
@dataclass(frozen=True, eq=False)
class Bucket:
    """Whole parameters of one group, contiguous in the group's flat buffer, padded to a
    multiple of N: the unit of communication (one reduce-scatter; one all-gather when
    the all-gather is overlapped, `shardlab.zero.gather`)."""

    group: int                          # the parameter group it belongs to
    index: int                          # its place in the group, in model order
    params: tuple[nn.Parameter, ...]    # in model order
    offsets: tuple[int, ...]            # where each parameter starts inside the bucket
    numel: int                          # real elements
    padded_numel: int                   # numel rounded up to a multiple of N
    start: int                          # where the bucket starts in the group's flat buffer
    shard_start: int                    # where a rank's chunk starts in its shard of the group
    world: int                          # N: how many chunks it is cut into

    @property
    def chunk_numel(self) -> int:
        return self.padded_numel // self.world

    @property
    def in_shard(self) -> slice:
        """Where this bucket's chunk sits in a rank's shard of the group."""
        return slice(self.shard_start, self.shard_start + self.chunk_numel)

    def region(self, flat: torch.Tensor) -> torch.Tensor:
        """The bucket in the group's flat buffer."""
        return flat[self.start:self.start + self.padded_numel]

    def chunk(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s chunk of the bucket in the group's flat buffer."""
        c = self.chunk_numel
        return flat[self.start + rank * c:self.start + (rank + 1) * c]

    def ranges(self, i: int) -> list[tuple[int, int, int]]:
        """Every rank's (rank, start, stop) of parameter `i`, counted in the flattened
        parameter: a chunk can hold the end of one parameter and the start of the next."""
        lo = self.offsets[i]
        return owned_ranges(lo, lo + self.params[i].numel(), lambda r: r * self.chunk_numel,
                            self.world)


def fill_buckets(group: int, params: list[nn.Parameter], world: int,
                 bucket_numel: int, whole_params: bool = False) -> list[Bucket]:
    """Cut one group's `params` into buckets of at most `bucket_numel` elements (a larger
    parameter alone), filled in backward order as DDP's; returned in model order, each
    placed in the group's flat buffer and in a rank's shard of it. `whole_params`: each
    bucket cut between its parameters, not through them (`whole_offsets`)."""
    cut = fill_in_backward_order(params, bucket_numel * params[0].element_size())
    buckets: list[Bucket] = []
    start = shard_start = 0
    for members in reversed(cut):
        members = members[::-1]
        sizes = [p.numel() for p in members]
        numel = sum(sizes)
        if whole_params:
            offsets, padded = whole_offsets(sizes, world)
        else:
            offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
            padded = padded_size(numel, world)
        buckets.append(Bucket(group, len(buckets), tuple(members), offsets, numel, padded,
                              start, shard_start, world))
        start += padded
        shard_start += padded // world
    return buckets


def whole_offsets(sizes: list[int], world: int) -> tuple[tuple[int, ...], int]:
    """A bucket laid out so that every parameter lies whole in one rank's chunk (what an
    optimizer that needs whole matrices wants: `shardlab.muon`, "muon:whole"): the
    largest parameter first, each to the rank with the fewest elements so far (Muon's
    owner design assigns its matrices so, `shardlab.muon.owners_by_size`); the chunk
    is the fullest rank's load, and the other ranks' chunks end in padding. Returns each
    parameter's offset in the bucket and the bucket's padded size (N chunks). The price
    is that padding: every reduce-scatter and all-gather of the bucket moves N chunks."""
    rank_of = owners_by_size(list(enumerate(sizes)), world)
    load = [sum(n for i, n in enumerate(sizes) if rank_of[i] == r) for r in range(world)]
    chunk = max(1, max(load))
    filled = [r * chunk for r in range(world)]
    offsets = []
    for i, size in enumerate(sizes):  # in the bucket's order inside each rank's chunk
        offsets.append(filled[rank_of[i]])
        filled[rank_of[i]] += size
    return tuple(offsets), world * chunk


def in_forward_order(buckets: list[Bucket],
                     param_order: Sequence[nn.Parameter] | None) -> list[Bucket]:
    """The buckets in the order the forward needs them: by their first parameter in
    `param_order` (the layout's own order when None). The overlapped step updates and
    all-gathers them in this order, so the first layers' buckets arrive first."""
    if param_order is None:
        return list(buckets)
    position = {id(p): k for k, p in enumerate(param_order)}
    return sorted(buckets, key=lambda b: min(position.get(id(p), len(position))
                                             for p in b.params))


def in_backward_order(buckets: list[Bucket],
                      param_order: Sequence[nn.Parameter] | None) -> list[Bucket]:
    """The buckets in the order backward completes them: the one whose parameters come
    last in `param_order` (the layout's own order when None) first. Stage 2
    reduce-scatters in this order; it is the same on every rank, so the collectives pair
    up."""
    order = list(param_order) if param_order is not None else \
        [p for b in buckets for p in b.params]
    position = {id(p): k for k, p in enumerate(order)}
    if any(id(p) not in position for b in buckets for p in b.params):
        raise ValueError("param_order must list every trainable parameter")
    return sorted(buckets, key=lambda b: (-max(position[id(p)] for p in b.params),
                                          b.group, -b.start))


def split_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Parameter groups as torch.optim takes them, minus frozen and repeated parameters.

    A tied parameter (one tensor reached from two modules) is optimized once, in the
    first group it appears in. Groups left empty are dropped.
    """
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen: set[int] = set()
    result = []
    for group in groups:
        kept = []
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                kept.append(p)
        if kept:
            result.append({**group, "params": kept})
    if not result:
        raise ValueError("no trainable parameters: every parameter has requires_grad=False")
    return result


# How a stage reduces its gradients: a reduce-scatter hands each rank its chunk alone (the
# Ψ the ZeRO paper counts on a ring); an all-reduce hands every rank the whole sum and
# each keeps its chunk (2Ψ on a ring), DeepSpeed's default for its stages 1 and 2
# (`use_multi_rank_bucket_allreduce`, deepspeed/runtime/zero/config.py).
GRADIENT_COLLECTIVES = ("reduce-scatter", "all-reduce")


def check_gradient_collective(name: Any) -> str:
    if name not in GRADIENT_COLLECTIVES:
        raise ValueError(f"gradient_collective must be one of {GRADIENT_COLLECTIVES}, "
                         f"got {name!r}")
    return name


def check_bucket_numel(bucket_numel: Any) -> int:
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be a whole number of elements >= 1, "
                         f"got {bucket_numel!r}")
    return bucket_numel


def check_bucket_mb(bucket_mb: Any) -> float:
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) \
            or not bucket_mb > 0 or bucket_mb == float("inf"):
        raise ValueError(f"bucket_mb must be a positive number of MB (2**20 bytes), "
                         f"got {bucket_mb!r}")
    return float(bucket_mb)


def bucket_numel_for(bucket_mb: float, element_size: int) -> int:
    """Elements of `element_size` bytes in a bucket of `bucket_mb` MB (at least one)."""
    return max(1, int(check_bucket_mb(bucket_mb) * MiB) // element_size)
