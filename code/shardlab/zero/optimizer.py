"""What ZeRO-1 and ZeRO-2 share: the flat buckets, the optimizer step on this rank's chunks,
and the torch.optim face. The stages differ only in their gradients: see
`shardlab.zero.stage1` and `shardlab.zero.stage2`.

Why this is still the same optimizer: Adam, AdamW and SGD are elementwise, so stepping
the chunks is the same arithmetic as stepping the parameters (hyperparameters are per
group, which is why each group gets its own flat buffer).

One step, per bucket of psi_b elements (padded), on every rank: this rank's averaged
gradient chunk (how it got here is the stage's), the inner optimizer steps this rank's
chunks, and the bucket's parameters are all-gathered (psi_b, `shardlab.zero.gather`).
A parameter that gets no gradient in a step is stepped with a zero gradient (as in
DeepSpeed): with weight decay it still decays, where torch.optim would skip it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardlab.clip import GradClip
from shardlab.precision import InnerOptimizerFace
from shardlab.strategy import Piece, owned_ranges, state_of, tied_names
from shardlab.zero.buckets import (DEFAULT_BUCKET_MB, FlatGroup, bucket_numel_for,
                                   check_bucket_mb, check_bucket_numel, fill_buckets,
                                   flatten_into_buckets, split_groups)
from shardlab.zero.gather import BucketGathers


class _LazyCast(dict):
    """(group, bucket) -> the chunk cast to its shard's dtype when read, not before."""

    def __getitem__(self, key):
        grad, shard = super().__getitem__(key)
        return grad.to(shard.dtype)


