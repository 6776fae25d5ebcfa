"""ZeRO-1: the optimizer state sharded N ways; the gradients stay whole until the step.

    backward: full gradients accumulate in place into the flat gradient buffer (every
              .grad is a view of it), as in plain data parallelism
    step():   reduce-scatter each bucket's gradients -> my averaged chunk          psi_b
              step my chunks; all-gather the bucket's parameters                   psi_b
              (through the flat gradient buffer, free by then: the .grad are None
              after the step until zero_grad())

Both collectives run in `step()`, so nothing happens during backward and micro-batches
accumulate locally for free. 2 psi logical bytes per step, as much as DDP's all-reduce.
What a stage decides is where the gradients live and when they are reduce-scattered:
here, `StepReducer`; the step and the all-gather are `ZeroOptimizer`'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab import trace
from shardlab.comm.compat import reduce_scatter_into
from shardlab.zero.flat import FlatGroup
from shardlab.zero.layout import check_gradient_collective


class StepReducer:
    """Stage 1's gradients: whole, in one flat buffer per group laid out as the
    parameters, reduce-scattered by the step into this rank's averaged chunks."""

    def __init__(self, groups: list[FlatGroup], process_group,
                 collective: str = "reduce-scatter"):
        self.groups = groups
        self.process_group = process_group
        self.collective = check_gradient_collective(collective)
        # A persistent buffer by design, as DDP's: zeroed by zero_grad(), never freed.
        self.flat_grads = [torch.zeros_like(g.flat_param) for g in groups]
        for gi in range(len(groups)):
            self._attach_grads(gi)

    def averaged_chunks(self, gi: int) -> list[torch.Tensor]:
        """My chunk of each bucket of group `gi` (in the group's order), its gradients
        averaged over the ranks. Reduce-scattered: one per bucket, straight out of the flat
        gradient buffer into a temporary. All-reduced: each bucket summed in place in the
        flat gradient buffer, and my chunk is a view of it, averaged there (no copy)."""
        g, flat_grad = self.groups[gi], self.flat_grads[gi]
        self._attach_grads(gi)
        world = dist.get_world_size(self.process_group)
        if self.collective == "all-reduce":
            rank = dist.get_rank(self.process_group)
            for b in g.buckets:
                with trace.span(self.collective, b.index):
                    dist.all_reduce(b.region(flat_grad), group=self.process_group)
            return [b.chunk(flat_grad, rank).div_(world) for b in g.buckets]
        grad = torch.empty_like(g.flat_param[:g.shard_numel])
        for b in g.buckets:
            with trace.span(self.collective, b.index):
                reduce_scatter_into(grad[b.in_shard], b.region(flat_grad),
                                    group=self.process_group)
        grad.div_(world)
        return [grad[b.in_shard] for b in g.buckets]

    def free_after_step(self, gi: int) -> torch.Tensor:
        """Group `gi`'s flat gradient buffer, for the step to use as scratch once my
        chunks are out of it: the parameters' `.grad` become None, as DeepSpeed's stage 1
        frees the full gradients in its step (`free_grad_in_param_list` in `step`,
        deepspeed/runtime/zero/stage_1_and_2.py), and `zero_grad()` (or the next step, for a
        gradient that backward made anew) points them back at the buffer."""
        for b in self.groups[gi].buckets:
            for p in b.params:
                p.grad = None
        return self.flat_grads[gi]

    @torch.no_grad()
    def zero_grad(self) -> None:
        for gi, flat_grad in enumerate(self.flat_grads):
            flat_grad.zero_()
            self._attach_grads(gi, zeroed=True)

    def kept(self) -> list[torch.Tensor]:
        """The gradients kept between steps (what `shardlab.measure` counts)."""
        return self.flat_grads

    def _attach_grads(self, gi: int, zeroed: bool = False) -> None:
        """Point every .grad at its slice of the flat gradient, so autograd accumulates
        into it in place. If something replaced a .grad (model.zero_grad(), say), its
        value is copied back into the flat buffer first; a .grad of None (set to none, or
        freed by the step) is a zero gradient, and its slice is zeroed unless the whole
        buffer just was."""
        flat_grad = self.flat_grads[gi]
        for b in self.groups[gi].buckets:
            for p, offset in zip(b.params, b.offsets):
                view = flat_grad[b.start + offset:b.start + offset + p.numel()].view_as(p)
                if p.grad is None:
                    if not zeroed:
                        view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view
