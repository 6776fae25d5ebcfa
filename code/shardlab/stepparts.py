"""The parts of a step the plain model (6ΨT over F, collectives by their α-β fit alone)
leaves out, each measured on this machine by a micro-benchmark of its own: the optimizer as
the strategy lays out what a rank steps, and a collective as it costs inside a step.

AdamW does not cost a fixed time per parameter. On a CPU, and for PyTorch's `DTensor` on
any device, `torch.optim.AdamW` runs its per-tensor loop (`_single_tensor_adamw`): it
takes the `foreach` path only for plain tensors on the devices
`torch.utils._foreach_utils._get_foreach_kernels_supported_devices()` names (CUDA, not the
CPU; `_default_to_fused_or_foreach` in `torch/optim/optimizer.py`). Each tensor then pays
a dozen small kernels' dispatch whatever its size, and a `DTensor` pays its dispatch on
top. So the same Ψ/N elements cost differently as one flat shard (`zero1`, `zero2`), a
flat shard per unit (`zero3`), a dim-0 shard of every parameter (`fsdp2`, and as DTensors
`torch-fsdp2`), the whole parameters a rank owns (`torch-zero1`) or every parameter whole
(DDP):

    optimizer = elements x e  +  tensors x t  (+ DTensors x d)

with e, t and d measured on this machine by `optimizer_costs` (AdamW over one flat tensor,
over the same elements cut in many, and over those pieces as DTensors), never fitted to a
step. The layout is the card's (`StrategyCard.optimizer_layout`); `stepped_tensors` lists
each rank's tensors by it (tests/test_stepparts.py checks the lists against the
optimizers the strategies build). The step waits for the slowest rank: the rank whose
tensors cost most.

A collective inside a step is not the collective the α-β fit timed alone, with every rank
idle and released by a barrier. Inside a step each rank reaches it when its own compute
ends, so the first to arrive waits for the last (the arrival skew the run report measures
as idle time), and on a CPU gloo's copies take turns on the cores with whatever the other
ranks still compute. `collective_costs_in_step` times each kind of collective so: from
its call to its return, right after each rank's own matmuls, with no barrier between, at
two sizes, and draws a line through them (seconds a call, seconds per byte). The time
model prices each collective of a step by its kind's line (`Machine.in_step`). The kinds
are timed as the backend runs them, so gloo's binomial-tree broadcast and its
reduce-scatter (an all-reduce inside) need no rule of their own.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from shardlab.cards import CARDS
from shardlab.wrap import unit_modules


def _whole(params, model, world):
    """Every parameter whole, on every rank (DDP)."""
    return [[p.numel() for p in params]] * world


def _flat_shard(params, model, world):
    """One flat 1/N of all the parameters (ZeRO-1/2's flat buffer)."""
    return [[math.ceil(sum(p.numel() for p in params) / world)]] * world


def _unit_flat_shards(params, model, world):
    """One flat 1/N of each unit's parameters (the course's ZeRO-3, like FSDP1)."""
    trainable, seen, out = {id(p) for p in params}, set(), []
    for unit in unit_modules(model, "auto"):
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen |= {id(p) for p in own}
        numel = sum(p.numel() for p in own if id(p) in trainable)
        if numel:
            out.append(math.ceil(numel / world))
    return [out] * world


def _dim0_shards(params, model, world):
    """Each parameter's dim-0 shard (FSDP2): rank 0's, the largest, ceil(rows/N) rows."""
    return [[math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) if p.dim() else 1
             for p in params]] * world


def _owned_parameters(params, model, world):
    """Whole parameters, each owned by one rank: PyTorch's ZeroRedundancyOptimizer sorts
    them by size, largest first, and gives each to the rank holding the fewest elements
    (`_partition_parameters` in torch/distributed/optim/zero_redundancy_optimizer.py)."""
    ranks, sizes = [[] for _ in range(world)], [0] * world
    for numel in sorted((p.numel() for p in params), reverse=True):
        rank = sizes.index(min(sizes))
        ranks[rank].append(numel)
        sizes[rank] += numel
    return ranks


# optimizer_layout on a card -> (rule, whether the tensors are DTensors)
LAYOUTS: dict[str, tuple[Callable, bool]] = {
    "whole": (_whole, False),
    "flat-shard": (_flat_shard, False),
    "unit-flat-shards": (_unit_flat_shards, False),
    "dim0-shards": (_dim0_shards, False),
    "dim0-dtensors": (_dim0_shards, True),
    "owned-parameters": (_owned_parameters, False),
}


def stepped_tensors(strategy: str, model: nn.Module, world: int) -> list[list[int]]:
    """The elements of each tensor each rank's optimizer steps, rank by rank, as the
    strategy's card lays them out (`optimizer_layout`)."""
    layout = CARDS[strategy].optimizer_layout if strategy in CARDS else None
    if layout not in LAYOUTS:
        raise ValueError(f"strategy {strategy!r} has no optimizer layout; use one of "
                         f"{sorted(n for n, c in CARDS.items() if c.optimizer_layout)}")
    params = [p for p in model.parameters() if p.requires_grad]
    return LAYOUTS[layout][0](params, model, max(1, world))


@dataclass(frozen=True)
class OptimizerCosts:
    """AdamW on this machine: seconds per element, per tensor, and per DTensor on top."""

    per_element: float
    per_tensor: float = 0.0
    per_dtensor: float = 0.0


