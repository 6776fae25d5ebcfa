"""Sharded units: the gather / free / reduce-scatter schedule that ZeRO-3 and FSDP2 share.

A *unit* is a module (a transformer block, or the model itself for what is left) whose
parameters live sharded across the N ranks of a group. Its parameters are in one of two
states, named as in PyTorch's FSDP2:

    SHARDED     only this rank's 1/N shard exists; the full parameters are freed
    UNSHARDED   the full parameters exist (all-gathered) and the module computes with them

and one schedule moves them between the states during a step:

    pre-forward     unshard: all-gather the unit          (Ψ_unit bytes on the wire, logically)
    post-forward    reshard: free the full parameters     (only if reshard_after_forward)
    pre-backward    unshard again (if it was resharded)   (Ψ_unit again)
    post-backward   reduce_scatter_grads into this rank's shard, then reshard  (Ψ_unit)

so a step moves 3Ψ with resharding after forward and 2Ψ without. Each unit does ONE
all-gather and ONE reduce-scatter per phase, over a flat buffer holding all its
parameters: a few large collectives cost far less than many small ones.

ZeRO-3 and FSDP2 differ only in the *layout* of that flat buffer, so the schedule lives in
`ShardedUnit` and the layout in a subclass:

* `FlatUnit` (ZeRO-3, DeepSpeed, FSDP1): the unit's parameters are concatenated into one
  1-D buffer, padded to a multiple of N and cut into N equal pieces. Rank r keeps piece r,
  which may hold the end of one parameter and the start of the next. Gathered, the buffer
  *is* the full parameters: each one is a view into it, no copy. The optimizer sees one
  flat shard per unit.
* `PerParamUnit` (FSDP2, `shardlab.fsdp`): every parameter is cut along dim 0 into N
  chunks of ceil(d0/N) rows (zero-padded). Rank r keeps chunk r of each parameter, an
  `nn.Parameter` under the parameter's own name. Gathered, the buffer is rank-major, so
  each parameter is copied out of it into its own tensor: one extra copy bought
  per-parameter shards that keep names, shapes, dtypes and `requires_grad` flags.

`ShardedModel` is the state of the whole model: its units in forward order, the hooks'
bookkeeping for a step, prefetching, gradient accumulation, and gathering the full
parameters back. `wrap_zero3` registers ZeRO-3 in `shardlab.train`.
"""

from __future__ import annotations

import contextlib
import enum
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardlab.comm import all_gather_into, reduce_scatter_into
from shardlab.precision import Precision
from shardlab.strategy import (OptimizerSpec, Piece, Wrapped, build_optimizer, cast_model,
                               check_options, check_same_on_all_ranks, inner_optimizer,
                               owned_ranges, state_of)
from shardlab.wrap import unit_modules


# A timeline of the schedule, for the chapters: when set to a list (see `tracing`), every
# unit appends (seconds, unit name, what, "start" | "end"). Off, it costs one check.
TRACE: list | None = None


@contextlib.contextmanager
def tracing():
    """Record the schedule's events in this process: all-gathers and reduce-scatters
    (from their launch to their completion), forward and backward compute, frees."""
    global TRACE
    TRACE = events = []
    try:
        yield events
    finally:
        TRACE = None


def _trace(unit, what: str, edge: str) -> None:
    if TRACE is not None:
        TRACE.append((time.perf_counter(), unit.name, what, edge))


def _trace_completion(unit, what: str, work) -> bool:
    """Mark the end of a collective when the backend finishes it, not when it is waited.
    False if the backend cannot say (gloo's reduce-scatter): the waiter marks it then."""
    if TRACE is None:
        return True
    events = TRACE
    try:
        work.get_future().then(lambda _: events.append(
            (time.perf_counter(), unit.name, what, "end")))
    except RuntimeError:
        return False
    return True


class ShardedState(enum.Enum):
    SHARDED = "sharded"      # only this rank's shard exists
    UNSHARDED = "unsharded"  # the full parameters exist and are registered on the modules


@dataclass
class ParamSlot:
    """One original parameter of a unit: where it is registered, and its full shape."""

    name: str                                # its name in the model (the first, if tied)
    param: nn.Parameter                      # the original parameter (kept for its metadata)
    owners: list[tuple[nn.Module, str]]      # every (module, attribute) that holds it
    aliases: tuple[str, ...] = ()            # its other names (a tied weight)

    @property
    def shape(self) -> torch.Size:
        return self.param.shape

    @property
    def numel(self) -> int:
        return self.param.numel()