class ZeroOptimizer(BucketGathers, InnerOptimizerFace):
    """ZeRO-1 or ZeRO-2 around any torch.optim optimizer class: the base of
    `Zero1Optimizer` and `Zero2Optimizer`, which say how the gradients are sharded.

    Use it like the optimizer it wraps: `loss.backward(); opt.step(); opt.zero_grad()`.
    The optimizer built inside (`.optimizer`) steps only this rank's chunks, or fp32
    master copies of them when `master_weights`, so its state is 1/N of the usual.
    `param_order` (the model's parameters in forward order) decides the order in which
    stage 2 reduces its buckets and in which the step updates and gathers them; every
    rank must use the same order. Buckets hold about `bucket_mb` MB of parameters (or
    `bucket_numel` elements, when given).

    With `overlap_all_gather`, `step()` returns with the all-gathers still in flight, and
    `module` (the model) gets a hook before each submodule's forward that waits for the
    buckets holding that submodule's own parameters. The inner optimizer is then stepped
    once per bucket (its step hooks run once per bucket).
    """

    stage: int  # 1 or 2: set by the subclass
    # Set to a list to record the schedule: (seconds, what, bucket, "start" | "end").
    events: list | None = None

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 *, master_weights: bool = False, bucket_mb: float = DEFAULT_BUCKET_MB,
                 bucket_numel: int | None = None, overlap_all_gather: bool = False,
                 module: nn.Module | None = None, process_group=None,
                 param_order: Sequence[nn.Parameter] | None = None,
                 clip: GradClip | None = None, **defaults: Any):
        if bucket_numel is not None:
            check_bucket_numel(bucket_numel)
        else:
            check_bucket_mb(bucket_mb)
        if overlap_all_gather and module is None:
            raise ValueError("overlap_all_gather needs module=the model, whose forward "
                             "waits for the all-gathers")
        self.master_weights = master_weights
        self.clip = clip  # on this rank's averaged gradient chunks, before the step
        if clip is not None and clip.group is None:
            clip.group = process_group  # the norm is summed over the ranks that shard
        self.overlap_all_gather = bool(overlap_all_gather)
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.groups: list[FlatGroup] = []
        for gi, spec in enumerate(split_groups(params)):
            numel = bucket_numel or bucket_numel_for(bucket_mb, spec["params"][0].element_size())
            buckets = fill_buckets(gi, spec["params"], self.world, numel)
            flat = flatten_into_buckets(buckets)
            mine = [b.chunk(flat, self.rank, self.world) for b in buckets]
            # fp32 and "bf16": step my chunks in place. bf16-mixed: fp32 copies of them.
            shards = [m.float().clone() for m in mine] if master_weights else mine
            g = FlatGroup({k: v for k, v in spec.items() if k != "params"}, buckets, flat,
                          shards)
            shard_start = 0
            for b in buckets:
                b.shard_start = shard_start
                shard_start += b.chunk_numel(self.world)
            self.allocate_grads(g, shard_start)
            self.groups.append(g)
        self.optimizer = optimizer_class([{**g.hyper, "params": g.shards}
                                          for g in self.groups], **defaults)
        self.buckets_in_model_order = self.model_order(param_order)
        self.prepare_backward(param_order)
        if self.overlap_all_gather:
            self.install_forward_waits(module)

    # ------------------------------------------------------------------ the stage's part

    def allocate_grads(self, g: FlatGroup, shard_numel: int) -> None:
        """Give the group the gradient buffer the stage keeps between steps."""
        raise NotImplementedError

    def prepare_backward(self, param_order: Sequence[nn.Parameter] | None) -> None:
        """Hooks the stage needs during backward (none for stage 1)."""

    def sharded_grads(self, g: FlatGroup) -> torch.Tensor:
        """This rank's chunks of the group's gradients, averaged over the ranks."""
        raise NotImplementedError

    def kept_grads(self, g: FlatGroup) -> torch.Tensor:
        """The gradient buffer kept between steps (what `shardlab.measure` counts)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ torch.optim face

    @torch.no_grad()
    def step(self) -> None:
        self.wait_for_params()  # gathers a forward did not wait for (an unused module's)
        grads = self._stepped_grads()
        if self.overlap_all_gather:
            self._step_bucket_by_bucket(grads)
            return
        for g in self.groups:
            for b, shard in zip(g.buckets, g.shards):
                shard.grad = grads[(b.group, b.index)]
        with self.traced("optimizer step"):
            self.optimizer.step()
        for g in self.groups:
            for b, shard in zip(g.buckets, g.shards):
                shard.grad = None  # stage 1's reduced gradient was a temporary
                if self.master_weights:
                    b.chunk(g.flat_param, self.rank, self.world).copy_(shard)
            self.all_gather_params(g)

    def _stepped_grads(self) -> dict[tuple[int, int], torch.Tensor]:
        """Each bucket's averaged gradient chunk, in the dtype its shard steps (fp32 under
        master weights), by (group, bucket). With clipping, all of them scaled by the
        global norm first: each element is counted once, on the rank that owns it
        (ZeRO-1's full gradients before the reduce-scatter would count every element N
        times), so one scalar all-reduce gives the norm. Without, each chunk is cast when
        its bucket steps, so that bf16-mixed holds one bucket's fp32 copy at a time."""
        chunks = {}
        for g in self.groups:
            grad = self.sharded_grads(g)
            for b, shard in zip(g.buckets, g.shards):
                c = b.chunk_numel(self.world)
                chunks[(b.group, b.index)] = (grad[b.shard_start:b.shard_start + c], shard)
        if self.clip is None:
            return _LazyCast(chunks)
        cast = {k: grad.to(shard.dtype) for k, (grad, shard) in chunks.items()}
        self.clip.clip(cast.values())
        return cast

    def _step_bucket_by_bucket(self, grads) -> None:
        """Update one bucket's chunk, start its all-gather, go on to the next bucket while
        it travels; the next forward waits for each bucket where it is first needed."""
        for b in self.buckets_in_model_order:
            g = self.groups[b.group]
            shard = g.shards[b.index]
            shard.grad = grads[(b.group, b.index)]
            with self.traced("optimizer step", b.index):
                self.optimizer.step()  # only the shard with a gradient moves
            shard.grad = None
            if self.master_weights:
                b.chunk(g.flat_param, self.rank, self.world).copy_(shard)
            self.start_all_gather(g, b)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Everything kept between steps, by category (what shardlab.measure counts)."""
        optimizer = [t for state in self.optimizer.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor)]
        if self.master_weights:
            optimizer += [s for g in self.groups for s in g.shards]
        grads = [self.kept_grads(g) for g in self.groups]
        return {"params": [g.flat_param for g in self.groups], "grads": grads,
                "optimizer": optimizer, "buffers": []}

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    # ------------------------------------------------------------------ the layout

    def pieces(self, module: nn.Module) -> list[Piece]:
        """This rank's pieces of every parameter: a bucket's chunk [r*c, (r+1)*c) holds
        the end of one parameter and the start of the next; frozen parameters, which no
        bucket holds, are whole on every rank."""
        self.wait_for_params()
        names = tied_names(module)
        out = []
        for g in self.groups:
            for b, shard in zip(g.buckets, g.shards):
                c = b.chunk_numel(self.world)
                mine_start = b.start + self.rank * c
                for p, offset in zip(b.params, b.offsets):
                    lo = b.start + offset
                    ranges = owned_ranges(lo, lo + p.numel(), lambda r: b.start + r * c,
                                          self.world)
                    mine = next(((a, z) for r, a, z in ranges if r == self.rank), None)
                    a, z = mine or (0, 0)  # (0, 0): none of it here
                    window = (slice(lo + a - mine_start, lo + z - mine_start) if z > a
                              else slice(0, 0))
                    out.append(Piece(
                        names[id(p)][0], p.shape, a, z, g.flat_param[lo + a:lo + z] if z > a
                        else g.flat_param[:0], ranges,
                        master=shard.detach()[window] if self.master_weights else None,
                        optimizer_state=state_of(self.optimizer, shard, window),
                        aliases=tuple(names[id(p)][1:])))
        trained = {id(p) for g in self.groups for b in g.buckets for p in b.params}
        out += [Piece(name, p.shape, 0, p.numel(), p.detach().reshape(-1),
                      aliases=tuple(names[id(p)][1:]))
                for name, p in module.named_parameters() if id(p) not in trained]
        return out

    def all_gather_all(self) -> None:
        """Every rank's chunks into every rank's buffers (after a checkpoint loaded this
        rank's chunks only)."""
        self.wait_for_params()
        for g in self.groups:
            if self.master_weights:
                for b, shard in zip(g.buckets, g.shards):
                    b.chunk(g.flat_param, self.rank, self.world).copy_(shard)
            self.all_gather_params(g)

    # ------------------------------------------------------------------ a timeline

    def trace(self, what: str, bucket: int, edge: str) -> None:
        if self.events is not None:
            self.events.append((time.perf_counter(), what, bucket, edge))

    @contextlib.contextmanager
    def traced(self, what: str, bucket: int = -1):
        """Record the span of `what` in `events` (when it is a list), for timelines."""
        self.trace(what, bucket, "start")
        yield
        self.trace(what, bucket, "end")
