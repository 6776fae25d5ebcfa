"""Buckets: the layout ZeRO-1 and ZeRO-2 share (DeepSpeed's, and PyTorch DDP's buckets).

The trainable parameters of one parameter group are cut into buckets of whole parameters
(about `bucket_mb` MB, 25 MB by default as DDP's, filled from the last parameter back,
the order backward produces gradients); all of the group's buckets live in one flat 1-D
buffer and the model's parameters become views of it. Each bucket is padded to a
multiple of N, so it splits into N equal chunks and rank r owns chunk r of every bucket.
With one bucket per group this is exactly "concatenate the group's parameters, pad to a
multiple of N, rank r owns elements [r*S, (r+1)*S)".

A module of its own because it is pure layout: no collective, no optimizer. Lab 5 cuts a
model into buckets with `fill_buckets` alone, and both stages build on the same cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

MB = 1 << 20
# MB (2**20 bytes) of parameters per bucket, in the parameters' dtype, as DDP's
# bucket_mb; a parameter larger than this gets a bucket of its own. Small buckets pay the
# fixed cost of a collective many times; large ones hold a large gradient buffer (stage
# 2) and give the all-gather less to overlap with.
DEFAULT_BUCKET_MB = 25.0


def padded_size(numel: int, world: int) -> int:
    """The smallest multiple of `world` that holds `numel` elements."""
    return -(-numel // world) * world


@dataclass
class Bucket:
    """Whole parameters of one group, contiguous in the group's flat buffer, padded to a
    multiple of N: the unit of communication (one reduce-scatter, one all-gather)."""

    group: int
    params: list[nn.Parameter]
    offsets: list[int]          # where each parameter starts inside the bucket
    numel: int                  # real elements
    padded_numel: int           # numel rounded up to a multiple of N
    index: int = 0              # its place in the group, in model order
    start: int = 0              # where the bucket starts in the group's flat buffer
    shard_start: int = 0        # where my chunk starts in the group's gradient shard
    waiting: set[int] = field(default_factory=set)   # stage 2: params without a gradient
    grad_buffer: torch.Tensor | None = None          # stage 2: the bucket's gradients
    gather: Any = None          # overlap_all_gather: its all-gather while in flight

    def chunk_numel(self, world: int) -> int:
        return self.padded_numel // world

    def region(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start:self.start + self.padded_numel]

    def chunk(self, flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        c = self.chunk_numel(world)
        return flat[self.start + rank * c:self.start + (rank + 1) * c]


def fill_buckets(group: int, params: list[nn.Parameter], world: int,
                 bucket_numel: int) -> list[Bucket]:
    """Cut `params` into buckets of whole parameters, filled from the last parameter back
    (backward produces gradients in about that order); returned in model order."""
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        if buckets[-1] and size + p.numel() > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel()
    result = []
    for members in reversed(buckets):
        members = members[::-1]
        offsets = [sum(p.numel() for p in members[:i]) for i in range(len(members))]
        numel = sum(p.numel() for p in members)
        result.append(Bucket(group, members, offsets, numel, padded_size(numel, world),
                             index=len(result)))
    return result


@dataclass
class FlatGroup:
    """One parameter group: its buckets in one flat buffer, and this rank's pieces."""

    hyper: dict[str, Any]       # the group's own options (lr, weight_decay, ...)
    buckets: list[Bucket]
    flat_param: torch.Tensor    # the model's parameters are views of it
    shards: list[torch.Tensor]  # what the optimizer steps: my chunk of each bucket
    flat_grad: torch.Tensor | None = None   # stage 1: full gradients (.grad are views)
    grad_shard: torch.Tensor | None = None  # stage 2: my chunks' averaged gradients


def flatten_into_buckets(buckets: list[Bucket]) -> torch.Tensor:
    """Allocate the group's flat buffer, copy the parameters in, make them views of it."""
    first = buckets[0].params[0]
    dtypes = {p.dtype for b in buckets for p in b.params}
    devices = {p.device for b in buckets for p in b.params}
    if len(dtypes) > 1 or len(devices) > 1:
        raise ValueError(f"a parameter group must have one dtype and one device to be "
                         f"flattened; got dtypes {sorted(map(str, dtypes))} and devices "
                         f"{sorted(map(str, devices))}. Cast the model first.")
    start = 0
    for b in buckets:
        b.start = start
        start += b.padded_numel
    flat = torch.zeros(start, dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for b in buckets:
            for p, offset in zip(b.params, b.offsets):
                view = flat[b.start + offset:b.start + offset + p.numel()]
                view.copy_(p.reshape(-1))
                p.data = view.view_as(p)
    return flat


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
    return max(1, int(check_bucket_mb(bucket_mb) * MB) // element_size)
