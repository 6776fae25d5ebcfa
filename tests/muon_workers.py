"""Workers for test_muon.py: every Muon case of one world size in one launch, and the
mistake of DeepSpeed PR #8438 rehearsed beside them."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from shardlab.config import TrainConfig
from shardlab.launch import rank_device
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.muon import ShardedMuon, watching
from shardlab.muon_runs import muon_runs
from shardlab.optimizers import WholeMatrixSpec, optimizer_spec
from shardlab.precision import get_precision
from shardlab.step import train_step
from shardlab.strategy import get_strategy
from shardlab.train import MicroBatches, build_and_wrap, loss_of


class MuonByStepShape(WholeMatrixSpec):
    """The mistake of DeepSpeed PR #8438: Muon takes the tensors that *look* 2-D among
    those the optimizer steps. Under ZeRO-3 they are flat 1-D shards, so Muon takes none
    and AdamW steps every matrix, without a word."""

    def build(self, params, places=None, group=None):
        laid = places()
        looks_2d = frozenset(p.name for p in laid if p.tensor.dim() == 2)
        return ShardedMuon(laid, design=self.design, hidden=looks_2d,
                           lr=self.kwargs["lr"], group=group)


def silent_off_calls(steps: int = 2) -> list[list[tuple[int, int]]]:
    """This rank's Newton-Schulz calls, step by step, under ZeRO-3 with the mistake."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right = optimizer_spec("muon:gather", 1e-3)
    mistaken = MuonByStepShape(right.cls, right.kwargs, design="gather")
    wrapped = get_strategy("zero3")(build_model("gpt-tiny").to(rank_device()),
                                    get_precision("fp32"), mistaken, {})
    calls = []
    with watching() as seen:
        for step in range(steps):
            before = len(seen.calls)
            x, y = get_batch(step, rank, world, 4 * world, 16)
            train_step(wrapped, [(x, y)], lambda out, y: loss_fn(out, y))
            calls.append(seen.calls[before:])
    return calls


def single_process(config: TrainConfig, grad_accum: int) -> dict:
    """`config` trained by PyTorch's Muon + AdamW in this process alone, on the whole
    global batch in `grad_accum` micro-batches (what `single` runs, here on one rank of
    the launch, so that the ranks compute the reference and its variants at once)."""
    single = replace(config, strategy="single", world=1, grad_accum=grad_accum,
                     optimizer="muon")
    device = rank_device()
    wrapped = build_and_wrap(single, 1, device)[0]
    losses = [train_step(wrapped, MicroBatches(single, step, 0, 1, device),
                         loss_of(single, step, 1)).item() for step in range(single.steps)]
    params = {k: v.detach().cpu().clone() for k, v in wrapped.full_parameters().items()}
    return {"grad_accum": grad_accum, "losses": losses, "params": params}


def muon_cases(configs: list[TrainConfig], rehearse_silent_off: bool = False) -> dict:
    """Every config on this group; then this rank's single-process run: rank 0 the
    reference (one micro-batch), rank r the same in 2**r micro-batches."""
    out = {"runs": muon_runs(configs)}
    if rehearse_silent_off:
        out["silent_off"] = silent_off_calls()
    out["single"] = single_process(configs[0], 2 ** dist.get_rank())
    return out
