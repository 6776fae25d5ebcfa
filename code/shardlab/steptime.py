"""How long one training step takes, predicted before it runs: compute, communication, and
what of the communication the strategy's schedule leaves exposed.

    compute         forward 2ΨT/F, backward 4ΨT/F (6ΨT for the step), T tokens per rank,
                    F the rate this machine reaches on the model's own forward and
                    backward with all ranks running (`rates.compute_rate`; the matmul rate
                    `rates.matmul_rate` is its ceiling on this machine);
                    the optimizer step: AdamW over the tensors the slowest rank steps,
                    as the strategy lays them out, per element and per tensor
                    (`shardlab.stepparts`: one flat shard costs less than Ψ/N
                    elements cut into every parameter's shard);
                    the strategy's own work (hooks, copies, dispatch) per parameter tensor
                    and per unit, and the training loop's own work a step and its
                    ledger's a collective, each measured on probes (`shardlab.probes`)
    communication   each collective, kind and size as the ledger records them (listed
                    by the strategy's rule, `shardlab.plans`), by its
                    kind's cost measured inside a step (`stepparts`: after compute, no
                    barrier, so arrival skew and copies beside compute are in it); on a
                    machine without that measurement (a GPU the course has not run on),
                    by the α-β fit of the ring alone (`comm.predict_seconds`; on gloo a
                    native reduce-scatter is an all-reduce, DESIGN.md, so it costs one)
    exposed         the strategy's schedule: where each collective runs and what compute
                    it can hide behind (its card's `schedule`, `shardlab.cards`)

A collective hides behind compute only as well as the machine lets it: `hiding` is the
share of an overlapped collective's time that does not come back as slower compute. It is
a measured number, never assumed. On a CPU gloo's copies run on the cores that compute;
`rates.hiding_fraction` measures it. On a GPU communication is not free either: NCCL's ring and
tree collectives are CUDA kernels, each channel one CTA (thread block) on an SM, reading
and writing the same HBM as the matmuls beside them (NCCL user guide, environment
variables NCCL_MIN_CTAS / NCCL_MAX_CTAS and `ncclConfig_t`'s minCTAs / maxCTAs, which
torch exposes as `ProcessGroupNCCL.NCCLConfig.min_ctas` / `max_ctas` in
`torch/_C/_distributed_c10d.pyi`). A separate stream lets them run at the same time as
compute, not for nothing: how much of them comes back as slower matmuls is unknown until a
GPU run measures it. `gpu_machine` therefore takes `hiding` explicitly, and refuses to
guess.

`predict_step(strategy, model, world, options, machine, tokens=...)` is the model;
`Machine` holds what it needs of the machine, measured by `rates.compute_rate`,
`stepparts.optimizer_costs`, `stepparts.collective_costs_in_step`, `rates.hiding_fraction` and
`comm.fit_alpha_beta` (`shardlab.workers.measure_machine` runs them on every rank).

The FLOPs of a step are counted as 6Ψ per token, Ψ the trainable parameters embeddings
included (each tied weight once), with attention's score and value matmuls left out:
`model_flops_per_token` adds PaLM's 12·L·d·s for them when asked. MFU, those FLOPs per
second over a GPU's *datasheet* peak (`datasheet_peak`), is what `shardlab.report` prints;
`rates.matmul_rate` is a different denominator, this machine's measured matmul rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from shardlab import hardware
from shardlab.cards import CARDS
from shardlab.comm.records import CollectiveRecord
from shardlab.comm.volumes import predict_seconds
from shardlab.plans import planned_collectives, timed_card
from shardlab.stepparts import InStepCost, OptimizerCosts, optimizer_seconds
from shardlab.wrap import unit_modules


@dataclass(frozen=True)
class Machine:
    """What the step-time model needs of a machine, each figure per rank with every rank
    of the run working at once (on a shared CPU a rank gets its share of the cores)."""

    flops: float                   # 6ΨT FLOP/s of one rank's forward and backward
    alpha: float                   # s per ring round (α-β fit)
    beta: float                    # bytes/s of one ring round (α-β fit)
    adam_seconds: float            # AdamW's seconds per parameter stepped
    hiding: float                  # share of overlapped communication that is hidden:
                                   # measured (`rates.hiding_fraction`), never a default
    gloo: bool = True              # gloo's algorithms: reduce-scatter as an all-reduce,
                                   # broadcast as a binomial tree
    adam_tensor_seconds: float = 0.0    # what AdamW adds per tensor it steps, and per
    dtensor_tensor_seconds: float = 0.0  # DTensor on top (`stepparts.optimizer_costs`)
    in_step: dict[str, InStepCost] = field(default_factory=dict)
                                   # each kind of collective as it costs inside a step:
                                   # arrival skew and copies beside compute included
                                   # (`stepparts.collective_costs_in_step`); a kind it
                                   # lacks costs its α-β time alone
    strategy_work: dict[str, float] = field(default_factory=dict)
                                   # each strategy's own work a step, per parameter
                                   # tensor (hooks, copies, views, DTensor dispatch),
                                   # measured on probes (`probes.strategy_work`)
    unit_work: dict[str, float] = field(default_factory=dict)
                                   # and per unit past the first, for a strategy of units:
                                   # beyond its collectives' lines, so of either sign (below
                                   # 0 it comes off the collectives, not the compute)
    loop_seconds: float = 0.0      # the training loop's own work a step (its clock,
                                   # its batch, its loss's scale), and what its ledger
    ledger_seconds: float = 0.0    # adds to each collective (`probes.loop_costs`): 0
                                   # where no ledger records the run
    # (op, bytes, world) -> seconds of one collective, in place of the α-β ring on one link
    # (alpha, beta and gloo unused then): a network of nodes (`shardlab.scaling`)
    network: Callable[[str, float, int], float] | None = None

    def __post_init__(self):
        if not (self.flops > 0 and self.beta > 0 and self.alpha >= 0
                and self.adam_seconds >= 0 and 0 <= self.hiding <= 1
                and self.adam_tensor_seconds >= 0 and self.dtensor_tensor_seconds >= 0
                and all(c.fixed >= 0 and c.per_byte >= 0 for c in self.in_step.values())
                and all(w >= 0 for w in self.strategy_work.values())
                and self.loop_seconds >= 0 and self.ledger_seconds >= 0):
            raise ValueError(f"a Machine needs flops > 0, beta > 0, alpha >= 0, "
                             f"adam_seconds, adam_tensor_seconds, dtensor_tensor_seconds >= 0, "
                             f"in-step costs, strategy work, loop and ledger seconds >= 0 and "
                             f"0 <= hiding <= 1, "
                             f"got {self}")


def gpu_machine(flops: float, alpha: float, beta: float, *, hiding: float | None,
                adam_seconds: float = 0.0) -> Machine:
    """A `Machine` for NCCL on GPUs (its own algorithms: `gloo=False`).

    `hiding` on a GPU is unmeasured until a GPU run records it: NCCL's kernels take SMs and
    memory bandwidth from the matmuls they overlap (see the module's docstring), so it is
    below 1 by an amount no datasheet gives. The caller passes it and says where it comes
    from: what `tools/gpu_check.py` recorded (`shardlab.gpu_record`), or an assumption the
    text states as one (1.0 is the bound where overlap is free). None is refused."""
    if hiding is None:
        raise ValueError("hiding on a GPU is unmeasured: pass the value the GPU check "
                         "recorded (shardlab.gpu_record), or an assumption stated as one "
                         "(hiding=1.0 is the bound where overlapped communication is free)")
    return Machine(flops=flops, alpha=alpha, beta=beta, adam_seconds=adam_seconds,
                   hiding=hiding, gloo=False)


@dataclass
class Collective:
    op: str
    nbytes: int
    phase: str       # forward, backward, step
    how: str         # produced, prefetched, waited
    seconds: float = 0.0


@dataclass
class StepPrediction:
    """A step, predicted: seconds of compute and of exposed communication by phase, and
    every collective with its phase and α-β time."""

    strategy: str
    world: int
    tokens: int
    compute: dict[str, float]
    exposed: dict[str, float]
    collectives: list[Collective] = field(default_factory=list)
    hiding: float = 0.0   # the machine's, as the prediction used it

    @property
    def compute_seconds(self) -> float:
        return sum(self.compute.values())

    @property
    def comm_seconds(self) -> float:
        return sum(c.seconds for c in self.collectives)

    @property
    def exposed_seconds(self) -> float:
        return sum(self.exposed.values())

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.exposed_seconds

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank sends on a ring for this step's collectives."""
        factor = {"all_reduce": 2, "broadcast": 1}
        return sum(factor.get(c.op, 1) * c.nbytes * (self.world - 1) / self.world
                   for c in self.collectives)

    def timeline(self) -> list[tuple[str, str, float, float]]:
        """(lane, what, begin s, end s), for a figure: per phase, the waited collectives
        first, then the prefetched ones (compute starts when what they expose is over),
        the compute, and the produced ones ending when their exposed part after the
        compute is over."""
        spans, t = [], 0.0
        phases = [("forward", "forward"), ("backward", "backward"), ("step", "optimizer")]
        if "strategy" in self.compute:
            phases.append(("strategy", "strategy's own work"))
        if "loop" in self.compute:
            phases.append(("loop", "the loop's own work"))
        for phase, compute_name in phases:
            ops = [c for c in self.collectives if c.phase == phase]
            window = self.compute[phase] if phase != "step" else 0.0
            c_t = t
            for how in ("waited", "prefetched"):
                for c in (c for c in ops if c.how == how):
                    spans.append(("communication", c.op, c_t, c_t + c.seconds))
                    c_t += c.seconds
            waited = sum(c.seconds for c in ops if c.how == "waited")
            prefetched = [c for c in ops if c.how == "prefetched"]
            produced = [c for c in ops if c.how == "produced"]
            start = t + waited + exposed_seconds(prefetched, window, self.hiding)
            end = start + self.compute[phase]
            spans.append(("compute", compute_name, start, end))
            tail = exposed_seconds(produced, window, self.hiding)
            c_t = max(start, end + tail - sum(c.seconds for c in produced))
            for c in produced:
                spans.append(("communication", c.op, c_t, c_t + c.seconds))
                c_t += c.seconds
            t = end + tail
        return spans


def collective_seconds_on_machine(op: str, nbytes: int, world: int,
                                  machine: Machine) -> float:
    """Seconds of one collective over a tensor of `nbytes` inside a step: its kind's
    measured in-step cost where the machine has one (`in_step`); else as the machine's
    `network` prices it, when it has one; else its α-β time alone as the backend runs it.
    On
    gloo a native reduce-scatter is an all-reduce (its copies cost one), and a native
    broadcast is a binomial tree: ceil(log2 N) rounds, each the whole tensor from every
    rank that has it (gloo/broadcast.cc), not the pipelined chain `ring_traffic` counts
    (N + N - 2 rounds of 1/N)."""
    op = op.removeprefix("ring_")
    if op in machine.in_step:  # measured as the backend runs it, inside a step
        return machine.in_step[op].seconds(nbytes) if world > 1 and nbytes > 0 else 0.0
    if machine.network is not None:
        return machine.network(op, nbytes, world)
    if machine.gloo:
        if op == "reduce_scatter":
            op = "all_reduce"
        elif op == "broadcast" and world > 1 and nbytes > 0:
            return math.ceil(math.log2(world)) * (machine.alpha + nbytes / machine.beta)
    return predict_seconds(op, nbytes, world, machine.alpha, machine.beta)


def exposed_seconds(ops: list[Collective], window: float, hiding: float) -> float:
    """Exposed seconds of one phase's collectives that run under `window` seconds of
    compute: the waited ones whole; the produced ones all but what the window hides, and
    at least the last (it starts when the compute ends); the prefetched ones likewise, and
    at least the first (it is needed as the compute starts)."""
    waited = sum(c.seconds for c in ops if c.how == "waited")
    out = waited
    for how, unhidden in (("produced", -1), ("prefetched", 0)):
        these = [c for c in ops if c.how == how]
        if these:
            out += max(these[unhidden].seconds,
                       sum(c.seconds for c in these) - hiding * window)
    return out


def overlaps_beside_compute(backend: str) -> bool:
    """Whether `backend`'s collectives run beside the compute, so that starting one early
    hides it: an asynchronous collective of PyTorch's NCCL backend runs its kernels on CUDA
    streams of its own (`ncclStreams_`, "the CUDA streams used by NCCL kernels", in
    torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp); gloo's run on CPU threads that
    share the cores with the compute. Measured by `benchmarks/bench_overlap.py` (the
    README's overlap table): on gloo ranks sharing a CPU, ZeRO-1/2's all-gathers
    overlapped bucket by bucket made the step slower than one all-gather after it. What
    `overlap_all_gather="auto"`, ZeRO-1/2's default, follows."""
    return backend == "nccl"


def with_overlap_decided(strategy: str, options: dict, backend: str) -> dict:
    """`options` with the strategy's all-gather overlap option (its card's
    `gather_overlap_option`) decided for `backend` where it is left to "auto"."""
    overlap = CARDS[strategy].gather_overlap_option if strategy in CARDS else None
    if overlap is None or options.get(overlap, "auto") != "auto":
        return options
    return {**options, overlap: overlaps_beside_compute(backend)}


def predict_step(strategy: str, model: nn.Module, world: int, options: dict | None,
                 machine: Machine, *, tokens: int,
                 ledger: Iterable[CollectiveRecord] | None = None,
                 bytes_per_elem: int = 4) -> StepPrediction:
    """The predicted step of `strategy` on `world` ranks, `tokens` tokens per rank.

    The collectives are the ledger's records of one step when given (their kind and
    logical bytes), else those the strategy's rules plan (`planned_collectives`).
    """
    strategy_card = timed_card(strategy)
    if world < 1 or tokens < 1:
        raise ValueError(f"need world >= 1 and tokens >= 1, got world={world}, "
                         f"tokens={tokens}")
    options = with_overlap_decided(strategy, dict(options or {}),
                                   "gloo" if machine.gloo else "nccl")
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if strategy_card.optimizer_layout is not None:
        optimizer = optimizer_seconds(strategy, model, world, OptimizerCosts(
            machine.adam_seconds, machine.adam_tensor_seconds,
            machine.dtensor_tensor_seconds))
    else:
        stepped = psi / world if strategy_card.sharded_step else psi
        optimizer = stepped * machine.adam_seconds
    compute = {"forward": 2 * psi * tokens / machine.flops,
               "backward": 4 * psi * tokens / machine.flops,
               "step": optimizer}
    if strategy in machine.strategy_work:  # the strategy's own work, per parameter tensor
        compute["strategy"] = machine.strategy_work[strategy] * sum(
            1 for p in model.parameters() if p.requires_grad)
    # and per unit past the first: work where it is above 0; below 0 it is what a step's
    # collectives, one after another with the ranks already together, cost less than
    # their lines, and it comes off them (below)
    per_unit = machine.unit_work.get(strategy, 0.0) if world > 1 else 0.0
    units_past_first = (len(unit_modules(model, options.get("wrap", "auto"))) - 1
                        if per_unit else 0)
    if per_unit > 0:
        compute["strategy"] = compute.get("strategy", 0.0) + per_unit * units_past_first
    if ledger is not None:
        plan = [(r.op.removeprefix("ring_"), r.logical_bytes) for r in ledger]
    else:
        plan = planned_collectives(strategy, model, world, options, bytes_per_elem)
    if machine.loop_seconds or machine.ledger_seconds:  # the loop's own work
        compute["loop"] = machine.loop_seconds + machine.ledger_seconds * len(plan)
    schedule = strategy_card.schedule_on(machine.gloo)
    overlap = strategy_card.gather_overlap_option
    collectives = []
    gathers = sum(1 for op, _ in plan if op == "all_gather")
    seen_gathers = 0
    for op, nbytes in plan:
        where = schedule.get(op, ("step", "waited"))
        if isinstance(where[0], tuple):  # ZeRO-3/FSDP2's gathers: forward, then backward
            where = where[0] if seen_gathers < gathers / 2 else where[1]
            seen_gathers += 1
        if op == "all_gather" and overlap is not None and not options.get(overlap, True):
            where = ("step", "waited")
        seconds = collective_seconds_on_machine(op, nbytes, world, machine)
        collectives.append(Collective(op, nbytes, *where, seconds))
    lines = sum(c.seconds for c in collectives)
    if per_unit < 0 and lines > 0:  # each collective less, in proportion to its line
        kept = max(0.0, 1 + per_unit * units_past_first / lines)
        for c in collectives:
            c.seconds *= kept
    exposed = {phase: exposed_seconds([c for c in collectives if c.phase == phase],
                                      compute[phase] if phase != "step" else 0.0,
                                      machine.hiding)
               for phase in compute}
    return StepPrediction(strategy, world, tokens, compute, exposed, collectives,
                          machine.hiding)


# ----------------------------------------------------------------------------- measuring


def model_flops_per_token(psi: int, n_layers: int = 0, d_model: int = 0,
                          seq_len: int = 0) -> float:
    """The model FLOPs of one token's forward and backward: 6Ψ (2Ψ forward, 4Ψ backward;
    Ψ the trainable parameters, embeddings included), plus PaLM's 12·L·d·s for attention's
    score and value matmuls when `n_layers`, `d_model` and `seq_len` are given (Chowdhery
    et al. 2022, appendix B; L layers of width d over sequences of s tokens). Recomputed
    forwards are not model FLOPs: MFU leaves them out."""
    if psi < 0 or n_layers < 0 or d_model < 0 or seq_len < 0:
        raise ValueError(f"need psi, n_layers, d_model, seq_len >= 0, got {psi}, "
                         f"{n_layers}, {d_model}, {seq_len}")
    return 6 * psi + 12 * n_layers * d_model * seq_len


def matmul_dtype(param_dtype: torch.dtype) -> str:
    """The dtype a model's matmuls run in, as the datasheets name it: bf16 or fp16 for
    such parameters; for fp32 ones, "tf32" where PyTorch lets matmuls use TF32
    (`torch.get_float32_matmul_precision()` is "high" or "medium"), else "fp32"."""
    if param_dtype == torch.bfloat16:
        return "bf16"
    if param_dtype == torch.float16:
        return "fp16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def datasheet_peak(device: torch.device | str, param_dtype: torch.dtype) -> float | None:
    """MFU's denominator for a rank on `device`: the datasheet's dense peak FLOP/s of that
    GPU in the matmuls' dtype (`hardware.peak_flops`), or None on a CPU or a GPU the
    course has no datasheet figure for."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    peak = hardware.peak_flops(torch.cuda.get_device_name(device), matmul_dtype(param_dtype))
    return None if peak is None else peak.value
