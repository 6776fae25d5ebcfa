"""What a strategy optimizes with: the optimizer's spec (class, arguments, the clip norm)
and its build over whatever a strategy decides to step (parameters, shards, or fp32
master copies).

A strategy receives an `OptimizerSpec`, not an optimizer: an optimizer built before the
model is wrapped would hold the parameters the strategy replaces. Clipping lives in the
spec because it belongs to the step (`shardlab.clip`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardlab.clip import (GradClip, check_clip_norm, clip_before_step,
                           torch_clip_before_step)
from shardlab.precision import MasterWeightOptimizer, Precision


@dataclass
class OptimizerSpec:
    """Which torch.optim class to build, and with what arguments, over whatever
    parameters (or shards, or fp32 master copies) a strategy decides to optimize; and
    the global norm its gradients are clipped to before each step (None: no clipping).

    Clipping belongs to the step, not to the loop: the gradients it must scale exist only
    inside some strategies' step (ZeRO-1 reduce-scatters there), and DeepSpeed's engine
    clips in its own step (its `gradient_clipping`)."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)
    clip_norm: float | None = None
    # The mistake `shardlab.faults` shows: each rank clips by its own shard's norm.
    clip_local_norm: bool = False

    def build(self, params) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)

    def clipper(self, *, sharded: bool, group=None) -> GradClip | None:
        """The clipping of this spec for gradients that are this rank's share
        (`sharded`) or all of them; None without clipping."""
        if self.clip_norm is None:
            return None
        return GradClip(self.clip_norm, sharded=sharded, group=group,
                        local=self.clip_local_norm)

    def clip_steps(self, optimizer: torch.optim.Optimizer, *, sharded: bool,
                   group=None) -> GradClip | None:
        """Clip what `optimizer` steps before each of its steps (see `shardlab.clip`).
        `group`: the ranks whose shards make up one whole gradient (HSDP's shard group:
        the replicas hold copies, which the norm must not count again)."""
        clip = self.clipper(sharded=sharded, group=group)
        return None if clip is None else clip_before_step(inner_optimizer(optimizer), clip)

    def torch_clip_steps(self, optimizer) -> GradClip | None:
        """The references' clipping: PyTorch's own `clip_grad_norm_` over what `optimizer`
        steps (DTensors under PyTorch's `fully_shard`), before each of its steps."""
        if self.clip_norm is None:
            return None
        inner = inner_optimizer(optimizer)
        params = [p for group in inner.param_groups for p in group["params"]]
        return torch_clip_before_step(inner, params, self.clip_norm)


OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {}),
    "sgd": (torch.optim.SGD, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
}


def optimizer_spec(name: str, lr: float, clip_norm: float | None = None,
                   clip_local_norm: bool = False) -> OptimizerSpec:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; use one of {sorted(OPTIMIZERS)}")
    cls, kwargs = OPTIMIZERS[name]
    return OptimizerSpec(cls, {"lr": lr, **kwargs}, check_clip_norm(clip_norm),
                         bool(clip_local_norm))


def build_optimizer(params, precision: Precision, spec: OptimizerSpec):
    """The optimizer over the trainable `params`: through fp32 master weights for
    "bf16-mixed"."""
    params = [p for p in params if p.requires_grad]
    if precision.master_weights:
        return MasterWeightOptimizer(params, spec.cls, **spec.kwargs)
    return spec.build(params)


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch.optim optimizer that holds the state (inside ZeRO or master weights)."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            raise TypeError(f"{type(optimizer).__name__} holds no torch.optim optimizer "
                            f"in `.optimizer`")
        optimizer = inner
    return optimizer
