"""`ZeroOptimizer`: ZeRO-1 or ZeRO-2 around any torch.optim optimizer, as one object made
of parts that each own their state:

    layout.py   which elements of which parameters each bucket holds, and each rank owns
    flat.py     the flat buffers the model's parameters are views of, and my shards
    stage1.py   `StepReducer`: stage 1's whole gradients, reduce-scattered in step()
    stage2.py   `BackwardReducer`: stage 2's, reduce-scattered bucket by bucket in backward
    gather.py   `ParamAllGather`: the parameters' all-gather, plain or overlapped

Every part marks what it does on the step's tracer (`shardlab.trace`), under its bucket's
index, for the timelines.

The stages differ only in their gradients (the reducer); this module is the step they
share. Why it is still the same optimizer: Adam, AdamW and SGD are elementwise, so
stepping the chunks is the same arithmetic as stepping the parameters (hyperparameters
are per group, which is why each group gets its own flat buffer).

One step, per bucket of psi_b elements (padded), on every rank: this rank's averaged
gradient chunk (how it got here is the reducer's), the inner optimizer steps this rank's
chunks, and the bucket's parameters are all-gathered (psi_b). A parameter that gets no
gradient in a step is stepped with a zero gradient (as in DeepSpeed): with weight decay
it still decays, where torch.optim would skip it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardlab import trace
from shardlab.buckets import DEFAULT_BUCKET_MB
from shardlab.clip import GradClip
from shardlab.muon import Place
from shardlab.precision import InnerOptimizerFace
from shardlab.strategy import Piece, state_of, tied_names
from shardlab.zero.flat import FlatGroup, flatten_group
from shardlab.zero.gather import ParamAllGather
from shardlab.zero.layout import (Bucket, bucket_numel_for, check_bucket_mb,
                                  check_bucket_numel, split_groups)
from shardlab.zero.stage1 import StepReducer
from shardlab.zero.stage2 import BackwardReducer


class _LazyCast(dict):
    """bucket -> its chunk cast to its shard's dtype when read, not before."""

    def __getitem__(self, key):
        grad, shard = super().__getitem__(key)
        return grad.to(shard.dtype)


