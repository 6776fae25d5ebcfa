"""The two FSDP2 strategies: `fsdp2` (ours, `fully_shard` of `shardlab.fsdp.api`) and
`torch-fsdp2` (PyTorch's own `fully_shard`), with the same options mapped to each one's
policies, so that a run swaps one for the other by name.

Apart from `fully_shard` because a strategy is a recipe over the API (which units, which
policies, which optimizer, what the checkpoint reads), not part of it; PyTorch's own
`fully_shard` is driven by the same recipe, which is the point of the comparison.

The options are FSDP2's knobs, each set the same way on both:

    reshard_after_forward   True, False, or an int R (a divisor of the shard group's size)
    prefetch                False: gather each unit when it starts (ours only: PyTorch's
                            backward always prefetches); "backward": FSDP2's default, the
                            next unit in backward; True or k: explicit, k units ahead both
                            ways (`set_modules_to_forward_prefetch` / `..._backward_...`)
    accumulate              what the micro-batches before the last skip: "no_sync"
                            (`set_requires_gradient_sync(False)`: no reduction at all),
                            "sync" (nothing: reduce-scatter every micro-batch),
                            "no_all_reduce" (HSDP: `set_requires_all_reduce(False)`)
    reshard_after_backward  False: those micro-batches keep the full parameters after
                            backward (`set_reshard_after_backward(False)`)

`RECIPES` are ZeRO-1 and ZeRO-2 in those knobs (pytorch/pytorch#155952 asks for them).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from shardlab.comm.full_tensor import full_tensor
from shardlab.comm.links import INTRA, label_link
from shardlab.fsdp.api import (CPUOffloadPolicy, MixedPrecisionPolicy, check_reshard_size,
                               fully_shard, gather_full_parameters, model_state)
from shardlab.launch.devices import rank_device
from shardlab.muon import Place, dim0_ranges
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import Precision
from shardlab.strategy import (Piece, Wrapped, check_options, owned_ranges, state_of,
                               tied_names)
from shardlab.wrap import unit_modules


FSDP2_OPTIONS = {"wrap": "auto", "reshard_after_forward": True, "prefetch": False,
                 "offload": False, "reduce_dtype": "fp32", "accumulate": "no_sync",
                 "reshard_after_backward": True}
ACCUMULATE = ("no_sync", "sync", "no_all_reduce")

# ZeRO-1 and ZeRO-2 with `fully_shard` (the PR that added `set_reshard_after_backward`,
# pytorch/pytorch#124319, gives ZeRO-1's): the parameters stay gathered from the first
# micro-batch's forward to the last one's backward; ZeRO-1 reduces the gradients once, at
# the last micro-batch, ZeRO-2 every micro-batch. ZeRO-3 is the default.
RECIPES = {
    "zero1": {"reshard_after_forward": False, "reshard_after_backward": False,
              "accumulate": "no_sync"},
    "zero2": {"reshard_after_forward": False, "reshard_after_backward": False,
              "accumulate": "sync"},
    "zero3": {},
}


def check_fsdp2_options(strategy: str, options: dict, shard_size: int,
                        replicas: int = 1) -> dict:
    """The options merged with their defaults, each value refused in one line if it
    cannot run: `shard_size` ranks share the shards, `replicas` groups of them hold the
    same (HSDP)."""
    options = check_options(strategy, options, FSDP2_OPTIONS)
    check_reshard_size(options["reshard_after_forward"], shard_size)
    prefetch = options["prefetch"]
    if not (isinstance(prefetch, bool) or prefetch == "backward" or (
            isinstance(prefetch, int) and prefetch >= 1)):
        raise ValueError(f"strategy {strategy!r}: prefetch must be False, 'backward' (FSDP2's "
                         f"default), True or a number of units ahead >= 1, got {prefetch!r}")
    if options["accumulate"] not in ACCUMULATE:
        raise ValueError(f"strategy {strategy!r}: accumulate must be one of {list(ACCUMULATE)}, "
                         f"got {options['accumulate']!r}")
    if options["accumulate"] == "no_all_reduce" and replicas == 1:
        raise ValueError(f"strategy {strategy!r}: accumulate='no_all_reduce' skips HSDP's "
                         f"all-reduce across replicas, and this run has one replica: use "
                         f"accumulate='no_sync', or hsdp with a shard_group below the world size")
    for key in ("offload", "reshard_after_backward"):
        if not isinstance(options[key], bool):
            raise ValueError(f"strategy {strategy!r}: {key} must be True or False, got "
                             f"{options[key]!r}")
    return options


def check_options_before_launch(strategy: str, options: dict, world: int) -> None:
    """The cards' `launch_check` of `fsdp2` and `torch-fsdp2`: called by
    `shardlab.config.TrainConfig.validate`, before any process starts."""
    check_fsdp2_options(strategy, options, world)


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


def apply_fsdp2(model, precision, options, shard_fn, mp_cls, offload_cls):
    """`shard_fn` (ours or PyTorch's `fully_shard`, bound to its groups or mesh) applied
    to each unit of the wrap policy, bottom-up, with the options as its policies."""
    mp, offload = _policies(precision, options)
    if not precision.master_weights:
        model = model.to(precision.param_dtype)
    kwargs = {"reshard_after_forward": options["reshard_after_forward"]}
    if mp is not None:
        kwargs["mp_policy"] = mp_cls(param_dtype=mp[0], reduce_dtype=mp[1])
    if offload:
        kwargs["offload_policy"] = offload_cls(pin_memory=False)
    targets = unit_modules(model, options["wrap"])
    for module in targets:
        shard_fn(module, **kwargs)
    prefetch = options["prefetch"]
    if prefetch not in (False, "backward"):
        # Explicit prefetch, as torchtitan sets it: block i gathers blocks i+1..i+k in
        # forward, i-1..i-k in backward, so the next all-gathers run under this block's
        # compute. The root keeps the default (the last block, in backward).
        ahead, blocks = int(prefetch), targets[:-1]
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + ahead])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - ahead):i][::-1])
    return model


@contextlib.contextmanager
def accumulating(model: nn.Module, accumulate: str, reshard_after_backward: bool):
    """The knobs the micro-batches before the last run under (`Wrapped.no_sync`), for both
    FSDPs; the last micro-batch runs with all of them on again."""
    if accumulate == "no_sync":
        model.set_requires_gradient_sync(False)
    elif accumulate == "no_all_reduce":
        model.set_requires_all_reduce(False)
    if not reshard_after_backward:
        model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        if accumulate == "no_sync":
            model.set_requires_gradient_sync(True)
        elif accumulate == "no_all_reduce":
            model.set_requires_all_reduce(True)
        if not reshard_after_backward:
            model.set_reshard_after_backward(True)


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
    """Ours. options: wrap (a policy of `shardlab.wrap`), reshard_after_forward, prefetch,
    accumulate, reshard_after_backward (the module's docstring), offload
    (CPUOffloadPolicy), reduce_dtype ("fp32" or "bf16", under "bf16-mixed")."""
    check_options("fsdp2", options, FSDP2_OPTIONS)  # names first: before any collective
    options = check_fsdp2_options("fsdp2", options, dist.get_world_size())
    return fully_shard_on(model, precision, optimizer, options)


def fully_shard_on(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                   options: dict, group=None, replicate_group=None) -> Wrapped:
    """The course's `fully_shard` sharding over `group` (all ranks by default) and, for
    HSDP, replicating over `replicate_group`, under the options, behind the contract."""
    model = apply_fsdp2(model, precision, options,
                        lambda m, **kw: fully_shard(m, group=group,
                                                    replicate_group=replicate_group, **kw),
                        MixedPrecisionPolicy, CPUOffloadPolicy)
    state = model_state(model)
    # the course's fsdp2 gathers on demand unless asked (`prefetch`); its fully_shard,
    # like PyTorch's, prefetches in backward
    state.backward_prefetch = options["prefetch"] is not False
    for unit in state.units:  # R consecutive ranks: a node's
        if unit.post_forward_group is not None:
            label_link(unit.post_forward_group, INTRA)
    opt = optimizer.build([p for p in model.parameters() if p.requires_grad],
                          places=lambda: [p for u in state.units for p in u.places()],
                          group=group)
    return Wrapped(model, opt, no_sync=lambda: accumulating(
                       model, options["accumulate"], options["reshard_after_backward"]),
                   full_parameters=lambda: gather_full_parameters(model),
                   pieces=lambda: state.pieces(opt), extra_state=(state,),
                   clip=optimizer.clip_steps(opt, sharded=True, group=group))


def dtensor_pieces(model: nn.Module, optimizer) -> list[Piece]:
    """The pieces of a model sharded by PyTorch's `fully_shard`: each parameter is a
    DTensor cut along dim 0 as `torch.chunk` cuts it (ceil(d0/N) rows a rank), the same
    rows as the course's FSDP2, so the same ranges of the flattened parameter.

    On a 2-D mesh (HSDP: replicate x shard) the cut is over the mesh's last dimension, S
    ranks; each replica holds the same pieces, and the first replica writes them."""
    names = tied_names(model)
    out = []
    for name, p in model.named_parameters():
        mesh = p.device_mesh
        grid = mesh.mesh.reshape(-1, mesh.size(mesh.ndim - 1))  # [replicas, S] ranks
        coordinate = mesh.get_coordinate()
        replica, rank = (coordinate[0] if mesh.ndim > 1 else 0), coordinate[-1]
        world, ranks = grid.shape[1], grid[replica].tolist()
        local = p.to_local().detach()
        rows = -(-p.shape[0] // world)
        cols = p.numel() // p.shape[0]
        ranges = owned_ranges(0, p.numel(), lambda r: min(r * rows, p.shape[0]) * cols, world)
        a, z = next(((a, z) for r, a, z in ranges if r == rank), (0, 0))
        if local.numel() != z - a:
            raise ValueError(f"{name}: PyTorch's fully_shard holds {local.numel()} elements "
                             f"on rank {rank}, not the {z - a} of a dim-0 torch.chunk cut; "
                             f"this layout cannot be checkpointed by shardlab")
        out.append(Piece(name, p.shape, a, z, local.reshape(-1),
                         [(ranks[r], lo, hi) for r, lo, hi in ranges],
                         optimizer_state=state_of(optimizer, p, slice(0, z - a))
                         if p.requires_grad else dict,
                         writer=replica == 0, aliases=tuple(names[id(p)][1:])))
    return out


def dtensor_places(model: nn.Module) -> list[Place]:
    """Where each trainable parameter of a model sharded by PyTorch's `fully_shard` (on a
    1-D mesh) has its elements (`shardlab.muon.Place`): the DTensor's dim-0 rows, the
    same cut as ours (`dtensor_pieces` checks it)."""
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            ranges = dim0_ranges(tuple(p.shape), p.device_mesh.size())
            rank = p.device_mesh.get_local_rank()
            a, z = next(((a, z) for r, a, z in ranges if r == rank), (0, 0))
            out.append(Place(name, p.shape, p, slice(0, z - a), ranges))
    return out


def wrap_torch_fsdp2(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                     options: dict) -> Wrapped:
    """The reference: PyTorch's `fully_shard` per unit, then on the root, on a 1-D device
    mesh over all ranks, with the same options mapped to PyTorch's policies."""
    from torch.distributed.device_mesh import init_device_mesh

    check_options("torch-fsdp2", options, FSDP2_OPTIONS)  # names first: before any collective
    options = check_fsdp2_options("torch-fsdp2", options, dist.get_world_size())
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    return torch_fully_shard_on(mesh, model, precision, optimizer, options)


def torch_fully_shard_on(mesh, model: nn.Module, precision: Precision,
                         optimizer: OptimizerSpec, options: dict) -> Wrapped:
    """PyTorch's `fully_shard` on `mesh` (1-D: FSDP; 2-D replicate x shard: HSDP) under
    the course's options, behind the course's contract."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = apply_fsdp2(model, precision, options,
                        lambda m, **kw: torch_fully_shard(m, mesh=mesh, **kw), TorchMP,
                        TorchOffload)
    for group in torch_post_forward_groups(model):  # R consecutive ranks: a node's
        label_link(group, INTRA)
    # a whole matrix is cut among the shard dimension's ranks (the mesh's last: HSDP's
    # replicas each hold all of it)
    opt = optimizer.build([p for p in model.parameters() if p.requires_grad],
                          places=lambda: dtensor_places(model),
                          group=mesh.get_group(mesh_dim=mesh.ndim - 1))

    def full_parameters():
        # cloned: over a shard dimension of one rank (HSDP with S = 1) full_tensor() is
        # the live local tensor itself, which the next step changes in place
        return {name: full_tensor(p).detach().cpu().clone()
                for name, p in model.named_parameters()}

    return Wrapped(model, opt, no_sync=lambda: accumulating(
                       model, options["accumulate"], options["reshard_after_backward"]),
                   full_parameters=full_parameters, pieces=lambda: dtensor_pieces(model, opt),
                   clip=optimizer.torch_clip_steps(opt))


def torch_post_forward_groups(model: nn.Module) -> list:
    """The process groups PyTorch's `fully_shard` made for an integer
    `reshard_after_forward` (one per call: `_get_post_forward_mesh_info` in `_fsdp_init.py`
    builds a mesh of R consecutive ranks). PyTorch exposes no accessor: read from each
    module's FSDP state (`_fsdp_state.py`, `_fsdp_param_group.py`), for the ledger's labels."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        # a list in newer torch (`_fsdp_param_groups`, torch 2.13); one group or None in
        # older ones (`_fsdp_param_group`, torch 2.9)
        param_groups = getattr(state, "_fsdp_param_groups", None)
        if param_groups is None:
            param_groups = [g for g in [state._fsdp_param_group] if g is not None]
        for param_group in param_groups:
            info = param_group.post_forward_mesh_info
            if info is not None and info is not param_group.mesh_info:
                groups.append(info.shard_process_group)
    return groups