def optimizer_seconds(strategy: str, model: nn.Module, world: int,
                      costs: OptimizerCosts) -> float:
    """Seconds of the optimizer step on the slowest rank, by the strategy's layout."""
    dtensors = LAYOUTS[CARDS[strategy].optimizer_layout][1]
    per_tensor = costs.per_tensor + (costs.per_dtensor if dtensors else 0.0)
    return max(sum(rank) * costs.per_element + len(rank) * per_tensor
               for rank in stepped_tensors(strategy, model, world))


def median_seconds(run, repeats: int) -> float:
    """The median of `repeats` timings of `run()`, in seconds (the micro-benchmarks' one
    way to time: a median, so that one noisy moment of a shared machine does not count)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _adamw_step(params: list[torch.Tensor], device: torch.device) -> Callable[[], None]:
    """One AdamW step over `params`, warmed up (the moments exist)."""
    params = [nn.Parameter(p) for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step():
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # warm-up: creates the moments
    return step


def optimizer_costs(numel: int = 1 << 18, pieces: int = 64, repeats: int = 7,
                    device: torch.device | str = "cpu", mesh=None) -> OptimizerCosts:
    """AdamW's costs on this machine: `numel` elements as one tensor give e; the same
    elements as `pieces` tensors give t, what each tensor adds; and, given a 1-D device
    `mesh`, the pieces as DTensors sharded on it give d, what a DTensor adds on top
    (run it on every rank of the mesh). The three steps are timed in turn, `repeats`
    times, and each cost is the median of its differences: a noisy moment on a shared
    machine then hits the three alike."""
    device = torch.device(device)
    size = numel // pieces
    layouts = [[torch.zeros(numel, device=device)],
               [torch.zeros(size, device=device) for _ in range(pieces)]]
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor
        layouts.append([distribute_tensor(torch.zeros(size * mesh.size(), device=device),
                                          mesh, [Shard(0)]) for _ in range(pieces)])
    steps = [_adamw_step(params, device) for params in layouts]
    times = [[median_seconds(step, 1) for step in steps] for _ in range(repeats)]
    per_element = statistics.median(t[0] for t in times) / numel
    per_tensor = max(0.0, statistics.median((t[1] - t[0]) / (pieces - 1) for t in times))
    per_dtensor = (max(0.0, statistics.median((t[2] - t[1]) / pieces for t in times))
                   if mesh is not None else 0.0)
    return OptimizerCosts(per_element, per_tensor, per_dtensor)


@dataclass(frozen=True)
class InStepCost:
    """One kind of collective as it costs inside a step on this machine: `fixed` seconds
    a call, plus `per_byte` seconds per byte of the whole tensor (what the ledger records
    as a collective's logical bytes)."""

    fixed: float
    per_byte: float

    def seconds(self, nbytes: float) -> float:
        return self.fixed + nbytes * self.per_byte


def collective_costs_in_step(collectives: dict[str, Callable[[torch.Tensor], None]],
                             sizes: tuple[int, int] = (1 << 12, 1 << 22), repeats: int = 7,
                             device: torch.device | str = "cpu") -> dict[str, InStepCost]:
    """Run on every rank of the default group: each collective of `collectives` ({kind:
    how to run it on a flat fp32 tensor}) timed as a step meets it, at two sizes in bytes,
    and a line through the two: its fixed cost a call and its cost per byte.

    As a step meets it: each rank first runs its own matmuls (about as long as the
    collective alone, the same work on every rank), then calls the collective at once, no
    barrier between, and the time runs from the call to its return. It so includes what
    the α-β fit of collectives alone leaves out: waiting for the ranks that arrive later,
    and, on a CPU, gloo's copies taking turns on the cores with what the others still
    compute. Each kind is measured as the backend runs it (gloo's broadcast is a binomial
    tree, its reduce-scatter an all-reduce: no rule needed). Each size's figure is the
    median of `repeats`, averaged over the ranks so that every rank returns the same."""
    import torch.distributed as dist
    device = torch.device(device)
    world = dist.get_world_size()
    a = torch.randn(128, 128, device=device)

    def done():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    one_matmul = max(median_seconds(lambda: (a @ a, done()), 3), 1e-6)
    # each (kind, size): its tensor and the matmuls that come before it (about as long as
    # the collective alone)
    cases = []
    for run in collectives.values():
        for nbytes in sizes:
            x = torch.ones(max(world, nbytes // 4 // world * world), device=device)
            run(x)  # warm-up: the first use of a size allocates and connects
            dist.barrier()
            alone = median_seconds(lambda: (run(x), done()), 3)
            cases.append((run, x, max(1, int(alone / one_matmul))))
    # timed in turn, a round at a time, so that a noisy moment hits every case alike
    times = [[] for _ in cases]
    for _ in range(repeats):
        for (run, x, matmuls), timed in zip(cases, times):
            dist.barrier()
            for _ in range(matmuls):
                a @ a
            done()
            timed.append(median_seconds(lambda: (run(x), done()), 1))
    figures = [statistics.median(timed) for timed in times]
    mean = torch.tensor(figures, dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    mean = (mean / world).tolist()
    costs = {}
    for i, kind in enumerate(collectives):
        small, large = mean[2 * i], mean[2 * i + 1]
        per_byte = max(0.0, (large - small) / (sizes[1] - sizes[0]))
        costs[kind] = InStepCost(max(0.0, small - per_byte * sizes[0]), per_byte)
    return costs