class ZeroOptimizer(InnerOptimizerFace):
    """ZeRO-1 (`stage=1`, the default) or ZeRO-2 (`stage=2`) around any torch.optim
    optimizer class: `ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`.

    Use it like the optimizer it wraps: `loss.backward(); opt.step(); opt.zero_grad()`.
    The optimizer built inside (`.optimizer`) steps only this rank's chunks, or fp32
    master copies of them when `master_weights`, so its state is 1/N of the usual.
    `param_order` (the model's parameters in forward order) decides the order in which
    stage 2 reduces its buckets and in which the step updates and gathers them; every
    rank must use the same order. Buckets hold about `bucket_mb` MB of parameters (or
    `bucket_numel` elements, when given). `gradient_collective="all-reduce"` sums each
    bucket's gradients on every rank and keeps this rank's chunk, as DeepSpeed's stages 1
    and 2 do by default, instead of reduce-scattering them (`layout.GRADIENT_COLLECTIVES`).

    With `overlap_all_gather`, `step()` returns with the all-gathers still in flight, and
    `module` (the model) gets a hook before each submodule's forward that waits for the
    buckets holding that submodule's own parameters. The inner optimizer is then stepped
    once per bucket (its step hooks run once per bucket).

    `build(groups, places=..., group=...)` (an `OptimizerSpec`'s build), when given,
    builds the inner optimizer instead of `optimizer_class(groups, **defaults)`, told
    where each parameter's elements are (`places`): what an optimizer that needs whole
    matrices (Muon) must know. A group with `whole_params: True` is laid out with every
    parameter whole on one rank (`shardlab.zero.layout.whole_offsets`).
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 *, stage: int = 1, master_weights: bool = False,
                 bucket_mb: float = DEFAULT_BUCKET_MB, bucket_numel: int | None = None,
                 overlap_all_gather: bool = False, module: nn.Module | None = None,
                 process_group=None, param_order: Sequence[nn.Parameter] | None = None,
                 clip: GradClip | None = None, build: Callable | None = None,
                 gradient_collective: str = "reduce-scatter", **defaults: Any):
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer implements stages 1 and 2, got stage={stage!r}; "
                             f"stage 3 is the strategy zero3 (shardlab.zero3.wrap_zero3)")
        if bucket_numel is not None:
            check_bucket_numel(bucket_numel)
        else:
            check_bucket_mb(bucket_mb)
        if overlap_all_gather and module is None:
            raise ValueError("overlap_all_gather needs module=the model, whose forward "
                             "waits for the all-gathers")
        self.stage = stage
        self.master_weights = master_weights
        self.clip = clip  # on this rank's averaged gradient chunks, before the step
        if clip is not None and clip.group is None:
            clip.group = process_group  # the norm is summed over the ranks that shard
        self.overlap_all_gather = bool(overlap_all_gather)
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.groups: list[FlatGroup] = [
            flatten_group(gi, spec, self.world, self.rank,
                          bucket_numel or bucket_numel_for(bucket_mb,
                                                           spec["params"][0].element_size()),
                          master_weights)
            for gi, spec in enumerate(split_groups(params))]
        # What the stages differ in: where the gradients live, when they are reduced.
        self.reducer = (StepReducer(self.groups, process_group, gradient_collective)
                        if stage == 1 else
                        BackwardReducer(self.groups, process_group, param_order,
                                        gradient_collective))
        inner = [{**g.hyper, "params": g.shards} for g in self.groups]
        self.optimizer = (optimizer_class(inner, **defaults) if build is None else
                          build(inner, places=lambda: self.places(module),
                                group=process_group))
        self.gather = ParamAllGather(self.groups, process_group, param_order)
        if self.overlap_all_gather:
            self.gather.wait_before_forward(module)

    # ------------------------------------------------------------------ torch.optim face

    @torch.no_grad()
    def step(self) -> None:
        self.gather.wait_all()  # gathers a forward did not wait for (an unused module's)
        grads = self._stepped_grads()
        if self.overlap_all_gather:
            self._step_bucket_by_bucket(grads)
            return
        for g in self.groups:
            for b, shard in zip(g.buckets, g.shards):
                shard.grad = grads[b]
        with trace.span("optimizer step"):
            self.optimizer.step()
        for gi, g in enumerate(self.groups):
            for b, shard in zip(g.buckets, g.shards):
                shard.grad = None  # stage 1's reduced gradient was a temporary
                if self.master_weights:
                    g.my_chunk(b).copy_(shard)
            self.gather.all_gather(g, scratch=self.reducer.free_after_step(gi))

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients. The stage's gradient buffer is persistent by design: it is
        zeroed, never freed (`set_to_none` is accepted for torch.optim's signature)."""
        self.reducer.zero_grad()

    def wait_for_params(self) -> None:
        """Wait for the all-gathers in flight: the parameters are whole again."""
        self.gather.wait_all()

    def _stepped_grads(self) -> dict[Bucket, torch.Tensor]:
        """Each bucket's averaged gradient chunk, in the dtype its shard steps (fp32 under
        master weights). With clipping, all of them scaled by the global norm first: each
        element is counted once, on the rank that owns it (ZeRO-1's full gradients before
        the reduce-scatter would count every element N times), so one scalar all-reduce
        gives the norm. Without, each chunk is cast when its bucket steps, so that
        bf16-mixed holds one bucket's fp32 copy at a time."""
        chunks = {}
        for gi, g in enumerate(self.groups):
            for b, shard, grad in zip(g.buckets, g.shards, self.reducer.averaged_chunks(gi)):
                chunks[b] = (grad, shard)
        if self.clip is None:
            return _LazyCast(chunks)
        cast = {b: grad.to(shard.dtype) for b, (grad, shard) in chunks.items()}
        self.clip.clip(cast.values())
        return cast

    def _step_bucket_by_bucket(self, grads) -> None:
        """Update one bucket's chunk, start its all-gather, go on to the next bucket while
        it travels; the next forward waits for each bucket where it is first needed."""
        for b in self.gather.in_forward_order:
            g = self.groups[b.group]
            shard = g.shards[b.index]
            shard.grad = grads[b]
            with trace.span("optimizer step", b.index):
                self.optimizer.step()  # only the shard with a gradient moves
            shard.grad = None
            if self.master_weights:
                g.my_chunk(b).copy_(shard)
            self.gather.start(b)
        for gi in range(len(self.groups)):  # as the plain step leaves them (stage 1: None)
            self.reducer.free_after_step(gi)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Everything kept between steps, by category (what shardlab.measure counts)."""
        optimizer = [t for state in self.optimizer.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor)]
        if self.master_weights:
            optimizer += [s for g in self.groups for s in g.shards]
        return {"params": [g.flat_param for g in self.groups], "grads": self.reducer.kept(),
                "optimizer": optimizer, "buffers": []}

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    # ------------------------------------------------------------------ checkpoints

    def pieces(self, module: nn.Module) -> list[Piece]:
        """This rank's pieces of every parameter, as the layout cuts them; frozen
        parameters, which no bucket holds, are whole on every rank."""
        self.wait_for_params()
        names = tied_names(module)
        out = []
        for g in self.groups:
            for b, shard in zip(g.buckets, g.shards):
                mine_start = self.rank * b.chunk_numel  # in the bucket
                for i, p in enumerate(b.params):
                    ranges = b.ranges(i)
                    a, z = next(((a, z) for r, a, z in ranges if r == self.rank), (0, 0))
                    lo = b.offsets[i]
                    window = slice(lo + a - mine_start, lo + z - mine_start) if z > a \
                        else slice(0, 0)   # this piece in my chunk; empty: none of it here
                    values = g.flat_param[b.start + lo + a:b.start + lo + z] if z > a \
                        else g.flat_param[:0]
                    out.append(Piece(
                        names[id(p)][0], p.shape, a, z, values, ranges,
                        master=shard.detach()[window] if self.master_weights else None,
                        optimizer_state=state_of(self.optimizer, shard, window),
                        aliases=tuple(names[id(p)][1:])))
        trained = {id(p) for g in self.groups for b in g.buckets for p in b.params}
        out += [Piece(name, p.shape, 0, p.numel(), p.detach().reshape(-1),
                      aliases=tuple(names[id(p)][1:]))
                for name, p in module.named_parameters() if id(p) not in trained]
        return out

    def places(self, module: nn.Module) -> list[Place]:
        """Where every trainable parameter's elements are: each rank's range of it, and
        this rank's window in the chunk of its bucket that the inner optimizer steps
        (every rank steps the same bucket's chunk for it, even an empty window)."""
        names = tied_names(module)
        out = []
        for g in self.groups:
            for b, shard in zip(g.buckets, g.shards):
                mine_start = self.rank * b.chunk_numel
                for i, p in enumerate(b.params):
                    ranges = b.ranges(i)
                    a, z = next(((a, z) for r, a, z in ranges if r == self.rank), (0, 0))
                    lo = b.offsets[i] - mine_start
                    out.append(Place(names[id(p)][0], p.shape, shard,
                                     slice(lo + a, lo + z) if z > a else slice(0, 0),
                                     tuple(ranges)))
        return out

    def all_gather_all(self) -> None:
        """Every rank's chunks into every rank's buffers (after a checkpoint loaded this
        rank's chunks only)."""
        self.wait_for_params()
        for g in self.groups:
            if self.master_weights:
                for b, shard in zip(g.buckets, g.shards):
                    g.my_chunk(b).copy_(shard)
            self.gather.all_gather(g)


class Zero1Optimizer(ZeroOptimizer):
    """ZeRO-1: `ZeroOptimizer(..., stage=1)`; gradients whole until step() reduce-scatters
    them (`shardlab.zero.stage1`)."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 **kwargs: Any):
        super().__init__(params, optimizer_class, stage=1, **kwargs)


class Zero2Optimizer(ZeroOptimizer):
    """ZeRO-2: `ZeroOptimizer(..., stage=2)`; gradients reduce-scattered bucket by bucket
    during backward (`shardlab.zero.stage2`)."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 **kwargs: Any):
        super().__init__(params, optimizer_class, stage=2, **kwargs)
