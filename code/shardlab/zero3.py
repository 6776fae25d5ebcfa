"""ZeRO-3's layout: each unit's parameters flattened into one padded 1-D buffer, split N
ways, and the `zero3` strategy.

The layout of ZeRO-3 as the paper draws it and FSDP1 implements it: the unit's
parameters are concatenated into one 1-D buffer, padded to a multiple of N and cut into
N equal pieces. Rank r keeps piece r, which may hold the end of one parameter and the
start of the next. Gathered, the buffer *is* the full parameters: each one is a view
into it, no copy. The optimizer sees one flat shard per unit. (DeepSpeed cuts each
parameter on its own instead.)

The schedule, the same as FSDP2's, is `shardlab.sharded`'s; this module is only what
differs: where each element lives. `wrap_zero3` registers ZeRO-3 in `shardlab.strategy`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from shardlab.comm.compat import all_gather_into
from shardlab.infinity import DEFAULTS as DISK_DEFAULTS
from shardlab.infinity import DiskOptions, DiskTier, ParamsOnDisk, StreamedOptimizer
from shardlab.optimizers import OptimizerSpec, build_optimizer
from shardlab.muon import Place
from shardlab.precision import Precision
from shardlab.sharded.model import ParamSlot, shard_units
from shardlab.sharded.unit import ShardedUnit, gather_shard
from shardlab.strategy import (Piece, Wrapped, cast_model, check_options, owned_ranges,
                               state_of, storage_device)
from shardlab.wrap import unit_modules


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
        if slots[0].param.is_meta:
            # No values yet (a model built on meta): only this rank's shard gets storage,
            # and a checkpoint's pieces are read into it after wrapping.
            mine = torch.zeros(self.shard_numel, dtype=dtype, device=shard_device)
        else:
            flat = torch.zeros(world * self.shard_numel, dtype=dtype,
                               device=slots[0].param.device)
            torch.cat([s.param.detach().reshape(-1).to(dtype) for s in slots],
                      out=flat[:self.numel])
            mine = flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]
            mine = mine.clone().to(shard_device)
        # The padding is stepped too when trained (its gradient is zero, so it stays
        # zero): every rank then steps exactly S elements.
        self.shard = nn.Parameter(mine, requires_grad=self.requires_grad)
        # Allocated once, its storage freed (resized to 0) while sharded. The unsharded
        # parameters are views of it, created once, so that autograd's saved tensors and
        # gradient accumulation see the same objects every time.
        self.full = torch.empty(world * self.shard_numel, dtype=dtype, device=device)
        self.unsharded = [nn.Parameter(self.full[o:o + s.numel].view(s.shape),
                                       requires_grad=self.requires_grad)
                          for o, s in zip(self.offsets, slots)]
        # The original parameters' values now live in the shards: keep only their
        # metadata, or the rank would hold a whole second copy of the model (4Ψ bytes in
        # fp32, measured) that no count of its model states sees.
        for s in slots:
            s.param = nn.Parameter(torch.empty_like(s.param, device="meta"),
                                   requires_grad=s.param.requires_grad)


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
            full = gather_shard(b.shard.detach().to(self.device), self.world, self.group,
                                 rank0_only)
            if full is not None:
                out.update({s.name: full[o:o + s.numel].view(s.shape).clone()
                            for o, s in zip(b.offsets, b.slots)})
        return out

    def places(self) -> list[Place]:
        """Where each trained parameter's elements are (`shardlab.muon.Place`): its
        stretch of the flat buffer, cut at multiples of S; this rank's window in the flat
        shard it steps."""
        b, out = self.trained, []
        if b is None:
            return out
        S = b.shard_numel
        for s, o in zip(b.slots, b.offsets):
            ranges = owned_ranges(o, o + s.numel, lambda r: r * S, self.world)
            a, z = next(((a, z) for r, a, z in ranges if r == self.rank), (0, 0))
            lo = o - self.rank * S
            out.append(Place(s.name, s.shape, b.shard,
                             slice(lo + a, lo + z) if z > a else slice(0, 0), tuple(ranges)))
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


class DiskFlatUnit(FlatUnit):
    """ZeRO-3 with the parameter shards on disk (ZeRO-Infinity's `offload_param`): a
    shard is read in just before its all-gather and freed once gathered
    (`shardlab.infinity.ParamsOnDisk`, which also reads the next unit's ahead)."""

    def __init__(self, module, slots, *, params_on_disk: ParamsOnDisk, **kwargs):
        super().__init__(module, slots, **kwargs)
        self.params_on_disk = params_on_disk

    def start_all_gathers(self) -> list:
        self.params_on_disk.bring_in(self)
        return super().start_all_gathers()

    def use_gathered(self) -> None:
        self.params_on_disk.release(self)  # gathered: the shards are back on disk only

    def gather_full(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        with self.params_on_disk.brought_in(self):
            return super().gather_full(rank0_only)


ZERO3_OPTIONS = {"wrap": "auto", "prefetch": False, "reshard_after_forward": True,
                 **DISK_DEFAULTS}
# Why a run of zero3 with its states on disk has no checkpoint of the course
DISK_CHECKPOINTS = ("zero3 with offload keeps its optimizer states in files of its own, "
                    "read and written chunk by chunk: shardlab.checkpoint does not save "
                    "them; train without offload to save checkpoints")


def wrap_zero3(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
               options: dict) -> Wrapped:
    """ZeRO-3: each unit one flat padded shard (two with frozen parameters), the rest of
    the model the root.

    options: wrap (a policy of `shardlab.wrap`: "auto", "blocks", "model", "class:Name",
    "min-params:N", classes or a function module -> bool), prefetch (all-gather the next
    unit while this one computes), reshard_after_forward (True: free after forward,
    gather again for backward); ZeRO-Infinity's disk tier (`shardlab.infinity`): offload
    ("optimizer": the master copy and the optimizer's states on disk; "optimizer+params":
    the parameter shards too), offload_dir (the folder on the disk), offload_buffers
    (slots of the ring every transfer goes through, >= 2), offload_buffer_numel (elements
    per chunk, a multiple of 2048), direct_io (O_DIRECT), keep_offload_files (leave the
    files in offload_dir after the run).
    """
    options = check_options("zero3", options, ZERO3_OPTIONS)
    disk = DiskOptions.from_options(options)
    units = unit_modules(model, options["wrap"])
    model = cast_model(model, precision)
    device = storage_device(next(model.parameters()))
    if disk is not None:
        return _wrap_on_disk(model, units, precision, optimizer, options, disk, device)
    state = shard_units(model, units, FlatUnit, prefetch=bool(options["prefetch"]),
                        reshard_after_forward=bool(options["reshard_after_forward"]),
                        device=device)
    opt = build_optimizer([u.flat_param for u in state.units if u.flat_param is not None],
                          precision, optimizer,
                          places=lambda: [p for u in state.units for p in u.places()])
    return Wrapped(model, opt, no_sync=state.no_sync, full_parameters=state.gather_full,
                   pieces=lambda: state.pieces(opt), extra_state=(state,),
                   clip=optimizer.clip_steps(opt, sharded=True))


def _wrap_on_disk(model, units, precision, optimizer, options, disk: DiskOptions,
                  device) -> Wrapped:
    """ZeRO-3 whose optimizer states (and parameter shards) live in files."""
    if device.type != "cpu":
        raise ValueError("the disk tier of zero3 runs on the CPU (its files are read into "
                         "host memory); on a GPU, train without offload")
    params_on_disk = ParamsOnDisk() if disk.params else None
    unit_class, extra = ((DiskFlatUnit, {"params_on_disk": params_on_disk}) if disk.params
                         else (FlatUnit, {}))
    state = shard_units(model, units, unit_class, prefetch=bool(options["prefetch"]),
                        reshard_after_forward=bool(options["reshard_after_forward"]),
                        device=device, **extra)
    # after the sharding's collectives: a disk that fails one rank fails it alone
    tier = DiskTier(disk, precision, optimizer, dist.get_rank() if dist.is_initialized()
                    else 0)
    for u in state.units:
        for i, b in enumerate(u.buffers):
            if disk.params or b.requires_grad:
                tier.add(f"{u.name}.{i}", b)
    tier.ready()
    if params_on_disk is not None:
        params_on_disk.tier = tier
    trained = [u.trained for u in state.units if u.trained is not None]
    opt = StreamedOptimizer(tier, trained, optimizer, params_on_disk)
    return Wrapped(model, opt, no_sync=state.no_sync, full_parameters=state.gather_full,
                   pieces=None, checkpoint_refusal=DISK_CHECKPOINTS,
                   extra_state=(state,), clip=opt.clip)
