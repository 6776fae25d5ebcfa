"""The whole model's side of the schedule, and building its units.

One unit cannot know when backward ends, which unit runs next, or whether this
micro-batch's gradients are to be reduced: `ShardedModel`, held by the root unit, keeps
the units in forward order and answers those (the end-of-backward callback, implicit
prefetching, `no_sync`, gathering the full parameters, the checkpoint's pieces).
`shard_units` builds the units from a list of modules, giving each parameter to the
innermost unit that holds every module using it.

This module is the lower of the two: a unit builds the model's state at the root's first
forward, so `shardlab.sharded.unit` imports this one, and here a unit is known only by
what the model asks of it (`Unit`), never by its class.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from shardlab.optimizers import inner_optimizer
from shardlab.strategy import Piece, check_same_on_all_ranks


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


class Unit(Protocol):
    """What the model-wide state asks of a unit (`shardlab.sharded.unit.ShardedUnit`)."""

    module: nn.Module
    slots: list[ParamSlot]
    name: str
    model_state: ShardedModel | None
    requires_gradient_sync: bool
    reshard_after_backward: bool
    unsharded_params: list[nn.Parameter]

    def post_backward(self) -> None: ...
    def finish_reduce(self) -> None: ...
    def reshard(self) -> None: ...
    def install_hooks(self) -> None: ...
    def gather_full(self, rank0_only: bool = False) -> dict[str, torch.Tensor]: ...
    def pieces(self, masters: dict[int, torch.Tensor], optimizer) -> list[Piece]: ...


class ShardedModel:
    """The model-wide state of a step, held by the root unit (the outermost one).

    It knows every unit and the order the last forward ran them in, queues the callback
    that ends the backward (reduce-scattering what no post-backward hook did), and
    implements implicit prefetching, gradient accumulation and full-parameter gathers.
    """

    def __init__(self, root: Unit, units: list[Unit], prefetch: bool = False,
                 backward_prefetch: bool = False):
        self.root = root
        self.units = units
        self.prefetch = prefetch          # implicit: gather the next unit while one computes
        # FSDP2's default overlap (`FSDPParamGroup._backward_prefetch` in PyTorch's
        # `_fsdp_param_group.py`): as a unit's backward starts, gather the unit before it
        # in post-forward order; forward gathers each unit when it starts.
        self.backward_prefetch = backward_prefetch
        self.forward_order: list[Unit] = []  # this step's, as it happens
        self.post_forward_order: list[Unit] = []  # this forward's, as units finish
        self.last_order: list[Unit] = []     # the previous step's, complete
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
    def from_root(root: Unit) -> "ShardedModel":
        """The state of a model sharded by `fully_shard`, which overlaps as FSDP2 does by
        default (backward prefetch)."""
        units = [u for m in root.module.modules() for u in getattr(m, "_sharded_units", [])]
        return ShardedModel(root, units, backward_prefetch=True)

    def root_pre_forward(self, args, kwargs):
        if torch.is_grad_enabled():
            self.forward_order = []
            self.post_forward_order = []
        return args, kwargs

    def record_forward(self, unit: Unit) -> None:
        if unit not in self.forward_order:
            self.forward_order.append(unit)

    def record_post_forward(self, unit: Unit) -> None:
        if unit not in self.post_forward_order:
            self.post_forward_order.append(unit)

    def implicit_forward_prefetch(self, unit: Unit) -> list[Unit]:
        """The unit that ran after this one in the last step's forward."""
        if not self.prefetch or unit not in self.last_order:
            return []
        i = self.last_order.index(unit)
        return self.last_order[i + 1:i + 2]

    def implicit_backward_prefetch(self, unit: Unit) -> list[Unit]:
        """Backward runs the units in reverse forward order: gather the one before (in
        post-forward order under FSDP2's default: the root, whose forward ends last, is
        followed by the last block, not by nothing)."""
        if self.backward_prefetch:
            order = self.post_forward_order
            i = order.index(unit) if unit in order else 0
            return [order[i - 1]] if i > 0 else []
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
            if unit.reshard_after_backward:  # else kept gathered for the next micro-batch
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
