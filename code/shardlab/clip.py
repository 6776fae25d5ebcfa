"""Gradient clipping across shards: one global norm from every rank's gradient elements.

`torch.nn.utils.clip_grad_norm_(params, max_norm)` scales the gradients by
min(1, max_norm / (‖g‖ + 1e-6)), where ‖g‖ is the 2-norm of *all* the model's gradients.
Under data parallelism every rank holds all of them, averaged, so its local norm is the
global one. Once gradients are sharded (ZeRO-2/3, FSDP, and ZeRO-1 after its
reduce-scatter), a rank holds 1/N of them, and

    ‖g‖² = Σ over ranks of (Σ of its own elements²)

so each rank sums the squares of its own elements and one all-reduce of that one scalar
gives every rank the same norm, hence the same scale. Two things make the count right:
each element is counted once (a rank counts only what it owns: ZeRO-1 clips after its
reduce-scatter, not the full gradient every rank holds before it; a tied weight is one
parameter), and the norm is taken over what the optimizer steps (fp32 master gradients
where the strategy keeps them, so the norm does not lose digits to bf16).

The wrong way, each rank clipping by the norm of its own shard (`local=True`), is a
mistake `shardlab.faults` shows: every rank scales by another factor, and a sharded
model drifts away from the single-process run.

Where a strategy calls it: the step hook of the optimizer that steps this rank's
gradients (`clip_before_step`), or inside ZeRO-1/2's step once its gradient shards exist.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from shardlab.measure import local_tensor

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_ and DeepSpeed: max_norm / (norm + 1e-6)


def check_clip_norm(max_norm) -> float | None:
    """None (no clipping) or a finite number > 0; refused in one line otherwise."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
            or not math.isfinite(max_norm) or max_norm <= 0:
        # 0 would zero every gradient, a negative or NaN norm would flip or poison them
        raise ValueError(f"clip_norm must be a finite number > 0 (or None: no clipping), "
                         f"got {max_norm!r}")
    return float(max_norm)


class GradClip:
    """Clip to `max_norm` by the norm over every rank's gradients.

    `sharded`: the gradients given to `clip` are this rank's share (one all-reduce of a
    scalar makes the norm global); False: every rank holds them all (no collective).
    `local`: the mistake — clip a sharded gradient by its own shard's norm.
    `norms` keeps each step's norm before clipping (what `RunReport.grad_norms` reports).
    """

    def __init__(self, max_norm: float, *, sharded: bool, group=None, local: bool = False):
        self.max_norm = check_clip_norm(max_norm)
        self.sharded = sharded
        self.group = group
        self.local = local
        self.norms: list[float] = []

    @torch.no_grad()
    def clip(self, grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
        grads = [local_tensor(g) for g in grads if g is not None]
        device = grads[0].device if grads else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            squares += g.float().square().sum()
        if self.sharded and not self.local and dist.is_initialized() \
                and dist.get_world_size(self.group) > 1:
            dist.all_reduce(squares, group=self.group)  # one scalar: 4 bytes in the ledger
        norm = squares.sqrt()
        scale = (self.max_norm / (norm + EPS)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        self.norms.append(float(norm))
        return norm


def clip_before_step(optimizer: torch.optim.Optimizer, clip: GradClip) -> GradClip:
    """Clip the gradients of what `optimizer` steps, each time before it steps."""

    def hook(opt, args, kwargs):
        clip.clip(p.grad for group in opt.param_groups for p in group["params"])

    optimizer.register_step_pre_hook(hook)
    return clip


def torch_clip_before_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                           max_norm: float) -> GradClip:
    """The references' way: PyTorch's own `clip_grad_norm_` over `params` (DTensors under
    `fully_shard`, whose norm PyTorch reduces across the mesh), before each step."""
    record = GradClip(max_norm, sharded=False)

    def hook(opt, args, kwargs):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        record.norms.append(float(norm))

    optimizer.register_step_pre_hook(hook)
    return record


__all__ = ["GradClip", "check_clip_norm", "clip_before_step", "torch_clip_before_step"]