def set_param(module: nn.Module, attr: str, value: nn.Parameter) -> None:
    # Swap the tensor a module computes with, without nn.Module.__setattr__'s checks: this
    # runs twice per unit per phase, and the registration itself is unchanged.
    module._parameters[attr] = value


class RegisterPostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs, whose backward marks the end of the unit's.

    Autograd computes the gradient of a unit's *inputs* only after everything inside the
    unit, so when this node's backward runs the unit's parameter gradients are complete:
    the moment to reduce-scatter them. (A unit whose inputs need no gradient, like the
    root with token ids, is finished by the end-of-backward callback instead.)
    """

    @staticmethod
    def forward(ctx, unit: "ShardedUnit", *inputs: torch.Tensor):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.unit.post_backward()
        return (None, *grads)


class ShardedUnit:
    """The schedule of one unit; a subclass supplies the layout of its flat buffer.

    A layout defines, with S = `shard_numel` elements per rank:
      start_all_gathers()           launch the all-gather(s) of this rank's S elements
      use_gathered()                make the full parameters from what was gathered
      free_unsharded()              release the full parameters' memory
      reduce_scatter_input(grads)   the N*S buffer of full gradients (padded), in reduce dtype
      add_sharded_grads(reduced)    store / accumulate this rank's S reduced elements
      register_sharded()            make the modules hold the shards again
      gather_full(rank0_only)       {name: full tensor} in the shards' own dtype
      pieces(masters, optimizer)    this rank's pieces of each parameter, for checkpoints
    """

    def __init__(self, module: nn.Module, slots: list[ParamSlot], *, group=None,
                 reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, offload: bool = False,
                 device: torch.device | None = None):
        self.module = module
        self.slots = slots
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.offload = offload  # shards, their gradients and the optimizer step on the CPU
        self.device = device or torch.device("cpu")  # where forward and backward compute
        self.state = ShardedState.SHARDED
        self.pending_gather = None           # the works of the all-gathers in flight
        self.pending_reduce = None           # (work, input, output) of a reduce-scatter
        self.unsharded_params: list[nn.Parameter] = []
        self.forward_prefetch: list[ShardedUnit] = []
        self.backward_prefetch: list[ShardedUnit] = []
        self.requires_gradient_sync = True
        self.needs_post_backward = False     # set in forward, cleared once grads are reduced
        self.pre_backward_done = False
        self.model_state: ShardedModel | None = None  # set by the root at its first forward
        self.name = type(module).__name__            # its path in the model, once known
        self.cast_inputs = False  # mixed precision: cast floating inputs to param_dtype
        self.handles = []

    # ------------------------------------------------------------------ the two states

    def unshard(self, async_op: bool = False) -> None:
        """Start (or do) the all-gather of this unit; `wait_for_unshard` finishes it."""
        if self.state is ShardedState.UNSHARDED or self.pending_gather is not None:
            return
        if not self.slots:  # a root whose children hold every parameter
            self.state = ShardedState.UNSHARDED
            return
        _trace(self, "all-gather", "start")
        works = self.start_all_gathers()
        _trace_completion(self, "all-gather", works[-1])
        self.pending_gather = works
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        if self.pending_gather is None:
            return
        for work in self.pending_gather:
            work.wait()
        self.pending_gather = None
        self.use_gathered()
        for slot, p in zip(self.slots, self.unsharded_params):
            for module, attr in slot.owners:
                set_param(module, attr, p)
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Free the full parameters; the modules hold the shards again."""
        if self.pending_gather is not None:  # a prefetch that was never used
            self.wait_for_unshard()
        if self.state is ShardedState.SHARDED:
            return
        _trace(self, "free", "start")
        self.free_unsharded()
        self.register_sharded()
        self.state = ShardedState.SHARDED

    # ------------------------------------------------------------------ the hooks

    def pre_forward(self, module, args, kwargs):
        if self.model_state is None:  # the first forward of the root builds the model state
            ShardedModel.from_root(self)
        if self.model_state.root is self:
            args, kwargs = self.model_state.root_pre_forward(args, kwargs)
        if self.cast_inputs and self.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.param_dtype)
        self.unshard()
        self.wait_for_unshard()
        for unit in self.forward_prefetch or self.model_state.implicit_forward_prefetch(self):
            unit.unshard(async_op=True)
        if torch.is_grad_enabled():
            self.model_state.record_forward(self)
            self.needs_post_backward = True
            self.pre_backward_done = False
            args, kwargs = self.register_post_backward(args, kwargs)
        _trace(self, "forward", "start")
        return args, kwargs

    def register_post_backward(self, args, kwargs):
        """Route the unit's inputs that need a gradient through `RegisterPostBackward`,
        positional or by keyword (Hugging Face layers take `hidden_states=` either way)."""
        def needs_grad(a):
            return isinstance(a, torch.Tensor) and a.requires_grad

        flat = [a for a in args if needs_grad(a)] + [v for v in kwargs.values()
                                                     if needs_grad(v)]
        if not flat:
            return args, kwargs
        outs = iter(RegisterPostBackward.apply(self, *flat))
        args = tuple(next(outs) if needs_grad(a) else a for a in args)
        kwargs = {k: next(outs) if needs_grad(v) else v for k, v in kwargs.items()}
        return args, kwargs

    def post_forward(self, module, args, kwargs, output):
        _trace(self, "forward", "end")
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.reshard()
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self.pre_backward)
        return output

    def pre_backward(self, grad):
        if not self.pre_backward_done:
            self.pre_backward_done = True
            self.model_state.queue_end_of_backward()
            self.unshard()
            self.wait_for_unshard()
            for unit in self.backward_prefetch_targets():
                unit.unshard(async_op=True)
            _trace(self, "backward", "start")
        return grad

    def backward_prefetch_targets(self) -> list["ShardedUnit"]:
        if self.backward_prefetch:
            return self.backward_prefetch
        return self.model_state.implicit_backward_prefetch(self)

    def post_backward(self) -> None:
        """Reduce-scatter this unit's gradients into the shards; free the full buffers."""
        if not self.needs_post_backward:
            return
        self.needs_post_backward = False
        _trace(self, "backward", "end")
        if self.state is ShardedState.UNSHARDED and self.requires_gradient_sync:
            grads = [p.grad for p in self.unsharded_params]
            if any(g is not None for g in grads):
                self.reduce_scatter_grads(grads)
            for p in self.unsharded_params:
                p.grad = None
        # Without gradient sync (accumulation) the full gradients stay on the unsharded
        # parameters, where the next micro-batch's backward adds to them.
        self.reshard()

    def reduce_scatter_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Start the reduce-scatter and return: it runs while the unit before this one
        computes its backward, and is finished (`finish_reduce`) before the next one
        starts or at the end of backward."""
        # One reduce-scatter in flight at a time: the previous unit's finishes first, so
        # at most one extra unit of gradient buffers is alive, as in FSDP2.
        self.model_state.finish_reduces()
        full = self.reduce_scatter_input(grads)
        reduced = torch.empty(full.numel() // self.world, dtype=full.dtype, device=full.device)
        _trace(self, "reduce-scatter", "start")
        work = reduce_scatter_into(reduced, full, group=self.group, async_op=True)
        timed = _trace_completion(self, "reduce-scatter", work)
        self.pending_reduce = (work, full, reduced, timed)  # `full` lives until it is done

    def finish_reduce(self) -> None:
        if self.pending_reduce is None:
            return
        work, _, reduced, timed = self.pending_reduce
        work.wait()
        if not timed:
            _trace(self, "reduce-scatter", "end")
        self.pending_reduce = None
        reduced.div_(self.world)  # the mean over ranks of the per-rank mean losses
        self.add_sharded_grads(reduced)

    # ------------------------------------------------------------------ bookkeeping

    def install_hooks(self) -> None:
        self.handles = [
            self.module.register_forward_pre_hook(self.pre_forward, prepend=True,
                                                  with_kwargs=True),
            self.module.register_forward_hook(self.post_forward, with_kwargs=True),
        ]

    def shard_device(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.device


def _cast_floats(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []


# ====================================================================== ZeRO-3's layout


class FlatBuffer:
    """Some parameters of a unit back to back in one 1-D buffer, padded to N*S elements
    and split N ways: this rank keeps `shard`, elements [rank*S, (rank+1)*S). Gathered,
    the buffer `full` *is* the parameters: each is a view into it, no copy."""

    def __init__(self, slots: list[ParamSlot], world: int, rank: int, dtype: torch.dtype,
                 shard_device: torch.device, device: torch.device):
        self.slots = slots
        self.offsets = [sum(s.numel for s in slots[:i]) for i in range(len(slots))]
        self.numel = sum(s.numel for s in slots)
        self.shard_numel = math.ceil(self.numel / world)
        self.requires_grad = slots[0].param.requires_grad
        flat = torch.zeros(world * self.shard_numel, dtype=dtype, device=slots[0].param.device)
        torch.cat([s.param.detach().reshape(-1).to(dtype) for s in slots],
                  out=flat[:self.numel])
        mine = flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]
        # The padding is stepped too when trained (its gradient is zero, so it stays
        # zero): every rank then steps exactly S elements.
        self.shard = nn.Parameter(mine.clone().to(shard_device),
                                  requires_grad=self.requires_grad)
        # Allocated once, its storage freed (resized to 0) while sharded. The unsharded
        # parameters are views of it, created once, so that autograd's saved tensors and
        # gradient accumulation see the same objects every time.
        self.full = torch.empty(world * self.shard_numel, dtype=dtype, device=device)
        self.unsharded = [nn.Parameter(self.full[o:o + s.numel].view(s.shape),
                                       requires_grad=self.requires_grad)
                          for o, s in zip(self.offsets, slots)]


class FlatUnit(ShardedUnit):
    """ZeRO-3: the unit's parameters as flat 1-D buffers, padded and split N ways.

    Trainable and frozen parameters go into two buffers, `flat_param` and
    `flat_param_frozen`, each split N ways, so that every rank holds 1/N of each: in one
    buffer, the ranks whose piece fell on the frozen end would hold no gradient and no
    optimizer state while the others held all of it. The shards are registered on the
    unit's module in place of the original parameters: the optimizer sees one flat shard
    per unit. (DeepSpeed cuts each parameter on its own instead; FSDP1 flattens like this.)
    """

    def __init__(self, module, slots, **kwargs):
        super().__init__(module, slots, **kwargs)
        dtypes = {s.param.dtype for s in slots}
        if len(dtypes) > 1:
            raise ValueError(f"unit {type(module).__name__} mixes parameter dtypes "
                             f"{sorted(map(str, dtypes))}: a flat buffer has one dtype; "
                             f"cast the model first, or use fsdp2, whose per-parameter "
                             f"shards keep each dtype")
        dtype = self.param_dtype or (slots[0].param.dtype if slots else torch.float32)
        self.param_dtype = self.reduce_dtype = dtype
        trainable = [s for s in slots if s.param.requires_grad]
        frozen = [s for s in slots if not s.param.requires_grad]
        slots[:] = trainable + frozen  # the order of the buffers, and of unsharded_params
        self.buffers = [FlatBuffer(group, self.world, self.rank, dtype, self.shard_device(),
                                   self.device) for group in (trainable, frozen) if group]
        self.trained = next((b for b in self.buffers if b.requires_grad), None)
        self.flat_param = self.trained.shard if self.trained is not None else None
        self.shard_numel = sum(b.shard_numel for b in self.buffers)
        self.padding = self.world * self.shard_numel - sum(b.numel for b in self.buffers)
        self.unsharded_params = [p for b in self.buffers for p in b.unsharded]
        self.free_unsharded()
        self.register_sharded()

    def start_all_gathers(self) -> list:
        # Gather straight into the persistent buffers: their views *are* the parameters.
        # `.data` is an alias with its own version counter: writing the gathered values
        # must not look like an in-place change to the tensors autograd saved.
        works = []
        for b in self.buffers:
            b.full.untyped_storage().resize_(b.full.numel() * b.full.element_size())
            works.append(all_gather_into(b.full.data, b.shard.detach().to(self.device),
                                         group=self.group, async_op=True))
        return works

    def use_gathered(self) -> None:
        pass  # the unsharded parameters are views of the buffers just filled

    def free_unsharded(self) -> None:
        for b in self.buffers:
            b.full.untyped_storage().resize_(0)

    def register_sharded(self) -> None:
        for s in self.slots:
            for module, attr in s.owners:
                module._parameters.pop(attr, None)
        for b in self.buffers:
            name = "flat_param" if b.requires_grad else "flat_param_frozen"
            self.module._parameters[name] = b.shard

    def reduce_scatter_input(self, grads):
        b = self.trained  # frozen parameters have no gradient to reduce
        full = torch.zeros(self.world * b.shard_numel, dtype=self.reduce_dtype,
                           device=self.device)
        for o, s, g in zip(b.offsets, b.slots, grads):
            if g is not None:
                full[o:o + s.numel].copy_(g.reshape(-1))
        return full

    def add_sharded_grads(self, reduced: torch.Tensor) -> None:
        grad = reduced.to(self.shard_device())
        if self.flat_param.grad is None:
            self.flat_param.grad = grad
        else:
            self.flat_param.grad += grad

    def gather_full(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for b in self.buffers:
            full = _gather_shard(b.shard.detach().to(self.device), self.world, self.group,
                                 rank0_only)
            if full is not None:
                out.update({s.name: full[o:o + s.numel].view(s.shape).clone()
                            for o, s in zip(b.offsets, b.slots)})
        return out

    def pieces(self, masters: dict[int, torch.Tensor], optimizer) -> list[Piece]:
        out = []
        for b in self.buffers:
            S = b.shard_numel
            master = masters.get(id(b.shard))
            stepped = master if master is not None else b.shard
            for s, o in zip(b.slots, b.offsets):
                ranges = owned_ranges(o, o + s.numel, lambda r: r * S, self.world)
                mine = next(((a, z) for r, a, z in ranges if r == self.rank), None)
                a, z = mine or (0, 0)  # (0, 0): none of it here
                window = (slice(o + a - self.rank * S, o + z - self.rank * S) if z > a
                          else slice(0, 0))
                out.append(Piece(
                    s.name, s.shape, a, z, b.shard.detach()[window], ranges,
                    master=None if master is None else master.detach()[window],
                    optimizer_state=state_of(optimizer, stepped, window)
                    if b.requires_grad else dict,
                    aliases=s.aliases))
        return out


def _gather_shard(shard: torch.Tensor, world: int, group, rank0_only: bool):
    """All ranks' shards concatenated (on rank 0 only, if asked), on the CPU."""
    shard = shard.detach().contiguous()
    if rank0_only:
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.gather(shard, parts if dist.get_rank(group) == 0 else None,
                    dst=dist.get_global_rank(group, 0) if group is not None else 0,
                    group=group)
        return torch.cat(parts).cpu() if dist.get_rank(group) == 0 else None
    full = torch.empty(world * shard.numel(), dtype=shard.dtype, device=shard.device)
    all_gather_into(full, shard, group=group)
    return full.cpu()


