"""The two FSDP2 strategies: `fsdp2` (ours, `fully_shard` of `shardlab.fsdp.api`) and
`torch-fsdp2` (PyTorch's own `fully_shard`), with the same options mapped to each one's
policies, so that a run swaps one for the other by name.

Apart from `fully_shard` because a strategy is a recipe over the API (which units, which
policies, which optimizer, what the checkpoint reads), not part of it; PyTorch's own
`fully_shard` is driven by the same recipe, which is the point of the comparison.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from shardlab.fsdp.api import (CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard,
                               gather_full_parameters, model_state)
from shardlab.launch.devices import rank_device
from shardlab.muon import Place, dim0_ranges
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import Precision
from shardlab.strategy import (Piece, Wrapped, check_options, owned_ranges, state_of,
                               tied_names)
from shardlab.wrap import unit_modules


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


def apply_fsdp2(model, precision, options, shard_fn, mp_cls, offload_cls):
    """`shard_fn` (ours or PyTorch's `fully_shard`, bound to its groups or mesh) applied
    to each unit of the wrap policy, bottom-up, with the options as its policies."""
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
    opt = optimizer.build([p for p in model.parameters() if p.requires_grad],
                          places=lambda: [p for u in state.units for p in u.places()],
                          group=group)
    return Wrapped(model, opt, no_sync=lambda: gradient_sync_off(model),
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

    options = check_options("torch-fsdp2", options, FSDP2_OPTIONS)
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
    # a whole matrix is cut among the shard dimension's ranks (the mesh's last: HSDP's
    # replicas each hold all of it)
    opt = optimizer.build([p for p in model.parameters() if p.requires_grad],
                          places=lambda: dtensor_places(model),
                          group=mesh.get_group(mesh_dim=mesh.ndim - 1))

    def full_parameters():
        # cloned: over a shard dimension of one rank (HSDP with S = 1) full_tensor() is
        # the live local tensor itself, which the next step changes in place
        return {name: p.full_tensor().detach().cpu().clone()
                for name, p in model.named_parameters()}

    return Wrapped(model, opt, no_sync=lambda: gradient_sync_off(model),
                   full_parameters=full_parameters, pieces=lambda: dtensor_pieces(model, opt),
                   clip=optimizer.torch_clip_steps(opt))
