"""Probes of what a step costs beyond the model, its optimizer and its collectives, for
the step-time model (`shardlab.steptime`), run on every rank by
`workers.measure_machine`: each strategy's own work (`strategy_work`) and the training
loop's (`loop_costs`). Each is measured on probes, never on the models or the runs the
model predicts: a probe's figure is a difference of two of its own timings, so that what
the model prices elsewhere (matmuls, AdamW, the collectives' lines) cancels out."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from shardlab.cards import card
from shardlab.comm.ledger import Ledger
from shardlab.config import TrainConfig
from shardlab.launch.devices import rank_device
from shardlab.loop_concerns import Measurement
from shardlab.models import loss_fn
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import get_precision
from shardlab.step import train_step
from shardlab.stepparts import median_seconds
from shardlab.plans import planned_collectives
from shardlab.steptime import collective_seconds_on_machine, with_overlap_decided
from shardlab.strategy import get_strategy
from shardlab.train import MicroBatches, loss_of


# two probes of the strategies' own work: Linear layers of this width, this many of them;
# and for a strategy of units, the larger cut in this many units
PROBE_WIDTH, PROBE_LAYERS, PROBE_UNITS = 8, (8, 40), 8


class ProbeUnit(nn.Sequential):
    """Some of a probe's Linear layers, one unit of a strategy of units."""


