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
import torch.distributed as dist
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

    Two of FSDP2's knobs live in the layout. `post_forward_group` (an integer
    `reshard_after_forward` R): after forward, each parameter's padded full tensor is cut
    into R equal pieces and this rank keeps the piece of its place in that group of R
    ranks, as PyTorch's `FSDPParam.to_sharded_post_forward` does; backward all-gathers the
    pieces among the R ranks. `all_gather_comm` / `reduce_scatter_comm`
    (`set_custom_all_gather` / `set_custom_reduce_scatter`): the collectives themselves,
    called as PyTorch calls its `AllGather` and `ReduceScatter` (`_fsdp_api.py`), e.g.
    ZeRO++'s quantized ones (`shardlab.zeropp`).
    """

    def __init__(self, module, slots, *, post_forward_group=None, **kwargs):
        super().__init__(module, slots, **kwargs)
        self.post_forward_group = post_forward_group
        self.all_gather_comm = None      # None: all_gather_into, the plain collective
        self.reduce_scatter_comm = None  # None: reduce_scatter_into
        self.post_forward_flat = None    # this rank's 1/R pieces, between forward and backward
        self.gathered_post_forward = False
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
        return [self.all_gather(self.gathered, local, self.group)]

    def all_gather(self, output: torch.Tensor, local: torch.Tensor, group):
        if self.all_gather_comm is None:
            return all_gather_into(output, local, group=group, async_op=True)
        return self.all_gather_comm(output_tensor=output, input_tensor=local, group=group,
                                    async_op=True)

    def start_reduce_scatter(self, reduced: torch.Tensor, full: torch.Tensor):
        if self.reduce_scatter_comm is None:
            return super().start_reduce_scatter(reduced, full)
        return self.reduce_scatter_comm(output_tensor=reduced, input_tensor=full,
                                        group=self.group, op=dist.ReduceOp.SUM,
                                        async_op=True)

    def use_gathered(self) -> None:
        rows, widths = self.world, self.shard_numels
        if self.gathered_post_forward:  # R pieces of each parameter, from the R ranks
            rows = dist.get_world_size(self.post_forward_group)
            widths = [self.world * n // rows for n in self.shard_numels]
        outs = []
        for padded, width in zip(self.padded_unsharded, widths):
            padded.untyped_storage().resize_(padded.numel() * padded.element_size())
            outs.append(padded.data.view(rows, width))  # .data: see FlatUnit
        torch.split_with_sizes_copy(self.gathered.view(rows, sum(widths)), widths, dim=1,
                                    out=outs)
        self.gathered = None
        if self.gathered_post_forward:
            self.drop_post_forward_shard()

    # ------------------------------------------------------------ reshard to a smaller group

    def keep_post_forward_shard(self) -> None:
        """This rank's piece of each padded full parameter, cut R ways, in one flat buffer
        (the all-gather input of backward)."""
        size = dist.get_world_size(self.post_forward_group)
        place = dist.get_rank(self.post_forward_group)
        self.post_forward_flat = torch.cat([padded.view(size, -1)[place]
                                            for padded in self.padded_unsharded])

    def start_post_forward_all_gathers(self) -> list:
        size = dist.get_world_size(self.post_forward_group)
        local = self.post_forward_flat
        self.gathered = torch.empty(size * local.numel(), dtype=local.dtype,
                                    device=local.device)
        self.gathered_post_forward = True
        return [self.all_gather(self.gathered, local, self.post_forward_group)]

    def drop_post_forward_shard(self) -> None:
        self.post_forward_flat = None
        self.gathered_post_forward = False

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
