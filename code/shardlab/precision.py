"""Training precisions, and the optimizer wrapper that keeps fp32 master weights.

The 16 bytes per parameter of mixed-precision AdamW are only real if a run holds them:

    bf16 parameter (2) + bf16 gradient (2) + fp32 master copy (4) + fp32 Adam m and v (8)

So in the "bf16-mixed" recipe the *model* is cast to bf16 (forward and backward run in
bf16 and produce bf16 gradients) and `MasterWeightOptimizer` keeps an fp32 copy of every
parameter, lets the real optimizer (AdamW, SGD, ...) step that copy with the gradient
upcast to fp32, and writes the result back into the bf16 parameter. "bf16" has no master
copy: the optimizer steps bf16 parameters directly (its states are then bf16 as well).

Every strategy uses these names, and `shardlab.memory` predicts bytes for the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype
    master_weights: bool  # fp32 copy of each parameter held by the optimizer


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32, master_weights=False),
    "bf16-mixed": Precision("bf16-mixed", torch.bfloat16, master_weights=True),
    "bf16": Precision("bf16", torch.bfloat16, master_weights=False),
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; use one of {sorted(PRECISIONS)}") from None


class InnerOptimizerFace:
    """The `torch.optim` face (`param_groups`, `state`) of a class that steps an inner
    optimizer, `self.optimizer`, over tensors of its own: fp32 master copies here, flat
    shards in ZeRO. Schedulers and readers of the learning rate see the inner groups."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state


class MasterWeightOptimizer(InnerOptimizerFace):
    """Step low-precision parameters through fp32 master copies.

    `params` may be a list of tensors or of parameter groups (dicts), as for any
    `torch.optim` optimizer; `optimizer_class(master_groups, **kwargs)` is built over the
    fp32 copies, so its states (Adam's m and v) are fp32 too.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 **kwargs: Any):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        master_groups = []
        for group in groups:
            masters = []
            for p in group["params"]:
                master = p.detach().to(torch.float32).clone().requires_grad_(p.requires_grad)
                self.pairs.append((p, master))
                masters.append(master)
            master_groups.append({**group, "params": masters})
        self.optimizer = optimizer_class(master_groups, **kwargs)

    def master_tensors(self) -> list[torch.Tensor]:
        return [m for _, m in self.pairs]

    @torch.no_grad()
    def step(self) -> None:
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.optimizer.step()
        for p, master in self.pairs:
            p.copy_(master)
            master.grad = None  # the upcast gradient is a temporary, not persistent state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, _ in self.pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
