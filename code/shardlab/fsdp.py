"""FSDP2 from scratch: `fully_shard`, with PyTorch's calling convention.

    for block in model.blocks:
        fully_shard(block)          # bottom-up: each block is a unit ...
    fully_shard(model)              # ... then the root takes what is left (embeddings, head)

Each call makes the module one unit of `shardlab.sharded` with FSDP2's layout
(`PerParamUnit`): every parameter is split along dim 0 into N padded chunks, and between
steps the module's parameters *are* this rank's chunks, `nn.Parameter`s of shape
[ceil(d0/N), ...] under their original names. So the optimizer is built over
`model.parameters()` as usual, `state_dict()` keeps the names, and frozen or
differently-typed parameters stay what they are, which FSDP1's flat parameter could not do.

The schedule (gather before forward and backward, free after, reduce-scatter the
gradients) is the one ZeRO-3 uses: see `shardlab.sharded`. What this module adds is the
API: the options (`reshard_after_forward`, `MixedPrecisionPolicy`, `CPUOffloadPolicy`),
the methods PyTorch's `FSDPModule` has (`unshard`, `reshard`, prefetch and gradient-sync
setters), the helpers between sharded and full models, and the two strategies `fsdp2`
(ours) and `torch-fsdp2` (PyTorch's `fully_shard`) registered in `shardlab.strategy`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardlab.launch import rank_device
from shardlab.precision import Precision
from shardlab.sharded import PerParamUnit, ShardedModel, ShardedState, collect_slots
from shardlab.strategy import (OptimizerSpec, Piece, Wrapped, check_options,
                               check_same_on_all_ranks, owned_ranges, state_of, tied_names)
from shardlab.wrap import unit_modules


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


def fully_shard(module: nn.Module, *, group=None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None,
                offload_policy: CPUOffloadPolicy | None = None) -> nn.Module:
    """Shard `module`'s parameters (those not already sharded by a child) along dim 0.

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
    check_same_on_all_ranks([(s.name, s.param) for s in slots], group,
                            what=f"this {type(module).__name__}")
    device = next((s.param.device for s in slots), torch.device("cpu"))
    # A root whose children took every parameter gets an empty unit: it still runs the
    # root's part of the schedule (the end-of-backward callback).
    unit = PerParamUnit(module, slots, group=group,
                        reshard_after_forward=reshard_after_forward,
                        param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
                        offload=offload_policy is not None, device=device)
    unit.cast_inputs = mp_policy.cast_forward_inputs
    for p in unit.sharded_params:
        p._sharded_by = unit
    for slot in slots:
        slot.param._taken_by = module
    module.__dict__["_sharded_units"] = [unit]
    unit.install_hooks()
    cls = type(module)
    if not isinstance(module, FSDPModule):
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return module


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


# ----------------------------------------------------------------------------- helpers


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


# ----------------------------------------------------------------------------- strategies

FSDP2_OPTIONS = {"wrap": "auto", "reshard_after_forward": True, "prefetch": False,
                 "offload": False, "reduce_dtype": "fp32"}


def _policies(precision, options):
    """Our precisions as FSDP2 policies: "bf16-mixed" keeps fp32 shards (the master
    weights) and all-gathers bf16; "bf16" casts the model itself; "fp32" is plain."""
    mp = None
    if precision.master_weights:
        reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
            options["reduce_dtype"])
        if reduce_dtype is None:
            raise ValueError(f"reduce_dtype must be 'fp32' or 'bf16', got "
                             f"{options['reduce_dtype']!r}")
        mp = (precision.param_dtype, reduce_dtype)
    return mp, bool(options["offload"])


