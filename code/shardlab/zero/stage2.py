"""ZeRO-2: the gradients sharded too, reduce-scattered bucket by bucket during backward.

    backward: each gradient is copied into its bucket's buffer and freed; when a bucket
              is complete its reduce-scatter starts, asynchronously (backward goes on
              meanwhile); when it is done, my chunk is added to my gradient shard and
              the buffer is freed                                                  psi_b
    step():   step my chunks; all-gather the bucket's parameters                   psi_b

The same 2 psi logical bytes per step as ZeRO-1 and DDP; what changes is that no rank
ever holds the whole gradient, only the buckets in flight (at most `MAX_IN_FLIGHT`) and
its 1/N shard. Everything here runs from autograd's hooks.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch import nn

from shardlab.comm import reduce_scatter_into
from shardlab.zero.buckets import Bucket, FlatGroup
from shardlab.zero.optimizer import ZeroOptimizer


class Zero2Optimizer(ZeroOptimizer):
    """ZeRO-2 (`stage = 2`): see `ZeroOptimizer` for the arguments."""

    stage = 2
    # Bucket reduce-scatters in flight at once during backward.
    MAX_IN_FLIGHT = 2

    def allocate_grads(self, g: FlatGroup, shard_numel: int) -> None:
        flat = g.flat_param
        g.grad_shard = torch.zeros(shard_numel, dtype=flat.dtype, device=flat.device)

    def prepare_backward(self, param_order: Sequence[nn.Parameter] | None) -> None:
        self._prepare_backward_hooks(param_order)

    def sharded_grads(self, g: FlatGroup) -> torch.Tensor:
        return g.grad_shard  # reduced during backward: the step only reads it

    kept_grads = sharded_grads  # and it is all the gradient a rank keeps between steps

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients. The gradient shard is a persistent buffer by design: it is
        zeroed, never freed."""
        for g in self.groups:
            g.grad_shard.zero_()

    # ------------------------------------------------------------------ backward hooks

    def _prepare_backward_hooks(self, param_order: Sequence[nn.Parameter] | None) -> None:
        owned = [(b, i) for g in self.groups for b in g.buckets for i in range(len(b.params))]
        order = list(param_order) if param_order is not None else \
            [b.params[i] for b, i in owned]
        position = {id(p): k for k, p in enumerate(order)}
        if any(id(b.params[i]) not in position for b, i in owned):
            raise ValueError("param_order must list every trainable parameter")
        # Reduce first the bucket whose parameters come last in the model: its gradients
        # are complete first. A fixed order, the same on every rank, so collectives pair up.
        self.buckets = sorted((b for g in self.groups for b in g.buckets),
                              key=lambda b: (-max(position[id(p)] for p in b.params),
                                             b.group, -b.start))
        self._next_bucket = 0
        self._in_backward = False
        self._to_free: list[nn.Parameter] = []
        self._in_flight: list[tuple[Bucket, torch.Tensor, Any]] = []
        self._reset_buckets()
        for b, i in owned:
            b.params[i].register_post_accumulate_grad_hook(
                functools.partial(self._on_grad_ready, b, i))

    def _reset_buckets(self) -> None:
        self._next_bucket = 0
        for b in self.buckets:
            b.waiting = set(range(len(b.params)))
            b.grad_buffer = None

    @torch.no_grad()
    def _on_grad_ready(self, b: Bucket, i: int, p: nn.Parameter) -> None:
        if not self._in_backward:
            # Once per backward, after its last hook: reduce what is left (parameters that
            # took no part in this step count as zero gradients) and reset the buckets.
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        # The previous full gradient goes now, not in its own hook: hooks registered later
        # (a memory tracker's) must still find it.
        self._free_full_grads()
        self._complete_finished()
        with self.traced("gradient into bucket", b.index):
            if b.grad_buffer is None:
                b.grad_buffer = torch.zeros(b.padded_numel, dtype=p.dtype, device=p.device)
            b.grad_buffer[b.offsets[i]:b.offsets[i] + p.numel()].copy_(p.grad.reshape(-1))
        b.waiting.discard(i)
        self._to_free.append(p)
        self._reduce_ready_buckets()

    def _free_full_grads(self) -> None:
        for p in self._to_free:
            p.grad = None
        self._to_free.clear()

    def _reduce_ready_buckets(self, flush: bool = False) -> None:
        while self._next_bucket < len(self.buckets):
            b = self.buckets[self._next_bucket]
            if b.waiting and not flush:
                return  # every rank reduces in the same order: wait for this one
            self._reduce_bucket(b)
            self._next_bucket += 1

    def _reduce_bucket(self, b: Bucket) -> None:
        """Start the bucket's reduce-scatter without waiting for it: backward goes on
        computing earlier layers meanwhile. At most MAX_IN_FLIGHT buckets are in flight,
        since each one keeps its full gradients until it completes."""
        g = self.groups[b.group]
        if b.grad_buffer is None:  # no parameter of the bucket had a gradient
            b.grad_buffer = torch.zeros_like(b.region(g.flat_param))
        mine = torch.empty(b.chunk_numel(self.world), dtype=b.grad_buffer.dtype,
                           device=b.grad_buffer.device)
        self.trace("reduce-scatter", b.index, "start")
        work = reduce_scatter_into(mine, b.grad_buffer, group=self.process_group,
                                   async_op=True)
        self._in_flight.append((b, mine, work))
        while len(self._in_flight) > self.MAX_IN_FLIGHT:
            self._complete_oldest()

    def _complete_finished(self) -> None:
        """Take in the reduce-scatters that have already finished, without waiting."""
        while self._in_flight and self._in_flight[0][2].is_completed():
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        b, mine, work = self._in_flight.pop(0)
        work.wait()
        self.trace("reduce-scatter", b.index, "end")  # seen finished (or waited for) here
        g, c = self.groups[b.group], b.chunk_numel(self.world)
        # add, not copy: gradient accumulation sums the micro-batches into the shard
        g.grad_shard[b.shard_start:b.shard_start + c].add_(mine.div_(self.world))
        b.grad_buffer = None

    def _finish_backward(self) -> None:
        with torch.no_grad():
            self._free_full_grads()
            self._reduce_ready_buckets(flush=True)
            while self._in_flight:
                self._complete_oldest()
        self._in_backward = False
        self._reset_buckets()

