"""ZeRO-2: the gradients sharded too, reduce-scattered bucket by bucket during backward.

    backward: each gradient is copied into its bucket's buffer and freed; when a bucket
              is complete its reduce-scatter starts, asynchronously (backward goes on
              meanwhile); when it is done, my chunk is added to my gradient shard and
              the buffer is freed                                                  psi_b
    step():   step my chunks; all-gather the bucket's parameters                   psi_b

The same 2 psi logical bytes per step as ZeRO-1 and DDP; what changes is that no rank
ever holds the whole gradient, only the buckets in flight (at most `MAX_IN_FLIGHT`) and
its 1/N shard. Everything here runs from autograd's hooks, in `BackwardReducer`; the step
and the all-gather are `ZeroOptimizer`'s.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardlab import trace
from shardlab.comm.compat import reduce_scatter_into
from shardlab.strategy import grad_ready_hook
from shardlab.zero.flat import FlatGroup
from shardlab.zero.layout import Bucket, check_gradient_collective, in_backward_order


class BackwardReducer:
    """Stage 2's gradients: reduce-scattered bucket by bucket as backward produces them,
    into one gradient shard per group, the only gradient a rank keeps between steps.

    It owns all of it: the shards, each bucket's gradient buffer while it fills, which
    parameters a bucket still waits for, and the reduce-scatters in flight."""

    # Bucket reduce-scatters in flight at once during backward: each one keeps its
    # bucket's full gradients until it completes.
    MAX_IN_FLIGHT = 2

    def __init__(self, groups: list[FlatGroup], process_group,
                 param_order: Sequence[nn.Parameter] | None,
                 collective: str = "reduce-scatter"):
        self.groups = groups
        self.process_group = process_group
        self.collective = check_gradient_collective(collective)
        buckets = [b for g in groups for b in g.buckets]
        # Reduce first the bucket whose parameters come last in the model: its gradients
        # are complete first.
        self.in_backward_order = in_backward_order(buckets, param_order)
        # A persistent buffer by design: zeroed by the step and by zero_grad(), never freed.
        self.grad_shards = [torch.zeros(g.shard_numel, dtype=g.flat_param.dtype,
                                        device=g.flat_param.device) for g in groups]
        # whether each shard is zero still (no backward since it was zeroed): the step
        # zeroes it, and zero_grad() after the step need not write it again
        self.zeroed = [True] * len(groups)
        self.buffers: dict[Bucket, torch.Tensor] = {}   # buckets being filled
        self.waiting: dict[Bucket, set[int]] = {}       # their parameters without a gradient
        self.in_flight: list[tuple[Bucket, torch.Tensor, Any]] = []   # (bucket, my chunk, work)
        self.next_bucket = 0        # in_backward_order's next bucket to reduce
        self.in_backward = False
        self.to_free: list[nn.Parameter] = []
        self._reset()
        for k, b in enumerate(self.in_backward_order):  # a hook names its bucket by k
            for i, p in enumerate(b.params):
                p.register_post_accumulate_grad_hook(grad_ready_hook(self._on_grad_ready, k, i))

    def averaged_chunks(self, gi: int) -> list[torch.Tensor]:
        """My chunk of each bucket of group `gi` (in the group's order), its gradients
        averaged over the ranks: reduced during backward, the step only reads them."""
        return [self.grad_shards[gi][b.in_shard] for b in self.groups[gi].buckets]

    @torch.no_grad()
    def zero_grad(self) -> None:
        for gi, shard in enumerate(self.grad_shards):
            if not self.zeroed[gi]:
                shard.zero_()
                self.zeroed[gi] = True

    def kept(self) -> list[torch.Tensor]:
        """The gradients kept between steps (what `shardlab.measure` counts)."""
        return self.grad_shards

    @torch.no_grad()
    def free_after_step(self, gi: int) -> None:
        """The step consumed group `gi`'s gradient: its shard is zeroed here, as stage 1's
        step frees its full gradients and DeepSpeed's step frees both stages' (the same
        `step` in deepspeed/runtime/zero/stage_1_and_2.py), so that zeroing the model
        (`model.zero_grad()`, which cannot reach this shard) is as good as zeroing the
        optimizer. No whole-size buffer is free after the step here: returns None."""
        if not self.zeroed[gi]:
            self.grad_shards[gi].zero_()
            self.zeroed[gi] = True
        return None

    # ------------------------------------------------------------------ backward hooks

    def _reset(self) -> None:
        self.next_bucket = 0
        self.waiting = {b: set(range(len(b.params))) for b in self.in_backward_order}
        self.buffers.clear()

    @torch.no_grad()
    def _on_grad_ready(self, k: int, i: int, p: nn.Parameter) -> None:
        b = self.in_backward_order[k]
        if not self.in_backward:
            # Once per backward, after its last hook: reduce what is left (parameters that
            # took no part in this step count as zero gradients) and reset the buckets.
            self.in_backward = True
            self.zeroed = [False] * len(self.groups)  # this backward adds into them
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        # The previous full gradient goes now, not in its own hook: hooks registered later
        # (a memory tracker's) must still find it.
        self._free_full_grads()
        self._complete_finished()
        with trace.span("gradient into bucket", b.index):
            if b not in self.buffers:
                self.buffers[b] = self._new_buffer(b, p)
            self.buffers[b][b.offsets[i]:b.offsets[i] + p.numel()].copy_(p.grad.reshape(-1))
        self.waiting[b].discard(i)
        self.to_free.append(p)
        self._reduce_ready_buckets()

    @staticmethod
    def _new_buffer(b: Bucket, p: nn.Parameter) -> torch.Tensor:
        """A bucket's gradient buffer, zeroed only where no gradient will be copied: the
        padding (at the end, or between the parameters of a `whole_params` layout). The
        slots of parameters that get no gradient are zeroed when the bucket is reduced.
        Zeroing it all would write every gradient's bytes once more each step."""
        if b.offsets != tuple(sum(q.numel() for q in b.params[:i])
                              for i in range(len(b.params))):
            return torch.zeros(b.padded_numel, dtype=p.dtype, device=p.device)
        buffer = torch.empty(b.padded_numel, dtype=p.dtype, device=p.device)
        buffer[b.numel:].zero_()
        return buffer

    def _free_full_grads(self) -> None:
        for p in self.to_free:
            p.grad = None
        self.to_free.clear()

    def _reduce_ready_buckets(self, flush: bool = False) -> None:
        while self.next_bucket < len(self.in_backward_order):
            b = self.in_backward_order[self.next_bucket]
            if self.waiting[b] and not flush:
                return  # every rank reduces in the same order: wait for this one
            self._reduce_bucket(b)
            self.next_bucket += 1

    def _reduce_bucket(self, b: Bucket) -> None:
        """Start the bucket's reduce-scatter without waiting for it: backward goes on
        computing earlier layers meanwhile."""
        g = self.groups[b.group]
        if b not in self.buffers:  # no parameter of the bucket had a gradient
            self.buffers[b] = torch.zeros_like(b.region(g.flat_param))
        buffer = self.buffers[b]
        for i in self.waiting[b]:  # took no part in this step: a zero gradient
            buffer[b.offsets[i]:b.offsets[i] + b.params[i].numel()].zero_()
        trace.mark(self.collective, b.index)
        if self.collective == "all-reduce":  # the whole sum comes back; my chunk is a view
            work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
            c = b.chunk_numel
            rank = dist.get_rank(self.process_group)
            mine = buffer[rank * c:(rank + 1) * c]
        else:
            mine = torch.empty(b.chunk_numel, dtype=buffer.dtype, device=buffer.device)
            work = reduce_scatter_into(mine, buffer, group=self.process_group,
                                       async_op=True)
        self.in_flight.append((b, mine, work))
        while len(self.in_flight) > self.MAX_IN_FLIGHT:
            self._complete_oldest()

    def _complete_finished(self) -> None:
        """Take in the reduce-scatters that have already finished, without waiting."""
        while self.in_flight and self.in_flight[0][2].is_completed():
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        b, mine, work = self.in_flight.pop(0)
        work.wait()
        trace.mark(self.collective, b.index, "end")  # seen finished (or waited for) here
        # add, not copy: gradient accumulation sums the micro-batches into the shard
        self.grad_shards[b.group][b.in_shard].add_(mine.div_(b.world))
        del self.buffers[b]

    def _finish_backward(self) -> None:
        with torch.no_grad():
            self._free_full_grads()
            self._reduce_ready_buckets(flush=True)
            while self.in_flight:
                self._complete_oldest()
        self.in_backward = False
        self._reset()
