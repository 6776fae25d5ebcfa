"""FSDP2 from scratch: `fully_shard`, with PyTorch's calling convention.

    for block in model.blocks:
        fully_shard(block)          # bottom-up: each block is a unit ...
    fully_shard(model)              # ... then the root takes what is left (embeddings, head)

Each call makes the module one unit of `shardlab.sharded` with FSDP2's layout
(`PerParamUnit`, `shardlab.fsdp.layout`): between steps the module's parameters *are*
this rank's chunks, `nn.Parameter`s of shape [ceil(d0/N), ...] under their original
names. So the optimizer is built over `model.parameters()` as usual and `state_dict()`
keeps the names.

What this module adds to the schedule is the API: the options (`reshard_after_forward`,
`MixedPrecisionPolicy`, `CPUOffloadPolicy`), the methods PyTorch's `FSDPModule` has
(`unshard`, `reshard`, prefetch and gradient-sync setters), and the helpers between
sharded and full models. The strategies built on it are in `shardlab.fsdp.strategies`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardlab.fsdp.layout import PerParamUnit
from shardlab.sharded.model import ShardedModel, collect_slots
from shardlab.strategy import check_same_on_all_ranks, storage_device


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As PyTorch's: all-gather and compute in `param_dtype`, reduce-scatter gradients in
    `reduce_dtype` (default: `param_dtype`); shards, gradients and optimizer stay in the
    parameters' own dtype (fp32), which plays the role of the master weights."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """As PyTorch's: keep the shards, their gradients and the optimizer step on the CPU;
    copy a unit's shards to the device for each all-gather, its gradients back after."""

    pin_memory: bool = True


class FSDPModule:
    """Mixed into a module's class by `fully_shard`, as in PyTorch: `FSDPBlock` is a
    `Block` that also has these methods."""

    def sharded_unit(self) -> PerParamUnit:
        return self.__dict__["_sharded_units"][0]

    def unshard(self, async_op: bool = False) -> None:
        """All-gather this module's parameters now (e.g. ahead of a forward you know of)."""
        self.sharded_unit().unshard(async_op=async_op)

    def reshard(self) -> None:
        self.sharded_unit().reshard()

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start these modules' all-gathers when this module's forward starts."""
        self.sharded_unit().forward_prefetch = [_unit_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start these modules' all-gathers when this module's backward starts."""
        self.sharded_unit().backward_prefetch = [_unit_of(m) for m in modules]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool,
                                   recurse: bool = True) -> None:
        """False: keep accumulating full gradients locally (no reduce-scatter)."""
        for m in (self.modules() if recurse else [self]):
            for unit in m.__dict__.get("_sharded_units", []):
                unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool,
                                  recurse: bool = True) -> None:
        for m in (self.modules() if recurse else [self]):
            for unit in m.__dict__.get("_sharded_units", []):
                unit.reshard_after_forward = reshard_after_forward


def _unit_of(module: nn.Module) -> PerParamUnit:
    units = module.__dict__.get("_sharded_units")
    if not units:
        raise ValueError(f"{type(module).__name__} is not sharded: call fully_shard on it "
                         f"before naming it as a prefetch target")
    return units[0]


def fully_shard(module: nn.Module, *, group=None, replicate_group=None,
                reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None,
                offload_policy: CPUOffloadPolicy | None = None) -> nn.Module:
    """Shard `module`'s parameters (those not already sharded by a child) along dim 0.

    `group`: the ranks that share the shards (all, by default). `replicate_group`: HSDP,
    where PyTorch takes a 2-D mesh: the ranks, one per shard group, that hold this rank's
    same shards, and with whom each reduced gradient shard is all-reduced.

    Apply it bottom-up: to each block, then to the root. Refused: a second call on the
    same module; a call on a child after its parent (the parent already took its
    parameters); parameters that differ across ranks. (A weight tied between two modules
    must be in one unit: shard their common parent, as the root does with the GPT's
    embedding and head.)
    """
    if "_sharded_units" in module.__dict__:
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; "
                         f"apply it once per module")
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed initialized: run it in a "
                           "process started by shardlab.launch.launch (or torchrun)")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    slots = []
    for slot in collect_slots(module).values():
        owner = getattr(slot.param, "_sharded_by", None)
        taken_by = getattr(slot.param, "_taken_by", None)
        if taken_by is not None:
            # The original of a parameter another unit sharded: this module uses it too
            # (a weight shared or tied across units). Sharding it again would untie it.
            raise ValueError(_shared_error(module, slot.name, taken_by))
        if owner is None:
            slots.append(slot)
        elif _is_ancestor(owner.module, module):
            raise ValueError(_order_error(module, owner.module))
        # else: a shard of a child unit, which owns it
    # HSDP's replicas must start equal too: equal in the shard group and across its
    # replicas is equal on the whole mesh, and no more (a tensor-parallel rank beside it
    # holds another piece of the layer)
    for ranks in (group,) if replicate_group is None else (group, replicate_group):
        check_same_on_all_ranks([(s.name, s.param) for s in slots], ranks,
                                what=f"this {type(module).__name__}")
    device = next((storage_device(s.param) for s in slots), torch.device("cpu"))
    # A root whose children took every parameter gets an empty unit: it still runs the
    # root's part of the schedule (the end-of-backward callback).
    unit = PerParamUnit(module, slots, group=group, replicate_group=replicate_group,
                        reshard_after_forward=reshard_after_forward,
                        param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
                        offload=offload_policy is not None, device=device)
    unit.cast_inputs = mp_policy.cast_forward_inputs
    for p in unit.sharded_params:
        p._sharded_by = unit
    for slot in slots:
        slot.param._taken_by = module
        slot.param._taken_as = slot.name
    _refuse_optimizers_built_before()
    module.__dict__["_sharded_units"] = [unit]
    unit.install_hooks()
    cls = type(module)
    if not isinstance(module, FSDPModule):
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return module


