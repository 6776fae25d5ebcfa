"""Muon with AdamW beside it, as two optimizers: PyTorch's own pair for a model every
rank holds whole, and `ShardedMuon` for parameters that a strategy cut across ranks.

`MuonWithAdamW` is the single-process truth the course checks against:
`torch.optim.Muon` over the hidden matrices and `torch.optim.AdamW` over the rest, one
`step()`. Data parallelism uses it as it is (every rank holds every matrix).

`ShardedMuon` steps what a sharded strategy steps (ZeRO chunks, ZeRO-3 flat shards,
FSDP2 row shards, PyTorch's DTensors), told by the strategy where each parameter's
elements are (`shardlab.muon.places`). AdamW is element-wise, so it steps this rank's
elements of the other parameters as they are. Muon is element-wise up to the
orthogonalization: the momentum, Nesterov's mix and the weight decay are computed on this
rank's elements, and only the orthogonalization of the update needs the whole matrix,
which one of the three designs provides (`shardlab.muon.designs`). The arithmetic is
torch's, in torch's order, on every element, so with the same gradients the parameters
are the same to the bit; what differs from one process is only the order in which the
ranks' gradients were summed.

It steps once per `step()`, whatever the micro-batches before it: the strategies reduce
the accumulated gradient once (a Muon that ran in every micro-batch's backward
orthogonalized each micro-batch's gradient alone: DeepSpeed PR #8600, weights off by
1.3e-1 relative under ZeRO-3).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from shardlab.muon import designs
from shardlab.muon.newton_schulz import (COEFFICIENTS, EPS, STEPS, adjusted_lr,
                                         newton_schulz, watch)
from shardlab.muon.places import Place, owners_by_size, sole_holders

DESIGNS = ("gather", "owner", "whole")

# torch.optim.Muon's defaults, but for the learning rate's adjustment: Moonshot's
# "match_rms_adamw" gives Muon's update the RMS of AdamW's, so one learning rate serves
# both halves (torch's Muon docstring).
MUON_DEFAULTS = {"weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                 "ns_coefficients": COEFFICIENTS, "eps": EPS, "ns_steps": STEPS,
                 "adjust_lr_fn": "match_rms_adamw"}
ADAMW_DEFAULTS: dict = {}  # torch.optim.AdamW's own


class MuonWithAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` over `matrices`, `torch.optim.AdamW` over `others`, stepped
    together: one optimizer to the loop. Both share this optimizer's `param_groups`
    (the Muon group first) and `state`."""

    def __init__(self, matrices: list[torch.Tensor], others: list[torch.Tensor], *,
                 lr: float, muon: dict | None = None, adamw: dict | None = None):
        if not hasattr(torch.optim, "Muon"):
            raise ValueError(f"torch {torch.__version__} has no torch.optim.Muon: use "
                             f"torch >= 2.9 for the optimizer muon")
        self.parts = []
        if matrices:
            self.parts.append(torch.optim.Muon(matrices, lr=lr, **{**MUON_DEFAULTS,
                                                                   **(muon or {})}))
        if others:
            self.parts.append(torch.optim.AdamW(others, lr=lr, **{**ADAMW_DEFAULTS,
                                                                   **(adamw or {})}))
        super().__init__([g for part in self.parts for g in part.param_groups], {"lr": lr})
        for part in self.parts:
            part.state = self.state  # one state: readers count both

    @torch.no_grad()
    def step(self, closure=None):
        for part in self.parts:
            part.step()


class ShardedMuon(torch.optim.Optimizer):
    """Muon on the matrices named in `hidden`, AdamW on the other parameters, each
    parameter cut across the ranks of `group` as `places` say; `design` is "gather",
    "owner" or "whole" (`shardlab.muon.designs`). Its one parameter group holds the
    tensors the strategy steps, so the strategy's gradient clipping and zero_grad see
    them; its `state` holds the momentum of this rank's pieces of the matrices (by name)
    and AdamW's moments of its pieces of the rest."""

    def __init__(self, places: list[Place], *, design: str, hidden: frozenset[str],
                 lr: float, group=None, muon: dict | None = None, adamw: dict | None = None):
        if design not in DESIGNS:
            raise ValueError(f"unknown Muon design {design!r}; use one of {list(DESIGNS)}")
        self.tensors = list({id(p.tensor): p.tensor for p in places}.values())
        super().__init__([{"params": self.tensors}], {"lr": lr})
        self.design = design
        self.muon = {**MUON_DEFAULTS, **(muon or {})}
        # Muon's exchanges run on a process group of their own, so that the ledger tells
        # their bytes from the strategy's (`MuonWatch.groups`).
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self.group = dist.new_group(ranks) if dist.is_initialized() else None
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.matrices = [p for p in places if p.name in hidden]
        for p in self.matrices:
            if len(p.shape) != 2:
                raise ValueError(f"Muon steps 2-D matrices only; parameter {p.name!r} has "
                                 f"shape {tuple(p.shape)}: leave it to AdamW")
        self.owners = ({} if design == "gather" else
                       sole_holders(self.matrices) if design == "whole" else
                       owners_by_size([(p.name, p.numel) for p in self.matrices], self.world))
        # AdamW steps this rank's elements of the rest: views of the stepped storage.
        self.others = [(p, p.local(p.tensor).detach()) for p in places
                       if p.name not in hidden and p.local(p.tensor).numel()]
        self.adamw = (torch.optim.AdamW([view for _, view in self.others], lr=lr,
                                        **{**ADAMW_DEFAULTS, **(adamw or {})})
                      if self.others else None)
        if self.adamw is not None:
            self.adamw.state = self.state  # one state: readers count both

    def _group_name(self) -> str:
        return str(getattr(self.group, "group_name", ""))

    @torch.no_grad()
    def step(self, closure=None):
        lr = self.param_groups[0]["lr"]
        ready = {id(t) for t in self.tensors if t.grad is not None}
        self._step_adamw(ready, lr)
        todo = [p for p in self.matrices if id(p.tensor) in ready]
        if not todo:
            return
        watch().groups.add(self._group_name())
        pieces = {p: self._nesterov_update(p).bfloat16() for p in todo}
        orthogonalize = functools.partial(newton_schulz, steps=self.muon["ns_steps"],
                                          coefficients=self.muon["ns_coefficients"],
                                          eps=self.muon["eps"])
        if self.design == "gather":
            slices = designs.gather(todo, pieces, self.group, orthogonalize)
        else:
            slices = designs.owner(todo, pieces, self.owners, self.group, orthogonalize)
        for p, update in slices.items():
            param = p.local(p.tensor)
            param.mul_(1 - lr * self.muon["weight_decay"])
            param.add_(update, alpha=-adjusted_lr(lr, self.muon["adjust_lr_fn"], p.shape))

    def _step_adamw(self, ready: set[int], lr: float) -> None:
        if self.adamw is None:
            return
        self.adamw.param_groups[0]["lr"] = lr
        for p, view in self.others:
            view.grad = p.local(p.tensor.grad) if id(p.tensor) in ready else None
        self.adamw.step()
        for _, view in self.others:
            view.grad = None

    def _nesterov_update(self, p: Place) -> torch.Tensor:
        """torch's momentum and Nesterov mix on this rank's elements of matrix `p`."""
        grad = p.local(p.tensor.grad)
        state = self.state[p.name]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf, momentum = state["momentum_buffer"], self.muon["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if self.muon["nesterov"] else buf