# ====================================================================== FSDP2's layout


class PerParamUnit(ShardedUnit):
    """FSDP2: each parameter split along dim 0 into N chunks of ceil(d0/N) rows.

    Rank r's chunks are `nn.Parameter`s of shape [ceil(d0/N), ...] registered under the
    original names, so the optimizer, `named_parameters()` and `state_dict()` see shards
    with their own names, dtypes and `requires_grad` flags. They are views of one local
    flat tensor, which is then the all-gather input as it is (no copy-in when no cast is
    needed). The gathered buffer is rank-major ([N, S]): one `split_with_sizes_copy`
    copies every parameter out of it into its own padded tensor.
    """

    def __init__(self, module, slots, **kwargs):
        super().__init__(module, slots, **kwargs)
        self.rows, self.shard_numels, self.offsets = [], [], []
        for s in slots:
            if s.param.dim() == 0:
                raise ValueError(f"parameter {s.name!r} is a scalar (0-dim); dim-0 sharding "
                                 f"needs at least one dimension: make it shape [1]")
            if s.param.dtype != slots[0].param.dtype:
                raise ValueError(f"parameters of one fully_shard call must share a dtype "
                                 f"({s.name!r} is {s.param.dtype}, {slots[0].name!r} is "
                                 f"{slots[0].param.dtype}): shard them in separate calls")
            rows = math.ceil(s.shape[0] / self.world)
            self.offsets.append(sum(self.shard_numels))
            self.rows.append(rows)
            self.shard_numels.append(rows * (s.numel // s.shape[0]))
        self.shard_numel = sum(self.shard_numels)
        self.padding = self.world * self.shard_numel - sum(s.numel for s in slots)
        self.orig_dtype = slots[0].param.dtype if slots else torch.float32
        self.param_dtype = self.param_dtype or self.orig_dtype
        self.reduce_dtype = self.reduce_dtype or self.param_dtype
        self.local_flat = torch.zeros(self.shard_numel, dtype=self.orig_dtype,
                                      device=self.shard_device())
        self.sharded_params, self.padded_unsharded = [], []
        for s, rows, off, n in zip(slots, self.rows, self.offsets, self.shard_numels):
            mine = s.param.detach()[self.rank * rows:(self.rank + 1) * rows]
            shard = self.local_flat[off:off + n].view(rows, *s.shape[1:])
            shard[:mine.shape[0]].copy_(mine)  # rows past the end stay zero (padding)
            self.sharded_params.append(nn.Parameter(shard, requires_grad=s.param.requires_grad))
            # The full parameter lives in a padded tensor of N*rows rows, freed when
            # sharded; the module computes with the first d0 rows of it.
            padded = torch.empty(self.world * n, dtype=self.param_dtype, device=self.device)
            self.padded_unsharded.append(padded)
            self.unsharded_params.append(nn.Parameter(
                padded[:s.numel].view(s.shape), requires_grad=s.param.requires_grad))
        self.free_unsharded()
        self.register_sharded()

    def start_all_gathers(self) -> list:
        local = self.local_flat.to(self.device, self.param_dtype, non_blocking=True)
        self.gathered = torch.empty(self.world * local.numel(), dtype=local.dtype,
                                    device=local.device)
        return [all_gather_into(self.gathered, local, group=self.group, async_op=True)]

    def use_gathered(self) -> None:
        outs = []
        for padded, n in zip(self.padded_unsharded, self.shard_numels):
            padded.untyped_storage().resize_(padded.numel() * padded.element_size())
            outs.append(padded.data.view(self.world, n))  # .data: see FlatUnit
        torch.split_with_sizes_copy(self.gathered.view(self.world, self.shard_numel),
                                    self.shard_numels, dim=1, out=outs)
        self.gathered = None

    def free_unsharded(self) -> None:
        for padded in self.padded_unsharded:
            padded.untyped_storage().resize_(0)

    def register_sharded(self) -> None:
        for s, p in zip(self.slots, self.sharded_params):
            for module, attr in s.owners:
                set_param(module, attr, p)

    def trained_chunks(self):
        """(parameter, S-offset, elements) of each trainable parameter in the rank-major
        reduce-scatter buffer: frozen parameters have no gradient, so they take no room."""
        offset = 0
        for p, n in zip(self.sharded_params, self.shard_numels):
            if p.requires_grad:
                yield p, offset, n
                offset += n

    def reduce_scatter_input(self, grads):
        trained = {id(p): (off, n) for p, off, n in self.trained_chunks()}
        width = sum(n for _, n in trained.values())
        full = torch.empty(self.world, width, dtype=self.reduce_dtype, device=self.device)
        for p, g in zip(self.sharded_params, grads):
            if id(p) not in trained:
                continue
            off, n = trained[id(p)]
            chunks = full[:, off:off + n]  # rank r's chunk of this parameter in row r
            if g is None:
                chunks.zero_()
                continue
            g = g.reshape(-1)
            whole = g.numel() // n       # ranks whose chunk is all real rows
            chunks[:whole].copy_(g[:whole * n].view(whole, n))
            if whole < self.world:       # the rest: a partial chunk, then padding
                rest = g.numel() - whole * n
                chunks[whole, :rest].copy_(g[whole * n:])
                chunks[whole, rest:].zero_()
                chunks[whole + 1:].zero_()
        return full.view(-1)

    def add_sharded_grads(self, reduced: torch.Tensor) -> None:
        # Views of one buffer: the gradients of a unit are one allocation, like the shards.
        reduced = reduced.to(self.shard_device(), self.orig_dtype)
        for p, off, n in self.trained_chunks():
            g = reduced[off:off + n].view(p.shape)
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g

    def pieces(self, masters: dict[int, torch.Tensor], optimizer) -> list[Piece]:
        out = []
        for s, p, rows in zip(self.slots, self.sharded_params, self.rows):
            cols = s.numel // s.shape[0]
            ranges = owned_ranges(0, s.numel, lambda r: min(r * rows, s.shape[0]) * cols,
                                  self.world)
            mine = next(((a, z) for r, a, z in ranges if r == self.rank), None)
            a, z = mine or (0, 0)  # (0, 0): none of it here
            window = slice(0, z - a)
            master = masters.get(id(p))
            stepped = master if master is not None else p
            out.append(Piece(
                s.name, s.shape, a, z, p.detach().reshape(-1)[window], ranges,
                master=None if master is None else master.detach().reshape(-1)[window],
                optimizer_state=state_of(optimizer, stepped, window)
                if p.requires_grad else dict,
                aliases=s.aliases))
        return out

    def gather_full(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        if not self.slots:
            return {}
        full = _gather_shard(self.local_flat.to(self.device), self.world, self.group,
                             rank0_only)
        if full is None:
            return {}
        full = full.view(self.world, self.shard_numel)
        out = {}
        for s, off, n in zip(self.slots, self.offsets, self.shard_numels):
            out[s.name] = full[:, off:off + n].reshape(-1)[:s.numel].view(s.shape).clone()
        return out

    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy this rank's chunk of each full tensor given by name into the shards."""
        with torch.no_grad():
            for s, p, rows in zip(self.slots, self.sharded_params, self.rows):
                if s.name not in tensors:
                    continue
                full = tensors[s.name]
                if full.shape != s.shape:
                    raise ValueError(f"{s.name!r}: the state dict has shape "
                                     f"{tuple(full.shape)}, the model {tuple(s.shape)}")
                mine = full[self.rank * rows:(self.rank + 1) * rows]
                p.zero_()
                p[:mine.shape[0]].copy_(mine)


# ====================================================================== the whole model


class ShardedModel:
    """The model-wide state of a step, held by the root unit (the outermost one).

    It knows every unit and the order the last forward ran them in, queues the callback
    that ends the backward (reduce-scattering what no post-backward hook did), and
    implements implicit prefetching, gradient accumulation and full-parameter gathers.
    """

    def __init__(self, root: ShardedUnit, units: list[ShardedUnit], prefetch: bool = False):
        self.root = root
        self.units = units
        self.prefetch = prefetch          # implicit: gather the next unit while one computes
        self.forward_order: list[ShardedUnit] = []   # this step's, as it happens
        self.last_order: list[ShardedUnit] = []      # the previous step's, complete
        self.callback_queued = False
        # Name every parameter from the root, whatever module its unit was built from.
        names = {id(m): n for n, m in root.module.named_modules(remove_duplicate=False)}
        for u in units:
            u.model_state = self
            u.name = names[id(u.module)] or "root"
            for slot in u.slots:
                full = [f"{names[id(m)]}.{attr}" if names[id(m)] else attr
                        for m, attr in slot.owners]
                slot.name, slot.aliases = full[0], tuple(full[1:])

    @staticmethod
    def from_root(root: ShardedUnit) -> "ShardedModel":
        units = [u for m in root.module.modules() for u in getattr(m, "_sharded_units", [])]
        return ShardedModel(root, units)

    def root_pre_forward(self, args, kwargs):
        if torch.is_grad_enabled():
            self.forward_order = []
        return args, kwargs

    def record_forward(self, unit: ShardedUnit) -> None:
        if unit not in self.forward_order:
            self.forward_order.append(unit)

    def implicit_forward_prefetch(self, unit: ShardedUnit) -> list[ShardedUnit]:
        """The unit that ran after this one in the last step's forward."""
        if not self.prefetch or unit not in self.last_order:
            return []
        i = self.last_order.index(unit)
        return self.last_order[i + 1:i + 2]

    def implicit_backward_prefetch(self, unit: ShardedUnit) -> list[ShardedUnit]:
        """Backward runs the units in reverse forward order: gather the one before."""
        if not self.prefetch or unit not in self.forward_order:
            return []
        i = self.forward_order.index(unit)
        return [self.forward_order[i - 1]] if i > 0 else []

    def queue_end_of_backward(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)

    def end_of_backward(self) -> None:
        """Finish every unit whose post-backward hook did not fire (the root's inputs are
        token ids, which need no gradient), in reverse forward order like the rest."""
        for unit in reversed(self.forward_order):
            unit.post_backward()
        self.finish_reduces()
        for unit in self.units:
            unit.reshard()
        self.callback_queued = False
        self.last_order = list(self.forward_order)

    def finish_reduces(self) -> None:
        for unit in self.units:
            unit.finish_reduce()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full gradients locally; the last micro-batch reduce-scatters them."""
        for u in self.units:
            u.requires_gradient_sync = False
        try:
            yield
        finally:
            for u in self.units:
                u.requires_gradient_sync = True

    def gather_full(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for u in self.units:
            out.update(u.gather_full(rank0_only))
        return out

    def pieces(self, optimizer) -> list[Piece]:
        """This rank's pieces of every parameter (`shardlab.strategy.Piece`)."""
        masters = {id(p): m for p, m in getattr(optimizer, "pairs", [])}
        inner = inner_optimizer(optimizer)
        return [piece for u in self.units for piece in u.pieces(masters, inner)]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What the sharding holds besides the module's shards and their gradients: the
        full gradients kept between micro-batches under no_sync (nothing otherwise)."""
        grads = [p.grad for u in self.units for p in u.unsharded_params if p.grad is not None]
        return {"params": [], "grads": grads, "optimizer": [], "buffers": []}


# ====================================================================== building units


def collect_slots(model: nn.Module) -> dict[int, ParamSlot]:
    """Every distinct parameter of the model with all the places it is registered."""
    slots: dict[int, ParamSlot] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if id(p) not in slots:
                slots[id(p)] = ParamSlot(name, p, [])
            if (module, attr) not in [(m, a) for m, a in slots[id(p)].owners]:
                slots[id(p)].owners.append((module, attr))
    return slots


def assign_slots(model: nn.Module, unit_modules: list[nn.Module]) -> list[list[ParamSlot]]:
    """Give each parameter to the innermost unit that contains every module holding it.

    A tied weight (embedding and head) goes to the smallest unit containing both, so it
    is gathered whenever either uses it. A parameter in no unit is refused.
    """
    slots = collect_slots(model)
    subtree = [{id(m) for m in u.modules()} for u in unit_modules]
    # Innermost first: a unit nested in another has fewer modules.
    order = sorted(range(len(unit_modules)), key=lambda i: len(subtree[i]))
    assigned: list[list[ParamSlot]] = [[] for _ in unit_modules]
    for slot in slots.values():
        owners = {id(m) for m, _ in slot.owners}
        for i in order:
            if owners <= subtree[i]:
                assigned[i].append(slot)
                break
        else:
            raise ValueError(f"parameter {slot.name!r} is in no unit: the wrap policy must "
                             f"cover every parameter (add the model itself as the last unit, "
                             f"so that it takes whatever the blocks leave)")
    return assigned


def shard_units(model: nn.Module, modules: list[nn.Module], unit_class, *,
                group=None, prefetch: bool = False, **unit_kwargs) -> ShardedModel:
    """Shard `model` into one unit per module of `modules` (`shardlab.wrap.unit_modules`:
    children before parents, the model last). A unit left without parameters is skipped,
    except the root, which runs the step's first and last hooks whatever it holds."""
    if not modules or modules[-1] is not model:
        raise ValueError("the last unit must be the model itself (the root), which runs "
                         "first and last in every step: build the list with "
                         "shardlab.wrap.unit_modules")
    check_same_on_all_ranks(list(collect_named(model)), group)
    units = []
    for module, slots in zip(modules, assign_slots(model, modules)):
        if not slots and module is not model:
            continue
        unit = unit_class(module, slots, group=group, **unit_kwargs)
        module.__dict__.setdefault("_sharded_units", []).append(unit)
        unit.install_hooks()
        units.append(unit)
    return ShardedModel(units[-1], units, prefetch=prefetch)


def collect_named(model: nn.Module):
    return [(s.name, s.param) for s in collect_slots(model).values()]


# ====================================================================== strategy: zero3

ZERO3_OPTIONS = {"wrap": "auto", "prefetch": False, "reshard_after_forward": True}


def wrap_zero3(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
               options: dict) -> Wrapped:
    """ZeRO-3: each unit one flat padded shard (two with frozen parameters), the rest of
    the model the root.

    options: wrap (a policy of `shardlab.wrap`: "auto", "blocks", "model", "class:Name",
    "min-params:N", classes or a function module -> bool), prefetch (all-gather the next
    unit while this one computes), reshard_after_forward (True: free after forward,
    gather again for backward).
    """
    options = check_options("zero3", options, ZERO3_OPTIONS)
    units = unit_modules(model, options["wrap"])
    model = cast_model(model, precision)
    device = next(model.parameters()).device
    state = shard_units(model, units, FlatUnit, prefetch=bool(options["prefetch"]),
                        reshard_after_forward=bool(options["reshard_after_forward"]),
                        device=device)
    opt = build_optimizer([u.flat_param for u in state.units if u.flat_param is not None],
                          precision, optimizer)
    return Wrapped(model, opt, no_sync=state.no_sync, full_parameters=state.gather_full,
                   pieces=lambda: state.pieces(opt), extra_state=(state,))
