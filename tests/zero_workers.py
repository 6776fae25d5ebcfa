"""Workers for test_zero.py: many training cases inside one launch.

Each rank runs the course's own loop (`train.train_worker`) for a distributed strategy,
and computes the single-process reference on the whole global batch itself, in the same
process, so one launch checks many cases without paying for more process start-ups.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from shardlab.config import TrainConfig
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.optimizers import optimizer_spec
from shardlab.precision import MasterWeightOptimizer, get_precision
from shardlab.step import train_step
from shardlab.strategy import Wrapped, cast_model
from shardlab.train import train_worker


def decay_groups(model: nn.Module) -> list[dict]:
    """nanoGPT's groups: weight decay (and a smaller lr) on matrices, none on the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0,
             "lr": 3e-3}]


def reference(config: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`config` trained by one process on the whole global batch: losses, parameters."""
    torch.manual_seed(config.seed)
    precision = get_precision(config.precision)
    model = cast_model(build_model(config.model, config.seed, config.model_config), precision)
    spec = optimizer_spec(config.optimizer, config.lr)
    groups = config.options.get("param_groups")
    params = groups(model) if groups else [p for p in model.parameters() if p.requires_grad]
    optimizer = (MasterWeightOptimizer(params, spec.cls, **spec.kwargs)
                 if precision.master_weights else spec.build(params))
    plain, accum, losses = Wrapped(model, optimizer), config.grad_accum, []
    for step in range(config.steps):
        micro_batches = [get_batch(step, 0, 1, config.batch_size, config.seq_len,
                                   config.seed, micro, accum) for micro in range(accum)]
        loss = train_step(plain, micro_batches, lambda output, y: loss_fn(output, y) / accum)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def zero_cases(cases: list[TrainConfig]) -> dict:
    """Everything test_zero.py runs on ranks, in one launch per world size."""
    return {"parity": parity_cases(cases), "by_hand": built_by_hand(),
            "refusal": refuses_different_models()}


def parity_cases(cases: list[TrainConfig]) -> list[dict]:
    """Train every case on this group; compare with the single-process reference."""
    world = dist.get_world_size()
    out = []
    for config in cases:
        config = replace(config, world=world, keep_params=True)
        report = train_worker(config)
        ref_losses, ref_params = reference(config)
        assert report.params.keys() == ref_params.keys()
        out.append({**compared(config, report, ref_losses, ref_params),
                    "bucket_numel": config.options.get("bucket_numel"),
                    "groups": "param_groups" in config.options,
                    "collective": config.options.get("gradient_collective",
                                                     "reduce-scatter")})
    return out


def compared(config: TrainConfig, report, ref_losses, ref_params) -> dict:
    """A distributed run beside the single-process reference: what the parity tests read."""
    return {
        "strategy": config.strategy, "model": config.model, "precision": config.precision,
        "optimizer": config.optimizer, "grad_accum": config.grad_accum,
        "losses": report.losses, "ref_losses": ref_losses,
        "loss_diff": max(abs(a - b) for a, b in zip(report.losses, ref_losses)),
        "param_diff": max((report.params[k].float() - ref_params[k].float()).abs().max()
                          .item() for k in ref_params),
        "param_scale": max(v.float().abs().max().item() for v in ref_params.values()),
        "psi": report.psi, "state_bytes": report.state_bytes, "peak": report.peak,
        "ledger": [(r.op, str(r.dtype), r.logical_bytes, r.step) for r in report.ledger],
    }


def refuses_different_models() -> str:
    """Build a model that differs on rank 1; the wrapper must refuse it on every rank."""
    from shardlab.strategy import get_strategy
    model = build_model("toy-tied", seed=dist.get_rank() == 1)
    try:
        get_strategy("zero2")(model, get_precision("fp32"), optimizer_spec("adamw", 1e-3), {})
    except ValueError as exc:
        return str(exc)
    return "accepted"


def built_by_hand(steps: int = 5) -> dict:
    """`ZeroOptimizer(params, torch.optim.AdamW, stage=s)` as outside code builds it, in the
    plain loop with no strategy around it, beside one process's AdamW on the whole batch:
    each stage's largest parameter difference after `steps` steps, and the class of its
    gradients' reducer; stage 1 also with its all-gather overlapped ("1-overlapped")."""
    from shardlab.zero import ZeroOptimizer
    rank, world = dist.get_rank(), dist.get_world_size()
    adamw = {"lr": 1e-3, "weight_decay": 0.1}
    out = {}
    for stage, overlap in ((1, False), (2, False), (1, True)):
        model = build_model("gpt-tiny", seed=0)
        single = copy.deepcopy(model)
        ours = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                             overlap_all_gather=overlap, module=model, **adamw)
        theirs = torch.optim.AdamW(single.parameters(), **adamw)
        freed = []
        for step in range(steps):
            x, y = get_batch(step, rank, world, 12, 16)
            loss_fn(model(x), y).backward()
            ours.step()
            freed.append(all(p.grad is None for p in model.parameters()))
            # every other step, zeroed the way a model is: stage 1 then finds .grad
            # tensors of backward's own, over a flat buffer the step used as scratch;
            # stage 2's gradient is the optimizer's shard, which its step zeroed
            ours.zero_grad() if step % 2 == 0 else model.zero_grad()
            x, y = get_batch(step, 0, 1, 12, 16)
            loss_fn(single(x), y).backward()
            theirs.step()
            theirs.zero_grad()
        ours.wait_for_params()
        out["1-overlapped" if overlap else stage] = {
            "reducer": type(ours.reducer).__name__, "freed_by_step": freed,
            "param_diff": max((p - q).abs().max().item()
                              for p, q in zip(model.parameters(), single.parameters())),
            "moved": max((p - q).abs().max().item() for p, q in
                         zip(model.parameters(), build_model("gpt-tiny", seed=0).parameters())),
        }
    return out