def _apply(model, precision, options, shard_fn, mp_cls, offload_cls):
    mp, offload = _policies(precision, options)
    if not precision.master_weights:
        model = model.to(precision.param_dtype)
    kwargs = {"reshard_after_forward": bool(options["reshard_after_forward"])}
    if mp is not None:
        kwargs["mp_policy"] = mp_cls(param_dtype=mp[0], reduce_dtype=mp[1])
    if offload:
        kwargs["offload_policy"] = offload_cls(pin_memory=False)
    targets = unit_modules(model, options["wrap"])
    for module in targets:
        shard_fn(module, **kwargs)
    if options["prefetch"]:
        # Explicit prefetch, as torchtitan sets it: block i gathers block i+1 in forward,
        # block i-1 in backward, so the next all-gather runs under this block's compute.
        blocks = targets[:-1]
        for prev, nxt in zip(blocks, blocks[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    return model


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module):
    """`no_sync` for both FSDPs: micro-batches accumulate unreduced gradients, and the last
    one, outside this block, reduce-scatters the sum."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def wrap_fsdp2(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
               options: dict) -> Wrapped:
    """Ours. options: wrap (a policy of `shardlab.wrap`), reshard_after_forward, prefetch
    (explicit, unit to unit), offload (CPUOffloadPolicy), reduce_dtype ("fp32" or "bf16",
    under "bf16-mixed")."""
    options = check_options("fsdp2", options, FSDP2_OPTIONS)
    model = _apply(model, precision, options, fully_shard, MixedPrecisionPolicy,
                   CPUOffloadPolicy)
    state = model_state(model)
    opt = optimizer.build([p for p in model.parameters() if p.requires_grad])
    return Wrapped(model, opt, no_sync=lambda: gradient_sync_off(model),
                   full_parameters=lambda: gather_full_parameters(model),
                   pieces=lambda: state.pieces(opt), extra_state=(state,))


def dtensor_pieces(model: nn.Module, optimizer) -> list[Piece]:
    """The pieces of a model sharded by PyTorch's `fully_shard`: each parameter is a
    DTensor cut along dim 0 as `torch.chunk` cuts it (ceil(d0/N) rows a rank), the same
    rows as the course's FSDP2, so the same ranges of the flattened parameter."""
    world, rank = dist.get_world_size(), dist.get_rank()
    names = tied_names(model)
    out = []
    for name, p in model.named_parameters():
        local = p.to_local().detach()
        rows = -(-p.shape[0] // world)
        cols = p.numel() // p.shape[0]
        ranges = owned_ranges(0, p.numel(), lambda r: min(r * rows, p.shape[0]) * cols, world)
        a, z = next(((a, z) for r, a, z in ranges if r == rank), (0, 0))
        if local.numel() != z - a:
            raise ValueError(f"{name}: PyTorch's fully_shard holds {local.numel()} elements "
                             f"on rank {rank}, not the {z - a} of a dim-0 torch.chunk cut; "
                             f"this layout cannot be checkpointed by shardlab")
        out.append(Piece(name, p.shape, a, z, local.reshape(-1), ranges,
                         optimizer_state=state_of(optimizer, p, slice(0, z - a))
                         if p.requires_grad else dict,
                         aliases=tuple(names[id(p)][1:])))
    return out


def wrap_torch_fsdp2(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                     options: dict) -> Wrapped:
    """The reference: PyTorch's `fully_shard` per unit, then on the root, on a 1-D device
    mesh over all ranks, with the same options mapped to PyTorch's policies."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    options = check_options("torch-fsdp2", options, FSDP2_OPTIONS)
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    model = _apply(model, precision, options,
                   lambda m, **kw: torch_fully_shard(m, mesh=mesh, **kw), TorchMP,
                   TorchOffload)
    opt = optimizer.build([p for p in model.parameters() if p.requires_grad])

    def full_parameters():
        return {name: p.full_tensor().detach().cpu()
                for name, p in model.named_parameters()}

    return Wrapped(model, opt, no_sync=lambda: gradient_sync_off(model),
                   full_parameters=full_parameters, pieces=lambda: dtensor_pieces(model, opt))


# ----------------------------------------------------------------------------- a worker


def step_probe(cases: list[dict], steps: int = 4, batch_size: int = 8, seq_len: int = 32
               ) -> list[dict]:
    """Run on every rank (with `shardlab.launch.launch`): for each case
    {strategy, options, model, precision}, train `steps` steps and look inside the last:
    PyTorch's own count of the c10d collectives it ran (`CommDebugMode`, which sees ours and
    `fully_shard`'s alike), the timeline of our schedule (ours only), the step times, the
    losses, and the parameters as the module shows them (name, shape, dtype)."""
    import time

    from torch.distributed.tensor.debug import CommDebugMode

    from shardlab.models import build_model, get_batch, loss_fn
    from shardlab.precision import get_precision
    from shardlab.sharded import tracing
    from shardlab.strategy import get_strategy, optimizer_spec

    import warnings

    # CommDebugMode's module tracker warns that a full backward hook fires without inputs
    # that need a gradient (token ids); under it PyTorch's FSDP2 also warns that the
    # model's output is a view. Neither concerns this loop, which never edits the output.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for case in cases:
        model = build_model(case.get("model", "gpt-tiny"), seed=0).to(rank_device())
        wrapped = get_strategy(case["strategy"])(
            model, get_precision(case.get("precision", "fp32")), optimizer_spec("adamw", 1e-3),
            dict(case.get("options", {})))
        shown = [(n, tuple(p.shape), str(p.dtype).replace("torch.", ""))
                 for n, p in wrapped.model.named_parameters()]
        losses, times, counts, events = [], [], {}, []
        for step in range(steps):
            x, y = (t.to(rank_device()) for t in get_batch(step, rank, world, batch_size,
                                                            seq_len))
            last = step == steps - 1
            counter = CommDebugMode() if last else contextlib.nullcontext()
            tracer = tracing() if last else contextlib.nullcontext()
            dist.barrier()
            with counter, tracer as trace:
                start = time.perf_counter()
                loss = loss_fn(wrapped.model(x), y)
                loss.backward()
                wrapped.optimizer.step()
                wrapped.optimizer.zero_grad()
                times.append(time.perf_counter() - start)
            losses.append(loss.item())
            if last:
                counts = {str(op).split(".")[-1]: n
                          for op, n in counter.get_comm_counts().items()}
                events = [(t - start, unit, what, edge) for t, unit, what, edge in trace]
        results.append({"case": case, "losses": losses, "step_times": times,
                        "collectives": counts, "events": sorted(events), "shown": shown})
    return results


__all__ = ["fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy",
           "gather_full_parameters", "load_full_state_dict", "wrap_fsdp2",
           "wrap_torch_fsdp2", "ShardedState"]