def strategy_work(strategies: list[str], machine, rows: int = 8,
                  repeats: int = 5) -> tuple[dict, dict]:
    """Run on every rank: each strategy's own work in a step, in seconds, per parameter
    tensor and, for a strategy of units, per unit: what its step costs beyond the model's
    forward and backward, its optimizer and its collectives as `machine` prices them
    (hooks, copies into and out of buckets and flat buffers, views, DTensor's dispatch
    under PyTorch's `fully_shard`, zeroing; and what a unit's gathers and reduce-scatters
    cost beyond their lines, coming one after another in a step).

    Measured on probes, never on the models it will predict: stacks of PROBE_LAYERS
    Linear layers of PROBE_WIDTH features, whose matmuls and bytes are negligible. Per
    tensor: the two stacks in one unit (`wrap="model"`), so that both launch the same
    collectives (PyTorch's ZeRO-1 aside: it broadcasts each parameter, and the model prices
    those); each stack's step under the strategy, less its bare forward, backward and SGD
    step and less its collectives, is the strategy's work on it, and the difference over
    the difference in parameter tensors is the work per tensor. Per unit: the larger stack
    cut in PROBE_UNITS units against the same in one, the difference over the units added.
    The steps are timed in turn, a round at a time, the median of the rounds; the ranks'
    mean, per tensor at least 0. A unit's figure keeps its sign: it is what a unit adds
    beyond its collectives' lines, and where a step's collectives, coming one after
    another, cost less than those lines say (ranks already together), it is below 0.
    Returns ({strategy: per tensor}, {strategy: per unit})."""
    if not strategies:
        return {}, {}
    device, world = rank_device(), dist.get_world_size()
    sgd = OptimizerSpec(torch.optim.SGD, {"lr": 0.0})
    x = torch.randn(rows, PROBE_WIDTH, device=device)
    y = torch.zeros(rows, dtype=torch.long, device=device)
    small, large = PROBE_LAYERS

    def probe(layers: int, units: int = 1) -> nn.Module:
        linears = [nn.Linear(PROBE_WIDTH, PROBE_WIDTH) for _ in range(layers)]
        if units == 1:
            return nn.Sequential(*linears).to(device)
        per = layers // units
        return nn.Sequential(*(ProbeUnit(*linears[u * per:(u + 1) * per])
                               for u in range(units))).to(device)

    def bare(layers: int):
        model = probe(layers)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        return lambda: (loss_fn(model(x), y).backward(), opt.step(), opt.zero_grad())

    def under(name: str, model: nn.Module, options: dict):
        wrapped = get_strategy(name)(model, get_precision("fp32"), sgd, options)
        return lambda: train_step(wrapped, [(x, y)])

    def collectives(name: str, model: nn.Module, options: dict) -> float:
        decided = with_overlap_decided(name, options, dist.get_backend())
        return sum(collective_seconds_on_machine(op, nbytes, world, machine)
                   for op, nbytes in planned_collectives(name, model, world, decided))

    per_tensor, per_unit = [], []
    for name in strategies:
        units = card(name).takes_units
        one_unit = {"wrap": "model"} if units else {}
        # (step, its bare counterpart, what its collectives cost by the machine's lines)
        cases = [(under(name, probe(layers), one_unit), bare(layers),
                  collectives(name, probe(layers), one_unit)) for layers in PROBE_LAYERS]
        if units:
            cut = {"wrap": (ProbeUnit,)}
            cases.append((under(name, probe(large, PROBE_UNITS), cut), bare(large),
                          collectives(name, probe(large, PROBE_UNITS), cut)))
        for step, plain, _ in cases:
            for run in (step, step, plain):  # warm-up: buffers, moments, connections
                run()
        rounds = []
        for _ in range(repeats):
            own = []
            for step, plain, comm_seconds in cases:
                dist.barrier()
                t = median_seconds(step, 1)
                dist.barrier()
                own.append(t - median_seconds(plain, 1) - comm_seconds)
            rounds.append(own)
        own = [statistics.median(r[i] for r in rounds) for i in range(len(cases))]
        per_tensor.append((own[1] - own[0]) / (2 * (large - small)))  # weight and bias
        per_unit.append((own[2] - own[1]) / PROBE_UNITS if units else 0.0)
    mean = torch.tensor(per_tensor + per_unit, dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    mean = [w / world for w in mean.tolist()]
    n = len(strategies)
    # a unit's figure keeps its sign: where a step's collectives, one after another, cost
    # less than their lines (timed each after compute) say, a unit adds less than them
    return ({name: max(0.0, w) for name, w in zip(strategies, mean[:n])},
            {name: w for name, w in zip(strategies, mean[n:]) if card(name).takes_units})


@dataclass(frozen=True)
class LoopCosts:
    """What the training loop (`train.train_rank`) adds to a step, in seconds: `per_step`,
    its own work around the step (the step's clock and phases, reading the batch, the
    loss's scale); `per_collective`, what its ledger adds to each collective it records
    (a Python kernel a call, a record, a callback when the work completes)."""

    per_step: float
    per_collective: float


class ByteModel(nn.Sequential):
    """The loop probe's model: the course's batches (bytes) in, next-byte logits out, so
    small that its forward and backward cost next to nothing."""

    def __init__(self, width: int = 4):
        super().__init__(nn.Embedding(256, width), nn.Linear(width, 256))


def loop_costs(config: TrainConfig, repeats: int = 5, calls: int = 20) -> LoopCosts:
    """Run on every rank of the default group: `LoopCosts` of the loop that trains `config`
    (its batch size, sequence length, micro-batches and ledger), on this machine.

    Per step: the loop's step of a `ByteModel` (under the loop's `Measurement`, its batch
    read by `MicroBatches`, its loss scaled by `loss_of`) less the same model's bare
    `train_step` on a batch already read. Per collective: a small all-reduce, waited, with
    a ledger open less the same without one, each the median of `calls` timed calls, every
    rank at once, each in a group of its own (what the ledger does a call, without one
    rank's wait for another). Each
    is timed in turn, `repeats` rounds, a barrier before each; the median of the rounds'
    differences, the ranks' mean, at least 0 (0 per collective when `config` records no
    ledger)."""
    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    config = replace(config, world=world, measure_memory=False, memory_limit=None,
                     profile_dir=None)
    wrapped = get_strategy("single")(ByteModel().to(device), get_precision("fp32"),
                                     OptimizerSpec(torch.optim.SGD, {"lr": 0.0}), {})
    batch = MicroBatches(config, 0, rank, world, device)
    ready = [batch[i] for i in range(len(batch))]
    # the loop's step without its ledger: the step records no collective, and a ledger
    # open around the probe would record the all-reduces timed without one below
    measured = Measurement(replace(config, record_ledger=False), wrapped, 0, rank, device,
                           None)
    x = torch.ones(16, device=device)

    def looped():
        with measured.step(0) as watch:
            train_step(wrapped, MicroBatches(config, 0, rank, world, device),
                       loss_of(config, 0, world), watch)
        measured.mark_step(0)

    def bare():
        train_step(wrapped, ready)

    # each rank all-reduces in a group of its own: the ledger records those calls like any
    # other, and no rank waits for another to be scheduled (on ranks sharing cores that
    # wait, not the ledger, would decide the difference)
    alone = [dist.new_group([r]) for r in range(world)][rank]

    def all_reduce():
        dist.all_reduce(x, group=alone, async_op=True).wait()

    def one_call(ledgered: bool) -> float:
        """The median of `calls` all-reduces, each timed: one slow call (a rank the
        scheduler ran late) does not move it."""
        if not ledgered:
            return median_seconds(all_reduce, calls)
        with Ledger():
            return median_seconds(all_reduce, calls)

    for run in (looped, bare, all_reduce):  # warm-up: buffers, connections
        run()
    one_call(True)  # and the ledger's kernels
    rounds = []
    for _ in range(repeats):
        timed = []
        for run in (looped, bare):
            dist.barrier()
            timed.append(median_seconds(run, 1))
        if config.record_ledger:
            for ledgered in (True, False):
                dist.barrier()
                timed.append(one_call(ledgered))
        rounds.append(timed)
    per_step = statistics.median(r[0] - r[1] for r in rounds)
    per_call = (statistics.median(r[2] - r[3] for r in rounds)
                if config.record_ledger else 0.0)
    mean = torch.tensor([per_step, per_call], dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    per_step, per_call = (max(0.0, v / world) for v in mean.tolist())
    return LoopCosts(per_step, per_call)
