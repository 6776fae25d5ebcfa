"""One training loop for every strategy, the strategy registry, and the run report.

(The contract below is what every strategy module implements; the loop, the report and
the command line are built on it.)

A strategy is a function that takes the model every rank built identically and returns
what the loop needs, so the loop stays the ordinary PyTorch one for all of them:

    wrapped = wrap(model, precision, optimizer_spec, options)
    loss = loss_fn(wrapped.model(x), y); loss.backward()
    wrapped.optimizer.step(); wrapped.optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch import nn


@dataclass
class OptimizerSpec:
    """Which torch.optim class to build, and with what arguments, over whatever
    parameters (or shards, or fp32 master copies) a strategy decides to optimize."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, params) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


@dataclass
class Wrapped:
    """What a strategy hands back to the loop."""

    model: nn.Module
    optimizer: Any  # has step() and zero_grad()
    # Gradient accumulation: micro-batches before the last run under no_sync().
    no_sync: Callable[[], ContextManager] = contextlib.nullcontext
    # The full (unsharded) parameters by their original names, on every rank: parity
    # tests compare these with the single-process reference.
    full_parameters: Callable[[], dict[str, torch.Tensor]] | None = None


# name -> "module:function"; resolved on use, so that registering a strategy never
# imports every strategy module (and no module needs to import another's internals).
STRATEGIES: dict[str, str] = {
    "single": "shardlab.train:wrap_single",
    "ddp": "shardlab.ddp:wrap_ddp",
    "ddp-naive": "shardlab.ddp:wrap_ddp_naive",
    "torch-ddp": "shardlab.ddp:wrap_torch_ddp",
    "zero1": "shardlab.zero:wrap_zero1",
    "zero2": "shardlab.zero:wrap_zero2",
    "torch-zero1": "shardlab.zero:wrap_torch_zero1",
    "zero3": "shardlab.sharded:wrap_zero3",
    "fsdp2": "shardlab.fsdp:wrap_fsdp2",
    "torch-fsdp2": "shardlab.fsdp:wrap_torch_fsdp2",
}


def get_strategy(name: str) -> Callable[..., Wrapped]:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; use one of {sorted(STRATEGIES)}")
    module_name, fn_name = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module_name), fn_name)
