"""The all-gather of ZeRO-1 and ZeRO-2: every rank's updated chunks back into every rank's
flat buffers, at once or overlapped with the next forward.

Done plainly, the all-gather runs after the optimizer step with nothing to hide behind:
the whole step waits for it, and it is one collective for all the buckets. With
`overlap_all_gather` (by default where the backend's collectives run beside the compute:
NCCL, not gloo, `steptime.overlaps_beside_compute`) it is hidden, as
Megatron-LM's distributed optimizer hides it: the step updates the buckets one by one in
forward order and starts each bucket's all-gather as soon as its chunk is updated,
without waiting (it runs while the next buckets are stepped); a hook before each module's
forward waits for the bucket that holds the module's parameters, so the next forward's
first layers compute while the later buckets are still in flight. Anything that reads the
parameters outside a forward (a checkpoint, `full_parameters`) waits for all of them
first (`wait_all`). The arithmetic is the same, so the result is the same to the bit.

A module of its own because it is the same for both stages and is where the overlap
lives: a reader of how a stage shards its gradients can skip it.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch import nn

from shardlab import trace
from shardlab.comm.compat import all_gather_into
from shardlab.zero.flat import FlatGroup
from shardlab.zero.layout import Bucket, in_forward_order


class ParamAllGather:
    """The parameters' all-gathers over `groups`, and the ones in flight."""

    def __init__(self, groups: list[FlatGroup], process_group,
                 param_order: Sequence[nn.Parameter] | None):
        self.groups = groups
        self.process_group = process_group
        # The order the step updates and gathers the buckets in when it overlaps.
        self.in_forward_order = in_forward_order([b for g in groups for b in g.buckets],
                                                 param_order)
        self.in_flight: dict[Bucket, Any] = {}   # bucket -> its all-gather's work

    def all_gather(self, g: FlatGroup, scratch: torch.Tensor | None = None) -> None:
        """Every rank's chunks of group `g` into every rank's flat buffer, in one
        collective. A collective pays a fixed cost per call as well as per byte (on gloo
        ranks sharing a CPU, milliseconds), so nothing overlapped, one call for the group
        is cheaper than one per bucket: DeepSpeed's stages 1 and 2 gather once too
        (`all_gather_dp_groups`, deepspeed/runtime/utils.py). A rank's chunks are not
        contiguous in the flat buffer (bucket by bucket, rank by rank), so they travel
        packed, and each bucket's N chunks are copied back into place. They land in
        `scratch` (a buffer of the group's size that is free: stage 1's gradients after
        the step), else in a transient buffer the size of the group."""
        if len(g.buckets) == 1:  # the chunks already lie rank by rank: gather in place
            b = g.buckets[0]
            with trace.span("all-gather", b.index):
                all_gather_into(b.region(g.flat_param), g.my_chunk(b),
                                group=self.process_group)
            return
        world = g.buckets[0].world
        mine = torch.cat([g.my_chunk(b) for b in g.buckets])  # my shard, packed
        every = (mine.new_empty(world * mine.numel()) if scratch is None
                 else scratch[:world * mine.numel()])
        with trace.span("all-gather", f"group {g.buckets[0].group}"):  # all its buckets
            all_gather_into(every, mine, group=self.process_group)
        by_rank = every.view(world, mine.numel())
        for b in g.buckets:
            b.region(g.flat_param).view(world, b.chunk_numel).copy_(by_rank[:, b.in_shard])

    def start(self, b: Bucket) -> None:
        """Start bucket `b`'s all-gather and return at once; `wait` ends it."""
        g = self.groups[b.group]
        trace.mark("all-gather", b.index)
        work = all_gather_into(b.region(g.flat_param), g.my_chunk(b),
                               group=self.process_group, async_op=True)
        trace.end_when_done(work, "all-gather", b.index)
        self.in_flight[b] = work

    def wait(self, b: Bucket) -> None:
        work = self.in_flight.pop(b, None)
        if work is not None:
            with trace.span("wait for all-gather", b.index):
                work.wait()

    def wait_all(self) -> None:
        """Wait for every all-gather in flight: the parameters are whole again."""
        for b in self.in_forward_order:
            self.wait(b)

    def wait_before_forward(self, module: nn.Module) -> None:
        """Before each submodule's forward, wait for the buckets of its own parameters."""
        bucket_of = {id(p): b for g in self.groups for b in g.buckets for p in b.params}
        order = {b: k for k, b in enumerate(self.in_forward_order)}
        for sub in module.modules():
            mine = {bucket_of[id(p)] for p in sub.parameters(recurse=False)
                    if id(p) in bucket_of}
            if mine:
                sub.register_forward_pre_hook(functools.partial(
                    self._wait_for, sorted(mine, key=order.__getitem__)))

    def _wait_for(self, buckets: list[Bucket], module, args) -> None:
        for b in buckets:
            self.wait(b)