_checked_optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_refusal_installed = False


def _refuse_optimizers_built_before() -> None:
    """From the first `fully_shard` on, every torch.optim optimizer's first step checks
    that it holds none of the parameters `fully_shard` replaced by their shards.

    An optimizer built before `fully_shard` holds the original full tensors: no gradient
    reaches them any more (the module computes with its shards), so it steps nothing and
    the model never trains, without an error. Checked at the first step because that is
    where a user's own optimizer and the sharded model first meet (fully_shard never sees
    the optimizer); a global step hook, because the user builds the optimizer."""
    global _refusal_installed
    if _refusal_installed:
        return
    _refusal_installed = True
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(check_optimizer_after_sharding)


def check_optimizer_after_sharding(optimizer: torch.optim.Optimizer, *_) -> None:
    """Refuse, in one line, an optimizer that holds parameters `fully_shard` replaced."""
    if optimizer in _checked_optimizers:
        return
    stale = [p for group in optimizer.param_groups for p in group["params"]
             if getattr(p, "_taken_by", None) is not None]
    if stale:
        first = stale[0]
        raise ValueError(
            f"this {type(optimizer).__name__} was built before fully_shard: it holds "
            f"{len(stale)} parameter(s) that fully_shard replaced by their shards (e.g. "
            f"{first._taken_as!r} of {type(first._taken_by).__name__}), which no gradient "
            f"reaches. Build the optimizer after sharding: fully_shard each unit and the "
            f"root, then e.g. torch.optim.AdamW(model.parameters())")
    _checked_optimizers.add(optimizer)


def _is_ancestor(parent: nn.Module, child: nn.Module) -> bool:
    return parent is not child and any(m is child for m in parent.modules())


def _shared_error(module: nn.Module, name: str, taken_by: nn.Module) -> str:
    taken_class = next(c for c in type(taken_by).__mro__ if not issubclass(c, FSDPModule))
    return (f"parameter {name!r} of this {type(module).__name__} is shared with "
            f"fully_shard({taken_class.__name__}), which already sharded it: a shared or "
            f"tied weight must belong to one unit. Shard a module that contains every user "
            f"of it (their common parent) instead of one of them alone")


def _order_error(child: nn.Module, parent: nn.Module) -> str:
    return (f"fully_shard({type(child).__name__}) after fully_shard({type(parent).__name__}), "
            f"which contains it: its parameters are already the parent's shards. Apply "
            f"fully_shard bottom-up: to each block first, then to the root")


def model_state(model: nn.Module) -> ShardedModel:
    """The whole model's sharding state (built at the root's first forward, or now)."""
    root = _unit_of(model)
    if root.model_state is None:
        ShardedModel.from_root(root)
    return root.model_state


def gather_full_parameters(model: nn.Module, rank0_only: bool = False
                           ) -> dict[str, torch.Tensor]:
    """{original name: full tensor}, on every rank (or on rank 0 only: {} elsewhere).

    Each unit is gathered in its shards' own dtype (fp32 under a MixedPrecisionPolicy),
    one unit at a time, so a rank never holds more than one unit twice over.
    """
    return model_state(model).gather_full(rank0_only)


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load full tensors (a checkpoint of the unsharded model) into a sharded model: each
    rank keeps its own dim-0 chunk of each. Every name must be known, and every
    parameter given."""
    state = model_state(model)
    known = {s.name: s for u in state.units for s in u.slots}
    aliases = {f"{pre}.{attr}" if pre else attr: s.name
               for u in state.units for s in u.slots
               for pre, mod in _names(model) for m, attr in s.owners if m is mod}
    params = {aliases[k]: v for k, v in state_dict.items() if k in aliases}
    missing = sorted(set(known) - set(params))
    buffers = dict(model.named_buffers())
    unknown = sorted(k for k in state_dict if k not in aliases and k not in buffers)
    if missing or unknown:
        raise ValueError(f"the state dict does not match the model: missing "
                         f"{_few(missing)}, unexpected {_few(unknown)}; pass the full state "
                         f"dict of the same architecture (e.g. from gather_full_parameters)")
    for unit in state.units:
        unit.reshard()
        unit.load_full(params)
    with torch.no_grad():
        for k, v in state_dict.items():
            if k in buffers:
                buffers[k].copy_(v)


def _few(names: list[str]) -> str:
    return str(names[:4])[:-1] + (f", ... ({len(names)} in all)]" if len(names) > 4 else "]")


def _names(model: nn.Module):
    return list(model.named_modules(remove_duplicate=False))
