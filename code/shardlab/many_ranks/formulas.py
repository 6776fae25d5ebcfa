"""What one rank holds and sends per step at any N, padding included, as formulas.

The course's formulas assume N divides whatever is cut: (2 + 2 + K)Ψ/N of model states
under ZeRO-3, 3Ψ(N-1)/N bytes sent (`shardlab.memory.model_states`,
`shardlab.comm.volume_per_rank`). The layouts cut whole elements, so where N does not
divide, they pad, in three places:

    a flat buffer (ZeRO-1/2's buckets, ZeRO-3's units) of n elements: ⌈n/N⌉ a rank
    a parameter split on dim 0 (FSDP2) of d0 rows: ⌈d0/N⌉ rows a rank, on every rank
    a ring collective of n elements: N-1 rounds of one ⌈n/N⌉ chunk

`predicted(strategy, model, world)` adds those terms up from the model's parameter
shapes (a model on the meta device will do), the units of its wrap policy
(`shardlab.wrap`) and the bucket rule (`shardlab.buckets`); `ideal(...)` is the course's
formula, Ψ/N with nothing padded. Their ratio is what padding costs, which grows with N:
past N = d0 every rank holds one padded row of a dim-0 split, whatever d0 is.

fp32 AdamW, the recipe the measurements run: 4 bytes a parameter, 4 a gradient, K = 8
(m and v), plus Adam's step counter, one fp32 scalar per tensor it steps (4 bytes each,
which the ZeRO paper's K leaves out). Per strategy, per rank:

    ddp     params Ψ·4, grads Ψ·4, optimizer 8Ψ + 4P        sent Σ_bucket 2(N-1)⌈n/N⌉·4
    zero1   params and grads N⌈n/N⌉·4 per bucket (one padded flat buffer each),
            optimizer 8⌈n/N⌉ + 4 per bucket                  sent Σ_bucket 2(N-1)⌈n/N⌉·4
    zero2   as zero1, gradients ⌈n/N⌉·4 per bucket
    zero3   per unit, its trainable (and frozen) elements in a padded flat buffer:
            params ⌈n/N⌉·4, grads ⌈n/N⌉·4, optimizer 8⌈n/N⌉ + 4
            sent 3(N-1)⌈n/N⌉·4 (two all-gathers, one reduce-scatter)
    fsdp2   per parameter s = ⌈d0/N⌉·(d1·d2...): params s·4, grads s·4, optimizer 8s + 4
            (the course's FSDP2 pads Adam's states too); per unit
            sent 3(N-1)·Σs·4
    hsdp    fsdp2 over the S ranks of a shard group (link "intra-node"), and per unit an
            all-reduce of the reduced shard X = Σs over the R = N/S replicas
            ("inter-node"): 2(R-1)⌈X/R⌉·4

(P: the parameter tensors stepped; Ψ counts a tied weight once. A frozen parameter is
held whole below stage 3, as a padded shard beside the trainable ones at stage 3, and
neither stepped nor reduced. Every trainable parameter is taken to get a gradient: one
that no forward uses has no Adam state under DDP, which the shapes cannot tell.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from shardlab.buckets import DEFAULT_BUCKET_MB, fill_in_backward_order
from shardlab.comm.links import INTER, INTRA
from shardlab.comm.volumes import hsdp_volume_per_link, volume_per_rank
from shardlab.memory.states import model_states
from shardlab.units import MiB
from shardlab.wrap import unit_modules

PARAM, GRAD, ADAM = 4, 4, 8  # fp32 AdamW: bytes per element of each kind of state
STEP_COUNTER = 4             # Adam's `step`: one fp32 scalar per tensor it steps
ALL = "all"                  # the link of a strategy with one process group
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "hsdp")
ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}


@dataclass(frozen=True)
class RankBytes:
    """One rank's model states between steps (bytes of parameters, gradients, optimizer
    states) and the bytes it sends in one step, by link."""

    params: float
    grads: float
    optimizer: float                    # Adam's step counters included
    sent: dict[str, float] = field(default_factory=dict)
    counters: float = 0                 # of which Adam's step counters: no padding

    @property
    def held(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def sent_total(self) -> float:
        return sum(self.sent.values())

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "held": self.held, "sent": self.sent_total}


def chunk(n: int, world: int) -> int:
    """A rank's chunk of n elements cut N ways, padded: ⌈n/N⌉."""
    return -(-n // world)


def rows_chunk(shape, world: int) -> int:
    """A rank's elements of a parameter split on dim 0, padded: ⌈d0/N⌉ rows."""
    shape = tuple(shape) or (1,)
    return chunk(shape[0], world) * math.prod(shape[1:])


def ring_sent(op: str, n: int, world: int, elem: int = 4) -> int:
    """Bytes a rank sends in a ring collective of n elements: N-1 chunks of ⌈n/N⌉ for a
    reduce-scatter or an all-gather, twice that for an all-reduce."""
    rounds = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}[op] * (world - 1)
    return rounds * chunk(n, world) * elem if n else 0


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer steps: trainable, a tied one once."""
    return [p for p in model.parameters() if p.requires_grad]


def psi(model: nn.Module) -> int:
    """Ψ: trainable elements, a tied weight once."""
    return sum(p.numel() for p in trainable(model))


def bucket_numels(model: nn.Module, first_bucket_mb: float | None,
                  bucket_mb: float = DEFAULT_BUCKET_MB) -> list[int]:
    """The elements of each gradient bucket, cut as DDP and ZeRO cut them."""
    first = None if first_bucket_mb is None else first_bucket_mb * MiB
    return [sum(p.numel() for p in bucket)
            for bucket in fill_in_backward_order(trainable(model), bucket_mb * MiB, first)]


def units(model: nn.Module, policy="auto") -> list[list[nn.Parameter]]:
    """The parameters of each unit of the wrap policy, inner units first, the root last
    (what no inner unit took), each parameter once."""
    seen: set[int] = set()
    out = []
    for module in unit_modules(model, policy):
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        out.append(params)
    return [u for u in out if u]


def _flat_buckets(model: nn.Module, world: int, stage: int, options: dict) -> RankBytes:
    first = options.get("first_bucket_mb") if stage == 0 else None
    sizes = bucket_numels(model, first,
                          options.get("bucket_mb", DEFAULT_BUCKET_MB))
    sent = sum(ring_sent("all_reduce", n, world) for n in sizes)  # RS + AG: the same bytes
    frozen = PARAM * sum(p.numel() for p in model.parameters() if not p.requires_grad)
    if stage == 0:
        n, counters = sum(sizes), STEP_COUNTER * len(trainable(model))
        return RankBytes(PARAM * n + frozen, GRAD * n, ADAM * n + counters, {ALL: sent},
                         counters)
    padded = sum(world * chunk(n, world) for n in sizes)
    mine = sum(chunk(n, world) for n in sizes)
    counters = STEP_COUNTER * len(sizes)  # one flat shard stepped per bucket
    return RankBytes(PARAM * padded + frozen, GRAD * (padded if stage == 1 else mine),
                     ADAM * mine + counters, {ALL: sent}, counters)


def _zero3(model: nn.Module, world: int, options: dict) -> RankBytes:
    params = grads = optimizer = sent = counters = 0
    for unit in units(model, options.get("wrap", "auto")):
        trained = chunk(sum(p.numel() for p in unit if p.requires_grad), world)
        frozen = chunk(sum(p.numel() for p in unit if not p.requires_grad), world)
        params += PARAM * (trained + frozen)
        grads += GRAD * trained
        counters += STEP_COUNTER if trained else 0  # one flat shard stepped per unit
        optimizer += ADAM * trained
        sent += PARAM * (world - 1) * (2 * (trained + frozen) + trained)
    return RankBytes(params, grads, optimizer + counters, {ALL: sent}, counters)


def _dim0(model: nn.Module, shard: int, replicas: int, options: dict,
          hybrid: bool) -> RankBytes:
    params = grads = optimizer = counters = 0
    sent = {INTRA: 0, INTER: 0}
    for unit in units(model, options.get("wrap", "auto")):
        mine = sum(rows_chunk(p.shape, shard) for p in unit)
        trained = sum(rows_chunk(p.shape, shard) for p in unit if p.requires_grad)
        params += PARAM * mine
        grads += GRAD * trained
        optimizer += ADAM * trained
        counters += STEP_COUNTER * sum(1 for p in unit if p.requires_grad)
        sent[INTRA] += PARAM * (shard - 1) * (2 * mine + trained)
        if replicas > 1:
            sent[INTER] += ring_sent("all_reduce", trained, replicas)
    if not hybrid:
        sent = {ALL: sent[INTRA]}
    elif replicas == 1:  # one replica: nothing crosses
        del sent[INTER]
    return RankBytes(params, grads, optimizer + counters, sent, counters)


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"no formula here for strategy {strategy!r}; use one of "
                         f"{list(STRATEGIES)}")
    return strategy


def _check_world(world, options: dict, strategy: str) -> int:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a whole number >= 1, got {world!r}")
    if strategy == "hsdp":
        size = options.get("shard_group")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or world % size:
            raise ValueError(f"hsdp needs options={{'shard_group': S}} with S dividing the "
                             f"world size {world}, got {size!r}")
    return world


def predicted(strategy: str, model: nn.Module, world: int,
              options: dict | None = None) -> RankBytes:
    """One rank's bytes under `strategy` at `world` ranks, every padding counted (the
    module's table). `model` gives the shapes (a model on meta will do); `options` the
    strategy's (its wrap policy, bucket sizes, HSDP's `shard_group`)."""
    options = dict(options or {})
    _check_world(world, options, check_strategy(strategy))
    if strategy in ("ddp", "zero1", "zero2"):
        return _flat_buckets(model, world, ZERO_STAGE[strategy], options)
    if strategy == "zero3":
        return _zero3(model, world, options)
    shard = options["shard_group"] if strategy == "hsdp" else world
    return _dim0(model, shard, world // shard, options, hybrid=strategy == "hsdp")


def ideal(strategy: str, model: nn.Module, world: int,
          options: dict | None = None) -> RankBytes:
    """The course's formulas, nothing padded: the ZeRO paper's model states at the
    strategy's stage (`memory.model_states` with Ψ/N exact) and its volume
    (`comm.volume_per_rank`; HSDP's by link, `comm.hsdp_volume_per_link`), fp32 AdamW,
    Adam's step counters left out as the paper leaves them."""
    options = dict(options or {})
    _check_world(world, options, check_strategy(strategy))
    n = psi(model)
    if strategy == "hsdp":
        size = options["shard_group"]
        states = model_states(float(n), size, 3, "fp32", "adamw")
        sent = hsdp_volume_per_link(n, world, size, PARAM)
        if world == size:  # one replica: nothing crosses
            del sent[INTER]
    else:
        states = model_states(float(n), world, ZERO_STAGE[strategy], "fp32", "adamw")
        sent = {ALL: volume_per_rank(strategy, n, world, PARAM)}
    return RankBytes(states.params, states.grads, states.optimizer, sent)


def padding_cost(strategy: str, model: nn.Module, world: int,
                 options: dict | None = None) -> dict[str, float]:
    """What padding adds, as a share of the course's formula: (predicted - ideal) / ideal
    of the bytes held (Adam's step counters, which are no padding, left out) and of the
    bytes sent (0 where the formula is 0: one rank sends nothing)."""
    exact, plain = predicted(strategy, model, world, options), ideal(strategy, model, world,
                                                                      options)

    def share(a: float, b: float) -> float:
        return (a - b) / b if b else 0.0

    return {"held": share(exact.held - exact.counters, plain.held),
            "sent": share(exact.sent_total, plain.sent_total)}
