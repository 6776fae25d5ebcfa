"""One unit of the schedule: its two states, its hooks, and its collectives.

`ShardedUnit` is what a unit does during a step, whatever its layout: unshard before
forward and backward (all-gather), reshard after (free), reduce-scatter the gradients
after backward, each at the hook PyTorch gives for that moment. What it gathers and
scatters, and where each parameter lives in the buffers, is the layout's: a subclass
(`shardlab.zero3.FlatUnit`, `shardlab.fsdp.PerParamUnit`) supplies the methods listed
in the class's docstring. Kept apart from the model-wide state (`shardlab.sharded.model`)
so that one unit's life in a step reads top to bottom in one class.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch import nn

from shardlab import trace
from shardlab.comm.compat import all_gather_into, reduce_scatter_into
from shardlab.sharded.model import ParamSlot, ShardedModel


class ShardedState(enum.Enum):
    SHARDED = "sharded"      # only this rank's shard exists
    UNSHARDED = "unsharded"  # the full parameters exist and are registered on the modules
    # between forward and backward under an integer `reshard_after_forward` R (FSDP2's name
    # for ZeRO++'s hpZ): a 1/R piece of the full parameters is kept, so that backward's
    # all-gather runs among R ranks (a node) instead of all of them
    SHARDED_POST_FORWARD = "sharded_post_forward"


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

    and, to reshard after forward to a smaller group (`post_forward_group`, set by a layout
    that supports it: FSDP2's), keep_post_forward_shard(), start_post_forward_all_gathers()
    (whose result `use_gathered` also takes) and drop_post_forward_shard().
    """

    def __init__(self, module: nn.Module, slots: list[ParamSlot], *, group=None,
                 replicate_group=None, reshard_after_forward: bool = True,
                 param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, offload: bool = False,
                 device: torch.device | None = None):
        self.module = module
        self.slots = slots
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # HSDP: the same shard is held by one rank in each of R groups (the replicas),
        # which average their reduced gradient shards with an all-reduce across groups.
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group else 1
        self.replica = dist.get_rank(replicate_group) if replicate_group else 0
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
        # The knobs of gradient accumulation, as FSDP2's setters name them: keep the full
        # parameters after backward (the next micro-batch's forward need not gather them);
        # HSDP: reduce-scatter, but all-reduce across replicas only on the last micro-batch
        # (the reduced shards summed meanwhile in `partial_reduce`, undivided).
        self.reshard_after_backward = True
        self.requires_all_reduce = True
        self.partial_reduce: torch.Tensor | None = None
        # Reshard after forward to this smaller group (None: to the whole group, or not at
        # all); a layout that supports it sets it (`shardlab.fsdp.layout`).
        self.post_forward_group = None
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
        # each unit's events, under its name, when a trace is open (`shardlab.trace`):
        # its all-gathers and reduce-scatters from launch to completion, its forward and
        # backward compute, its frees
        trace.mark("all-gather", self.name)
        works = (self.start_post_forward_all_gathers()
                 if self.state is ShardedState.SHARDED_POST_FORWARD else self.start_all_gathers())
        trace.end_when_done(works[-1], "all-gather", self.name)
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
        if self.state is ShardedState.SHARDED_POST_FORWARD:  # its backward never ran
            self.drop_post_forward_shard()
            self.state = ShardedState.SHARDED
            return
        trace.mark("free", self.name)
        self.free_unsharded()
        self.register_sharded()
        self.state = ShardedState.SHARDED

    def reshard_post_forward(self) -> None:
        """Free the full parameters but keep this rank's 1/R piece of them, R the size of
        `post_forward_group`: backward gathers from those pieces, among R ranks."""
        if self.state is not ShardedState.UNSHARDED:
            return
        trace.mark("free", self.name)
        self.keep_post_forward_shard()
        self.free_unsharded()
        self.register_sharded()
        self.state = ShardedState.SHARDED_POST_FORWARD

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
        trace.mark("forward", self.name)
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
        trace.mark("forward", self.name, "end")
        if not torch.is_grad_enabled():
            self.reshard()
        elif self.reshard_after_forward and self.post_forward_group is not None:
            self.reshard_post_forward()
        elif self.reshard_after_forward:
            self.reshard()
        if torch.is_grad_enabled():
            self.model_state.record_post_forward(self)
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
            trace.mark("backward", self.name)
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
        trace.mark("backward", self.name, "end")
        if self.state is ShardedState.UNSHARDED and self.requires_gradient_sync:
            grads = [p.grad for p in self.unsharded_params]
            if any(g is not None for g in grads):
                self.reduce_scatter_grads(grads)
            for p in self.unsharded_params:
                p.grad = None
        # Without gradient sync (accumulation) the full gradients stay on the unsharded
        # parameters, where the next micro-batch's backward adds to them.
        if self.reshard_after_backward:
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
        trace.mark("reduce-scatter", self.name)
        work = self.start_reduce_scatter(reduced, full)
        timed = trace.end_when_done(work, "reduce-scatter", self.name) is not None
        self.pending_reduce = (work, full, reduced, timed)  # `full` lives until it is done

    def start_reduce_scatter(self, reduced: torch.Tensor, full: torch.Tensor):
        """Launch the sum of every rank's `full` into this rank's `reduced` (its S
        elements); return the work. A unit whose layout reduces otherwise (ZeRO++'s
        quantized all-to-alls) overrides this."""
        return reduce_scatter_into(reduced, full, group=self.group, async_op=True)

    def finish_reduce(self) -> None:
        if self.pending_reduce is None:
            return
        work, _, reduced, timed = self.pending_reduce
        work.wait()
        if not timed:  # the backend could not mark it when done: mark it where waited
            trace.mark("reduce-scatter", self.name, "end")
        self.pending_reduce = None
        if self.replicate_group is not None:
            # HSDP under accumulation (`requires_all_reduce` off): the reduced shards of the
            # micro-batches are summed here, and all-reduced once, with the last one's
            if self.partial_reduce is not None and self.requires_all_reduce:
                reduced += self.partial_reduce
                self.partial_reduce = None
            elif not self.requires_all_reduce:
                if self.partial_reduce is None:
                    self.partial_reduce = reduced
                else:
                    self.partial_reduce += reduced
                return
            # HSDP: the shard, reduced inside its group, summed with the same shard of
            # every other replica (one rank per group): Ψ/S elements cross the groups
            dist.all_reduce(reduced, group=self.replicate_group)
        # the mean over all ranks of the per-rank mean losses
        reduced.div_(self.world * self.replicas)
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

    def global_rank(self, group_rank: int) -> int:
        """The process's rank in the whole job of this unit's group's rank `group_rank`
        (a checkpoint names the ranks that hold each piece by their global ranks)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group,
                                                                          group_rank)


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


def gather_shard(shard: torch.Tensor, world: int, group, rank0_only: bool):
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
