"""The storage the layout describes: one flat buffer per parameter group, which the
model's parameters become views of, and the tensors the inner optimizer steps.

A module of its own because the all-gather, both stages' gradients and the optimizer's
step all read it, while only the optimizer builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardlab.zero.layout import Bucket, fill_buckets


@dataclass
class FlatGroup:
    """One parameter group laid flat (see `shardlab.zero.layout`), and this rank's part."""

    hyper: dict[str, Any]       # the group's own options (lr, weight_decay, ...)
    buckets: list[Bucket]       # in model order
    flat_param: torch.Tensor    # the model's parameters are views of it
    # What the inner optimizer steps: this rank's chunk of each bucket, a view of
    # `flat_param` (fp32 and "bf16"), or an fp32 copy of it (master weights).
    shards: list[torch.Tensor]
    rank: int

    @property
    def shard_numel(self) -> int:
        """Elements in this rank's shard of the group: one chunk of every bucket."""
        return sum(b.chunk_numel for b in self.buckets)

    def my_chunk(self, b: Bucket) -> torch.Tensor:
        """This rank's chunk of bucket `b`, in the flat buffer the model computes with."""
        return b.chunk(self.flat_param, self.rank)


def flatten_into_buckets(buckets: list[Bucket]) -> torch.Tensor:
    """Allocate the group's flat buffer, copy the parameters in, make them views of it."""
    first = buckets[0].params[0]
    dtypes = {p.dtype for b in buckets for p in b.params}
    devices = {p.device for b in buckets for p in b.params}
    if len(dtypes) > 1 or len(devices) > 1:
        raise ValueError(f"a parameter group must have one dtype and one device to be "
                         f"flattened; got dtypes {sorted(map(str, dtypes))} and devices "
                         f"{sorted(map(str, devices))}. Cast the model first.")
    flat = torch.zeros(sum(b.padded_numel for b in buckets), dtype=first.dtype,
                       device=first.device)
    with torch.no_grad():
        for b in buckets:
            for p, offset in zip(b.params, b.offsets):
                view = flat[b.start + offset:b.start + offset + p.numel()]
                view.copy_(p.reshape(-1))
                p.data = view.view_as(p)
    return flat


def flatten_group(index: int, spec: dict[str, Any], world: int, rank: int,
                  bucket_numel: int, master_weights: bool) -> FlatGroup:
    """Lay out parameter group `spec` (as torch.optim takes it) flat, as group `index`;
    with `whole_params` in the group, each parameter whole on one rank."""
    buckets = fill_buckets(index, spec["params"], world, bucket_numel,
                           whole_params=bool(spec.get("whole_params", False)))
    flat = flatten_into_buckets(buckets)
    mine = [b.chunk(flat, rank) for b in buckets]
    # fp32 and "bf16": step my chunks in place. bf16-mixed: fp32 copies of them.
    shards = [m.float().clone() for m in mine] if master_weights else mine
    return FlatGroup({k: v for k, v in spec.items() if k not in ("params", "whole_params")},
                     buckets, flat, shards, rank)
