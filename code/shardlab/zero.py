"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients too.

Data parallelism keeps on every rank the same three things: the parameters, their
gradients and the optimizer state. Only the parameters are needed everywhere (every rank
runs the whole forward and backward). ZeRO (Rajbhandari et al., 2020) keeps them whole
and splits the rest N ways:

    stage 1  each rank keeps the optimizer state (the fp32 master copy and Adam's m and v
             in mixed precision) of 1/N of the parameters; gradients stay whole.
    stage 2  the gradients are split too: during backward, as soon as a bucket of
             gradients is complete it is reduce-scattered and the full gradients are freed.

The layout (DeepSpeed's, and PyTorch DDP's buckets): the trainable parameters of one
parameter group are cut into buckets of whole parameters (about `bucket_mb` MB, 25 MB by
default as DDP's, filled from the last parameter back, the order backward produces
gradients); all of the group's buckets live in one flat 1-D buffer and the model's
parameters become views of it.
Each bucket is padded to a multiple of N, so it splits into N equal chunks and rank r owns
chunk r of every bucket. With one bucket per group this is exactly "concatenate the
group's parameters, pad to a multiple of N, rank r owns elements [r*S, (r+1)*S)".

Why this is still the same optimizer: Adam, AdamW and SGD are elementwise, so stepping
the chunks is the same arithmetic as stepping the parameters (hyperparameters are per
group, which is why each group gets its own flat buffer).

One step, per bucket of psi_b elements (padded), on every rank:

    stage 1  backward: full gradients accumulate in place into the flat gradient buffer
             step():  reduce-scatter the bucket's gradients -> my averaged chunk     psi_b
                      step my chunks; all-gather the bucket's parameters             psi_b
    stage 2  backward: each gradient is copied into its bucket's buffer and freed; when
                      a bucket is complete its reduce-scatter starts, asynchronously
                      (backward goes on meanwhile); when it is done, my chunk is added
                      to my gradient shard and the buffer is freed                  psi_b
             step():  step my chunks; all-gather the bucket's parameters             psi_b

Both move 2 psi logical bytes per step (psi in the communicated dtype), as much as
DDP's all-reduce. A parameter that gets no gradient in a step is stepped with a zero
gradient (as in DeepSpeed): with weight decay it still decays, where torch.optim would
skip it.

Equal bytes are not equal time. Done as above, the all-gather runs after the optimizer
step with nothing to hide behind: the whole step waits for it. With
`overlap_all_gather` (the default) it is hidden, as Megatron-LM's distributed optimizer
hides it: the step updates the buckets one by one in the model's order and starts each
bucket's all-gather as soon as its chunk is updated, without waiting (it runs while the
next buckets are stepped); a hook before each module's forward waits for the bucket that
holds the module's parameters, so the next forward's first layers compute while the
later buckets are still in flight. Anything that reads the parameters outside a forward
(a checkpoint, `full_parameters`) waits for all of them first (`wait_for_params`). The
arithmetic is the same, so the result is the same to the bit.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from shardlab.comm import all_gather_into, reduce_scatter_into
from shardlab.launch import rank_device
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.precision import (InnerOptimizerFace, MasterWeightOptimizer, Precision,
                                get_precision)
from shardlab.strategy import (OptimizerSpec, Piece, Wrapped, cast_model, check_options,
                               check_same_on_all_ranks, get_strategy, named_full_parameters,
                               optimizer_spec, owned_ranges, state_of, tied_names)

MB = 1 << 20

# Options of wrap_zero1 / wrap_zero2, with their defaults.
ZERO_OPTIONS: dict[str, Any] = {
    # MB (2**20 bytes) of parameters per bucket, in the parameters' dtype, as DDP's
    # bucket_mb; a parameter larger than this gets a bucket of its own. Small buckets
    # pay the fixed cost of a collective many times; large ones hold a large gradient
    # buffer (stage 2) and give the all-gather less to overlap with.
    "bucket_mb": 25.0,
    # The same size in elements instead (the earlier spelling); give one or the other.
    "bucket_numel": None,
    # Hide the parameters' all-gather behind the optimizer step and the next forward.
    "overlap_all_gather": True,
    # None (one group: all trainable parameters) or a function model -> parameter groups
    # (a list of dicts, as for any torch.optim optimizer).
    "param_groups": None,
}
TORCH_ZERO1_OPTIONS: dict[str, Any] = {"find_unused_parameters": False}


