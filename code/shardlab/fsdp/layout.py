"""FSDP2's layout: every parameter split along dim 0 into N padded chunks.

Rank r keeps chunk r of each parameter, an `nn.Parameter` of ceil(d0/N) rows (zero-padded)
under the parameter's own name. Gathered, the buffer is rank-major, so each parameter is
copied out of it into its own tensor: one extra copy bought per-parameter shards that
keep names, shapes, dtypes and `requires_grad` flags, which FSDP1's flat parameter could
not do. The schedule is `shardlab.sharded`'s, the same as ZeRO-3's; this module is only
where each element lives, and goes with `fully_shard` (`shardlab.fsdp.api`), its one user.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardlab.comm.compat import all_gather_into
from shardlab.sharded.unit import ShardedUnit, gather_shard, set_param
from shardlab.muon import Place, dim0_ranges
from shardlab.strategy import Piece, owned_ranges, state_of


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
            shard = self.local_flat[off:off + n].view(rows, *s.shape[1:])
            if not s.param.is_meta:  # on meta: no values yet, a checkpoint fills the shard
                mine = s.param.detach()[self.rank * rows:(self.rank + 1) * rows]
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

    def places(self) -> list[Place]:
        """Where each trainable parameter's elements are (`shardlab.muon.Place`): rows
        [r*R, (r+1)*R) on rank r, so rank r's range of the flattened parameter; this
        rank's window is the real rows of its shard."""
        out = []
        for s, p in zip(self.slots, self.sharded_params):
            if p.requires_grad:
                ranges = dim0_ranges(tuple(s.shape), self.world)
                a, z = next(((a, z) for r, a, z in ranges if r == self.rank), (0, 0))
                out.append(Place(s.name, s.shape, p, slice(0, z - a), ranges))
        return out

    def pieces(self, masters: dict[int, torch.Tensor], optimizer) -> list[Piece]:
        out = []
        for s, p, rows in zip(self.slots, self.sharded_params, self.rows):
            cols = s.numel // s.shape[0]
            ranges = owned_ranges(0, s.numel, lambda r: min(r * rows, s.shape[0]) * cols,
                                  self.world)
            mine = next(((a, z) for r, a, z in ranges if r == self.rank), None)
            a, z = mine or (0, 0)  # (0, 0): none of it here
            # named by global rank: the group's ranks, in HSDP this replica's ranks
            ranges = [(self.global_rank(r), lo, hi) for r, lo, hi in ranges]
            window = slice(0, z - a)
            master = masters.get(id(p))
            stepped = master if master is not None else p
            out.append(Piece(
                s.name, s.shape, a, z, p.detach().reshape(-1)[window], ranges,
                master=None if master is None else master.detach().reshape(-1)[window],
                optimizer_state=state_of(optimizer, stepped, window)
                if p.requires_grad else dict,
                # HSDP: every replica holds the same pieces; the first one writes them
                writer=self.replica == 0, aliases=s.aliases))
        return out

    def gather_full(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        if not self.slots:
            return {}
        full = gather_shard(self.local_flat.to(self.device), self.world, self.group,
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
