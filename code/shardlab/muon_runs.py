"""Muon's runs on N ranks, each design beside its predictions: the worker of the chapter
"When the optimizer needs the whole matrix" and of its tests.

`muon_runs(configs)` trains each config (a `TrainConfig` whose optimizer is "muon" or
"muon:<design>") on every rank of one launch, the course's loop step for step, and
reports what a whole-matrix optimizer changes: the Newton-Schulz calls this rank made
(their shapes and seconds), the bytes Muon's exchanges sent (the ledger's records of
Muon's own process group) and the gathered matrices it held at the most, each beside
what `shardlab.comm.whole_matrix` and `shardlab.memory.whole_matrix` predict from the
strategy's places. Several configs share one launch: a launch costs seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardlab.comm.ledger import Ledger
from shardlab.comm.whole_matrix import muon_sent_bytes
from shardlab.config import TrainConfig
from shardlab.launch.devices import rank_device
from shardlab.memory.whole_matrix import muon_gathered_bytes
from shardlab.muon import ShardedMuon, newton_schulz_flops, watching
from shardlab.optimizers import inner_optimizer
from shardlab.step import train_step
from shardlab.train import (MicroBatches, build_and_wrap, global_losses, loss_of,
                            rank_and_world)


@dataclass
class MuonRun:
    """One rank's run of one config. Bytes and calls are per step (the mean over the
    steps; every step is the same); `params` the full parameters after the last step."""

    strategy: str
    optimizer: str
    design: str
    world: int
    rank: int
    grad_accum: int
    losses: list[float]
    params: dict[str, torch.Tensor]
    hidden: int                    # the model's hidden matrices (Muon's)
    calls: list[list[tuple[int, int]]]  # this rank's Newton-Schulz calls, step by step
    seconds: float                 # in Newton-Schulz, per step
    flops: int                     # of this rank's Newton-Schulz calls, per step
    sent: int                      # bytes of Muon's exchanges this rank sent, per step
    held: int                      # peak bytes of gathered matrices
    strategy_sent: int             # bytes of the strategy's own collectives, per step
    predicted: dict[str, int] = field(default_factory=dict)  # sent, held, calls, flops


def muon_runs(configs: list[TrainConfig]) -> list[MuonRun]:
    """Worker: each config trained on this rank (see the module's docstring)."""
    return [muon_run(c) for c in configs]


def muon_run(config: TrainConfig) -> MuonRun:
    config.validate()
    rank, world = rank_and_world(config)
    device = rank_device()
    wrapped = build_and_wrap(config, world, device)[0]
    local_losses, calls = [], []
    with watching() as seen, Ledger() as ledger:
        for step in range(config.steps):
            before = len(seen.calls)
            local_losses.append(train_step(
                wrapped, MicroBatches(config, step, rank, world, device),
                loss_of(config, step, world)))
            ledger.mark_step()
            calls.append(seen.calls[before:])
    losses = global_losses(local_losses, world, device)
    params = {k: v.detach().cpu().clone() for k, v in wrapped.full_parameters().items()}
    mine = [r for r in ledger.records if r.group in seen.groups]
    others = [r for r in ledger.records if r.group not in seen.groups]
    optimizer = inner_optimizer(wrapped.optimizer)
    design = getattr(optimizer, "design", "whole")
    steps = config.steps
    return MuonRun(
        config.strategy, config.optimizer, design, world, rank, config.grad_accum, losses,
        params, hidden=_hidden_count(wrapped),
        calls=calls, seconds=seen.seconds / steps,
        flops=seen.flops // steps, sent=sum(r.sent_bytes for r in mine) // steps,
        held=seen.held_peak, strategy_sent=sum(r.sent_bytes for r in others) // steps,
        predicted=predict(optimizer, rank) if isinstance(optimizer, ShardedMuon) else {})


def predict(optimizer: ShardedMuon, rank: int) -> dict[str, int]:
    """What the formulas say this rank sends, holds and computes per step, from the
    places the strategy handed the optimizer."""
    matrices = optimizer.matrices
    owners = [optimizer.owners.get(p.name) for p in matrices]
    world, design = optimizer.world, optimizer.design
    computed = [p for p, o in zip(matrices, owners) if design == "gather" or o == rank]
    return {
        "sent": muon_sent_bytes(design, [p.ranges for p in matrices], world, rank, owners),
        "held": muon_gathered_bytes(design, [(p.shape, p.ranges) for p in matrices],
                                    world, rank, owners),
        "calls": len(computed),
        "flops": sum(newton_schulz_flops(tuple(p.shape)) for p in computed),
    }


def _hidden_count(wrapped) -> int:
    optimizer = inner_optimizer(wrapped.optimizer)
    if isinstance(optimizer, ShardedMuon):
        return len(optimizer.matrices)
    return sum(len(g["params"]) for g in optimizer.param_groups if "ns_steps" in g)
