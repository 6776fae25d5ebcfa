"""PyTorch's ZeRO-1 as a reference strategy: `ZeroRedundancyOptimizer` over PyTorch's DDP.

A module of its own because it is PyTorch's design, not the course's: whole tensors
assigned to ranks instead of a flat space cut N ways, DDP's all-reduce instead of a
reduce-scatter. The chapter sets its bytes and its collectives beside `zero1`'s.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from shardlab.buckets import DEFAULT_BUCKET_MB
from shardlab.clip import GradClip
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import MasterWeightOptimizer, Precision
from shardlab.strategy import (Piece, Wrapped, cast_model, check_options,
                               named_full_parameters, state_of, tied_names)

# bucket_mb: the bucket_cap_mb of the DDP that reduces its gradients (PyTorch's 25 by
# default), so that it can be given the bucket the course's zero1 is given
TORCH_ZERO1_OPTIONS: dict[str, Any] = {"find_unused_parameters": False,
                                       "bucket_mb": DEFAULT_BUCKET_MB}


class TorchZero1:
    """PyTorch's ZeRO-1: `ZeroRedundancyOptimizer` over a PyTorch DDP model.

    DDP all-reduces the full gradients (Ψ); each rank steps the parameters assigned to
    it; their owners broadcast them (Ψ). PyTorch assigns whole tensors to ranks (greedily,
    largest first) rather than cutting a flat space, so a rank's optimizer state is only
    about 1/N, by an amount that depends on the tensor sizes."""

    def __init__(self, ddp_model: nn.Module, optimizer_class, master_weights: bool,
                 **defaults: Any):
        constructor = (functools.partial(MasterWeightOptimizer, optimizer_class=optimizer_class)
                       if master_weights else optimizer_class)
        self.model = ddp_model
        self.clip: GradClip | None = None
        self.zero = ZeroRedundancyOptimizer([p for p in ddp_model.parameters()
                                             if p.requires_grad], constructor, **defaults)

    @property
    def param_groups(self) -> list[dict]:
        return self.zero.param_groups

    @property
    def optimizer(self):
        """This rank's own optimizer, over the parameters PyTorch assigned it."""
        return self.zero.optim

    def clip_grads(self, max_norm: float | None) -> GradClip | None:
        """PyTorch's `clip_grad_norm_` on DDP's averaged gradients, whole on every rank
        (no collective), before `ZeroRedundancyOptimizer` steps its own parameters."""
        if max_norm is None:
            return None
        self.clip = GradClip(max_norm, sharded=False)
        return self.clip

    def step(self) -> None:
        if self.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], self.clip.max_norm)
            self.clip.norms.append(float(norm))
        self.zero.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad(set_to_none=set_to_none)

    def pieces(self, module: nn.Module) -> list[Piece]:
        """Every parameter whole on every rank (DDP), its optimizer state whole on the one
        rank PyTorch assigned it to: that rank alone writes the parameter (from its fp32
        master copy under "bf16-mixed") and its state; every rank reads the parameter."""
        local = self.zero.optim
        masters = {id(p): m for p, m in getattr(local, "pairs", [])}
        inner = local.optimizer if isinstance(local, MasterWeightOptimizer) else local
        owned = {id(p) for group in local.param_groups for p in group["params"]}
        owned |= set(masters)  # the model parameters whose master copy this rank steps
        names = tied_names(module)
        out = []
        for name, p in module.named_parameters():
            mine = id(p) in owned
            master = masters.get(id(p))
            stepped = master if master is not None else p
            out.append(Piece(name, p.shape, 0, p.numel(), p.detach().reshape(-1),
                             master=None if master is None else master.detach().reshape(-1),
                             optimizer_state=state_of(inner, stepped, slice(None))
                             if mine else dict,
                             writer=mine or not p.requires_grad,
                             aliases=tuple(names[id(p)][1:])))
        return out

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        local = self.zero.optim
        optimizer = [t for state in local.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor)]
        if isinstance(local, MasterWeightOptimizer):
            optimizer += local.master_tensors()
        params = list(self.model.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": optimizer, "buffers": list(self.model.buffers())}


def wrap_torch_zero1(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                     options: dict) -> Wrapped:
    """Reference: torch.distributed.optim.ZeroRedundancyOptimizer over PyTorch DDP."""
    opts = check_options("torch-zero1", options, TORCH_ZERO1_OPTIONS)
    model = cast_model(model, precision)
    ddp = DistributedDataParallel(model, find_unused_parameters=opts["find_unused_parameters"],
                                  bucket_cap_mb=float(opts["bucket_mb"]))
    zero = TorchZero1(ddp, optimizer.cls, precision.master_weights, **optimizer.kwargs)
    return Wrapped(ddp, zero, no_sync=ddp.no_sync,
                   full_parameters=lambda: named_full_parameters(model),
                   pieces=lambda: zero.pieces(model), module=model,
                   clip=zero.clip_grads(optimizer.clip_norm))