# --------------------------------------------------------------------------- the layout


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


# --------------------------------------------------------------------------- the optimizer


class ZeroOptimizer(InnerOptimizerFace):
    """ZeRO-1 (`stage=1`) or ZeRO-2 (`stage=2`) around any torch.optim optimizer class.

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

    # Set to a list to record the schedule: (seconds, what, bucket, "start" | "end").
    events: list | None = None
    # Stage 2: bucket reduce-scatters in flight at once during backward.
    MAX_IN_FLIGHT = 2

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 *, stage: int = 1, master_weights: bool = False,
                 bucket_mb: float = ZERO_OPTIONS["bucket_mb"], bucket_numel: int | None = None,
                 overlap_all_gather: bool = False, module: nn.Module | None = None,
                 process_group=None, param_order: Sequence[nn.Parameter] | None = None,
                 **defaults: Any):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer implements stages 1 and 2, got stage={stage!r} "
                             f"(stage 3 is shardlab.sharded.wrap_zero3)")
        if bucket_numel is not None:
            check_bucket_numel(bucket_numel)
        else:
            check_bucket_mb(bucket_mb)
        if overlap_all_gather and module is None:
            raise ValueError("overlap_all_gather needs module=the model, whose forward "
                             "waits for the all-gathers")
        self.stage, self.master_weights = stage, master_weights
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
            if stage == 1:
                g.flat_grad = torch.zeros_like(flat)
                self._attach_grads(g)
            else:
                g.grad_shard = torch.zeros(shard_start, dtype=flat.dtype, device=flat.device)
            self.groups.append(g)
        self.optimizer = optimizer_class([{**g.hyper, "params": g.shards}
                                          for g in self.groups], **defaults)
        self.buckets_in_model_order = self._model_order(param_order)
        if stage == 2:
            self._prepare_backward_hooks(param_order)
        if self.overlap_all_gather:
            self._install_forward_waits(module)

    # ------------------------------------------------------------------ torch.optim face

    @torch.no_grad()
    def step(self) -> None:
        self.wait_for_params()  # gathers a forward did not wait for (an unused module's)
        if self.overlap_all_gather:
            self._step_bucket_by_bucket()
            return
        for g in self.groups:
            grad = self.reduce_scatter_grads(g) if self.stage == 1 else g.grad_shard
            for b, shard in zip(g.buckets, g.shards):
                c = b.chunk_numel(self.world)
                shard.grad = grad[b.shard_start:b.shard_start + c].to(shard.dtype)
        with self.traced("optimizer step"):
            self.optimizer.step()
        for g in self.groups:
            for b, shard in zip(g.buckets, g.shards):
                shard.grad = None  # stage 1's reduced gradient was a temporary
                if self.master_weights:
                    b.chunk(g.flat_param, self.rank, self.world).copy_(shard)
            self.all_gather_params(g)

    def _step_bucket_by_bucket(self) -> None:
        """Update one bucket's chunk, start its all-gather, go on to the next bucket while
        it travels; the next forward waits for each bucket where it is first needed."""
        grads = {id(g): self.reduce_scatter_grads(g) if self.stage == 1 else g.grad_shard
                 for g in self.groups}
        for b in self.buckets_in_model_order:
            g = self.groups[b.group]
            shard = g.shards[b.index]
            c = b.chunk_numel(self.world)
            shard.grad = grads[id(g)][b.shard_start:b.shard_start + c].to(shard.dtype)
            with self.traced("optimizer step", b.index):
                self.optimizer.step()  # only the shard with a gradient moves
            shard.grad = None
            if self.master_weights:
                b.chunk(g.flat_param, self.rank, self.world).copy_(shard)
            self.start_all_gather(g, b)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients. The flat gradient (stage 1) and the gradient shard (stage 2)
        are persistent buffers by design: they are zeroed, never freed."""
        for g in self.groups:
            if self.stage == 1:
                g.flat_grad.zero_()
                self._attach_grads(g)
            else:
                g.grad_shard.zero_()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Everything kept between steps, by category (what shardlab.measure counts)."""
        optimizer = [t for state in self.optimizer.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor)]
        if self.master_weights:
            optimizer += [s for g in self.groups for s in g.shards]
        grads = [g.flat_grad if self.stage == 1 else g.grad_shard for g in self.groups]
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

    # ------------------------------------------------------------------ collectives

    def trace(self, what: str, bucket: int, edge: str) -> None:
        if self.events is not None:
            self.events.append((time.perf_counter(), what, bucket, edge))

    @contextlib.contextmanager
    def traced(self, what: str, bucket: int = -1):
        """Record the span of `what` in `events` (when it is a list), for timelines."""
        self.trace(what, bucket, "start")
        yield
        self.trace(what, bucket, "end")

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

    def _model_order(self, param_order: Sequence[nn.Parameter] | None) -> list[Bucket]:
        """The buckets in the order the forward needs them: by their first parameter."""
        buckets = [b for g in self.groups for b in g.buckets]
        if param_order is None:
            return buckets
        position = {id(p): k for k, p in enumerate(param_order)}
        return sorted(buckets, key=lambda b: min(position.get(id(p), len(position))
                                                 for p in b.params))

    def _install_forward_waits(self, module: nn.Module) -> None:
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

    # ------------------------------------------------------------------ stage 2 hooks

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


# --------------------------------------------------------------------------- checks


# --------------------------------------------------------------------------- strategies


def _wrap_zero(stage: int, model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
               options: dict) -> Wrapped:
    opts = check_options(f"zero{stage}", options, ZERO_OPTIONS)
    if "bucket_mb" in options and "bucket_numel" in options:
        raise ValueError("give the bucket size once: bucket_mb (MB) or bucket_numel "
                         "(elements), not both")
    if opts["bucket_numel"] is not None:
        check_bucket_numel(opts["bucket_numel"])
    else:
        check_bucket_mb(opts["bucket_mb"])
    if not isinstance(opts["overlap_all_gather"], bool):
        raise ValueError(f"overlap_all_gather must be True or False, got "
                         f"{opts['overlap_all_gather']!r}")
    if opts["param_groups"] is not None and not callable(opts["param_groups"]):
        raise ValueError(f"param_groups must be None or a function model -> list of "
                         f"parameter groups, got {type(opts['param_groups']).__name__}")
    check_same_on_all_ranks(list(model.named_parameters()))
    model = cast_model(model, precision)
    params = opts["param_groups"](model) if opts["param_groups"] else model.parameters()
    zero = ZeroOptimizer(params, optimizer.cls, stage=stage,
                         master_weights=precision.master_weights,
                         bucket_mb=opts["bucket_mb"], bucket_numel=opts["bucket_numel"],
                         overlap_all_gather=opts["overlap_all_gather"], module=model,
                         param_order=[p for p in model.parameters() if p.requires_grad],
                         **optimizer.kwargs)

    def full_parameters() -> dict[str, torch.Tensor]:
        zero.wait_for_params()
        return named_full_parameters(model)

    # no_sync is not needed: stage 1 reduces only in step(), so micro-batches accumulate
    # locally; stage 2 reduces every micro-batch and accumulates into the shard.
    return Wrapped(model, zero, full_parameters=full_parameters,
                   pieces=lambda: zero.pieces(model), after_load=zero.all_gather_all)


def wrap_zero1(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
               options: dict) -> Wrapped:
    """ZeRO-1: optimizer state sharded 1/N; gradients reduce-scattered in step()."""
    return _wrap_zero(1, model, precision, optimizer, options)


def wrap_zero2(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
               options: dict) -> Wrapped:
    """ZeRO-2: optimizer state and gradients sharded 1/N; buckets reduce-scattered
    during backward."""
    return _wrap_zero(2, model, precision, optimizer, options)


# --------------------------------------------------------------------------- the reference


class TorchZero1:
    """PyTorch's ZeRO-1: `ZeroRedundancyOptimizer` over a PyTorch DDP model.

    DDP all-reduces the full gradients (Ψ); each rank steps the parameters assigned to
    it; their owners broadcast them (Ψ). PyTorch assigns whole tensors to ranks (greedily,
    largest first) rather than cutting a flat space, so a rank's optimizer state is only
    about 1/N, by an amount that depends on the tensor sizes."""

    def __init__(self, ddp_model: nn.Module, optimizer_class, master_weights: bool,
                 **defaults: Any):
        constructor = (functools.partial(MasterWeightOptimizer, optimizer_class=optimizer_class)
                       if master_weights else optimizer_class)
        self.model = ddp_model
        self.zero = ZeroRedundancyOptimizer([p for p in ddp_model.parameters()
                                             if p.requires_grad], constructor, **defaults)

    @property
    def param_groups(self) -> list[dict]:
        return self.zero.param_groups

    @property
    def optimizer(self):
        """This rank's own optimizer, over the parameters PyTorch assigned it."""
        return self.zero.optim

    def step(self) -> None:
        self.zero.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad(set_to_none=set_to_none)

    def pieces(self, module: nn.Module) -> list[Piece]:
        """Every parameter whole on every rank (DDP), its optimizer state whole on the one
        rank PyTorch assigned it to: that rank alone writes the parameter (from its fp32
        master copy under "bf16-mixed") and its state; every rank reads the parameter."""
        local = self.zero.optim
        masters = {id(p): m for p, m in getattr(local, "pairs", [])}
        inner = local.optimizer if isinstance(local, MasterWeightOptimizer) else local
        owned = {id(p) for group in local.param_groups for p in group["params"]}
        owned |= set(masters)  # the model parameters whose master copy this rank steps
        names = tied_names(module)
        out = []
        for name, p in module.named_parameters():
            mine = id(p) in owned
            master = masters.get(id(p))
            stepped = master if master is not None else p
            out.append(Piece(name, p.shape, 0, p.numel(), p.detach().reshape(-1),
                             master=None if master is None else master.detach().reshape(-1),
                             optimizer_state=state_of(inner, stepped, slice(None))
                             if mine else dict,
                             writer=mine or not p.requires_grad,
                             aliases=tuple(names[id(p)][1:])))
        return out

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        local = self.zero.optim
        optimizer = [t for state in local.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor)]
        if isinstance(local, MasterWeightOptimizer):
            optimizer += local.master_tensors()
        params = list(self.model.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": optimizer, "buffers": list(self.model.buffers())}


def wrap_torch_zero1(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                     options: dict) -> Wrapped:
    """Reference: torch.distributed.optim.ZeroRedundancyOptimizer over PyTorch DDP."""
    opts = check_options("torch-zero1", options, TORCH_ZERO1_OPTIONS)
    model = cast_model(model, precision)
    ddp = DistributedDataParallel(model, find_unused_parameters=opts["find_unused_parameters"])
    zero = TorchZero1(ddp, optimizer.cls, precision.master_weights, **optimizer.kwargs)
    return Wrapped(ddp, zero, no_sync=ddp.no_sync,
                   full_parameters=lambda: named_full_parameters(model),
                   pieces=lambda: zero.pieces(model), module=model)


# --------------------------------------------------------------------------- a worker


def schedule_timeline(strategies: Sequence[str] = ("zero1", "zero2"), steps: int = 3,
                      bucket_numel: int = 1 << 14, model: str = "gpt-tiny",
                      batch_size: int = 8, seq_len: int = 32,
                      overlap_all_gather: bool = False) -> dict[str, list[tuple]]:
    """Run on every rank (with `shardlab.launch.launch`): train `steps` steps with each
    strategy and return the schedule of the last one as (seconds from the step's start,
    what, bucket, "start" | "end"): forward, backward, each bucket's reduce-scatter and
    all-gather, and the optimizer step. With `overlap_all_gather` the all-gathers end in
    the next step's forward, so that forward ("next forward") is recorded too, with each
    module's "wait for all-gather"."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    timelines = {}
    for strategy in strategies:
        wrapped = get_strategy(strategy)(build_model(model, seed=0).to(device),
                                         get_precision("fp32"),
                                         optimizer_spec("adamw", 1e-3),
                                         {"bucket_numel": bucket_numel,
                                          "overlap_all_gather": overlap_all_gather})
        zero: ZeroOptimizer = wrapped.optimizer
        for step in range(steps + overlap_all_gather):
            x, y = (t.to(device) for t in get_batch(step, rank, world, batch_size, seq_len))
            if step == steps:  # the next step's forward, where the gathers are waited for
                with zero.traced("next forward"):
                    loss = loss_fn(wrapped.model(x), y)
                break
            zero.events = [] if step == steps - 1 else None
            dist.barrier()  # start the step together, so that waits are the schedule's
            start = time.perf_counter()
            with zero.traced("forward"):
                loss = loss_fn(wrapped.model(x), y)
            with zero.traced("backward"):
                loss.backward()
            zero.step()
            zero.zero_grad()
        zero.wait_for_params()
        timelines[strategy] = [(t - start, what, bucket, edge)
                               for t, what, bucket, edge in zero.events]
        zero.events = None
    return timelines
