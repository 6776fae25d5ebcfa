"""ZeRO-1: the optimizer state sharded N ways; the gradients stay whole until the step.

    backward: full gradients accumulate in place into the flat gradient buffer (every
              .grad is a view of it), as in plain data parallelism
    step():   reduce-scatter each bucket's gradients -> my averaged chunk          psi_b
              step my chunks; all-gather the bucket's parameters                   psi_b

Both collectives run in `step()`, so nothing happens during backward and micro-batches
accumulate locally for free. 2 psi logical bytes per step, as much as DDP's all-reduce.
"""

from __future__ import annotations

import torch

from shardlab.comm import reduce_scatter_into
from shardlab.zero.buckets import FlatGroup
from shardlab.zero.optimizer import ZeroOptimizer


class Zero1Optimizer(ZeroOptimizer):
    """ZeRO-1 (`stage = 1`): see `ZeroOptimizer` for the arguments."""

    stage = 1

    def allocate_grads(self, g: FlatGroup, shard_numel: int) -> None:
        g.flat_grad = torch.zeros_like(g.flat_param)
        self._attach_grads(g)

    def sharded_grads(self, g: FlatGroup) -> torch.Tensor:
        return self.reduce_scatter_grads(g)

    def kept_grads(self, g: FlatGroup) -> torch.Tensor:
        return g.flat_grad

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients. The flat gradient is a persistent buffer by design: it is
        zeroed, never freed."""
        for g in self.groups:
            g.flat_grad.zero_()
            self._attach_grads(g)

    def reduce_scatter_grads(self, g: FlatGroup) -> torch.Tensor:
        """Stage 1: my chunks of the gradients averaged over the ranks, one reduce-scatter
        per bucket, straight out of the flat gradient buffer (no copy)."""
        self._attach_grads(g)
        grad = torch.empty_like(g.flat_param[:sum(b.chunk_numel(self.world)
                                                  for b in g.buckets)])
        for b in g.buckets:
            c = b.chunk_numel(self.world)
            with self.traced("reduce-scatter", b.index):
                reduce_scatter_into(grad[b.shard_start:b.shard_start + c],
                                    b.region(g.flat_grad), group=self.process_group)
        return grad.div_(self.world)

    @staticmethod
    def _attach_grads(g: FlatGroup) -> None:
        """Stage 1: point every .grad at its slice of the flat gradient, so autograd
        accumulates into it in place. If something replaced a .grad (model.zero_grad(),
        say), its value is copied back into the flat buffer first."""
        for b in g.buckets:
            for p, offset in zip(b.params, b.offsets):
                view = g.flat_grad[b.start + offset:b.start + offset + p.numel()].view_as(p)
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view
