"""The all-gather phase of ZeRO-1 and ZeRO-2: every rank's updated chunks back into every
rank's flat buffer, at once or overlapped with the next forward.

Done plainly, the all-gather runs after the optimizer step with nothing to hide behind:
the whole step waits for it. With `overlap_all_gather` (the default) it is hidden, as
Megatron-LM's distributed optimizer hides it: the step updates the buckets one by one in
the model's order and starts each bucket's all-gather as soon as its chunk is updated,
without waiting (it runs while the next buckets are stepped); a hook before each module's
forward waits for the bucket that holds the module's parameters, so the next forward's
first layers compute while the later buckets are still in flight. Anything that reads the
parameters outside a forward (a checkpoint, `full_parameters`) waits for all of them
first (`wait_for_params`). The arithmetic is the same, so the result is the same to the
bit.

A phase of its own because it is the same for both stages and is where the overlap
lives: a reader of how a stage shards its gradients can skip it.
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

from torch import nn

from shardlab.comm import all_gather_into
from shardlab.zero.buckets import Bucket, FlatGroup


class BucketGathers:
    """The all-gathers of `ZeroOptimizer`, mixed into it: they use its `groups`, `world`,
    `rank`, `process_group`, `events`, `trace` and `traced`, and the base sets
    `buckets_in_model_order` (from `model_order`) before any gather runs."""

    def all_gather_params(self, g: FlatGroup) -> None:
        """Every rank's updated chunks into every rank's flat buffer, in place."""
        for b in g.buckets:
            with self.traced("all-gather", b.index):
                all_gather_into(b.region(g.flat_param),
                                b.chunk(g.flat_param, self.rank, self.world),
                                group=self.process_group)

    def start_all_gather(self, g: FlatGroup, b: Bucket) -> None:
        """Start the bucket's all-gather and return at once; `wait_for_bucket` ends it."""
        self.trace("all-gather", b.index, "start")
        b.gather = all_gather_into(b.region(g.flat_param),
                                   b.chunk(g.flat_param, self.rank, self.world),
                                   group=self.process_group, async_op=True)
        if self.events is not None:  # its end is when the backend completes it
            events, index = self.events, b.index
            b.gather.get_future().then(lambda _: events.append(
                (time.perf_counter(), "all-gather", index, "end")))

    def wait_for_bucket(self, b: Bucket) -> None:
        if b.gather is not None:
            with self.traced("wait for all-gather", b.index):
                b.gather.wait()
            b.gather = None

    def wait_for_params(self) -> None:
        """Wait for every all-gather in flight: the parameters are whole again."""
        for b in self.buckets_in_model_order:
            self.wait_for_bucket(b)

    def model_order(self, param_order: Sequence[nn.Parameter] | None) -> list[Bucket]:
        """The buckets in the order the forward needs them: by their first parameter."""
        buckets = [b for g in self.groups for b in g.buckets]
        if param_order is None:
            return buckets
        position = {id(p): k for k, p in enumerate(param_order)}
        return sorted(buckets, key=lambda b: min(position.get(id(p), len(position))
                                                 for p in b.params))

    def install_forward_waits(self, module: nn.Module) -> None:
        """Before each submodule's forward, wait for the buckets of its own parameters."""
        bucket_of = {id(p): b for g in self.groups for b in g.buckets for p in b.params}
        order = {id(b): k for k, b in enumerate(self.buckets_in_model_order)}
        for sub in module.modules():
            mine = {id(bucket_of[id(p)]): bucket_of[id(p)]
                    for p in sub.parameters(recurse=False) if id(p) in bucket_of}
            if mine:
                buckets = sorted(mine.values(), key=lambda b: order[id(b)])
                sub.register_forward_pre_hook(functools.partial(self._wait_before_forward,
                                                                buckets))

    def _wait_before_forward(self, buckets: list[Bucket], module, args) -> None:
        for b in buckets:
            self.wait_for_bucket(b)

