"""The run report: what one rank did in a training run, and its summaries.

`shardlab.train` fills a `RunReport` on every rank; this module turns the ranks' reports
into what a reader looks at: collectives per step, a robust step time and the production
metrics (`shardlab.report_output` prints them as the command line's table and writes JSON).

The production metrics are what an engineer watches on a sharded run, computed from
timestamps the run recorded (never from an assumed bandwidth):

* **step time** and **tokens/s per rank** (this rank's tokens of a step over its time);
* **all-gather, reduce-scatter, all-reduce time**: the time each kind of collective was
  in flight during the step, from its launch to its completion (the ledger's `start`,
  `end`), clipped to the step;
* **exposed communication**: the time in the step during which this rank *waited* for a
  collective instead of computing: inside `work.wait()` (every blocking collective waits
  there too) or at the end of backward, where a data-parallel wrapper waits for its last
  buckets (PyTorch's DDP does it in C++, where no wait can be timed: the span from the
  end of autograd's computation to the return of `backward()` stands for it), counted
  only while a collective was in flight. **Overlap %** is the rest of the
  communication time: in flight while the rank computed;
* **idle time**: the part of the exposed time this rank spent waiting for another rank
  to *arrive* at a collective (it had launched it; the slowest rank had not). The
  ranks' records of one collective are paired by process group and order, and their
  launch times laid on one clock (`comm.clock_offset`). A straggler shows it: every rank
  but the slow one is idle for about the slow rank's delay;
* **MFU** (model FLOPs utilization, as PaLM defines it, appendix B): the model's FLOPs
  of a step over the step's time, as a share of the GPU's *datasheet* peak in the
  matmuls' dtype (`hardware.peak_flops`; dense, bf16 989 TFLOP/s on an H100 SXM). The
  FLOPs are 6ΨT (Ψ the trainable parameters, embeddings included; attention's 12·L·d·s
  per token left out: `steptime.model_flops_per_token`). None where there is no
  datasheet peak: on a CPU, or on a GPU the course has no figure for;
* **matmul utilization**: the same FLOPs per second as a share of the matmul rate this
  rank measured on the model's own shapes at the start of the run
  (`rates.matmul_rate`; on a shared CPU, the rank's share of the cores). Not MFU: a
  measured rate sits below the datasheet's peak, so this share is larger than the MFU of
  the same run, and it compares with no published MFU. It is what a CPU run can report;
* **peak allocated** memory of the last step, and **peak reserved** on CUDA (what the
  caching allocator took from the device; None on a CPU);
* **checkpoint save and load** seconds, where the run saved or resumed.

On a GPU the timestamps are the CPU's: a collective launched on a stream and waited on
by the stream does not block the CPU, so there the exposed time needs the GPU's own
timeline (the PyTorch profiler's trace); the loop's step times, which synchronize, stay
right.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from shardlab.trace import Span

# ----------------------------------------------------------------------------- the report


@dataclass
class RunReport:
    """What one rank did. `losses` are global-batch losses, the same on every rank.

    `state_bytes` is measured after the last step's `optimizer.step()` and before its
    `zero_grad()`, when parameters, gradients and optimizer states all exist. `peak` is
    the peak of the last step (tracked, which slows that step: `step_times[-1]` is not a
    timing to use; neither is `step_times[0]`, which pays for warm-up): "total", its
    categories, "reserved" on CUDA, and under gradient accumulation "between_micro_batches",
    what is held between a micro-batch's backward and the next one's forward
    (`shardlab.measure.Peak.between`).

    The timestamps are `time.perf_counter()` seconds of this rank: `step_starts[i]` when
    step i began, `phases[i]` the `shardlab.trace.Span`s (what, begin, end) the loop's clock
    recorded in it (forward, backward, the end of autograd's computation inside backward,
    the optimizer step), `clock_offset` this clock minus rank 0's.
    """

    rank: int
    world: int
    strategy: str
    losses: list[float]
    state_bytes: dict[str, int]
    peak: dict[str, int]
    ledger: list[Any]
    step_times: list[float]
    params: dict[str, torch.Tensor] | None = None
    psi: int = 0  # trainable parameters of the model (each tied weight once)
    first_step: int = 0  # > 0 when resumed: losses[i] is the loss of step first_step + i
    placement: str = ""  # how the ranks were placed: backend, device, ranks per GPU
    tokens_per_step: int = 0  # this rank's tokens in one step (all its micro-batches)
    step_starts: list[float] = field(default_factory=list)
    phases: list[list[Span]] = field(default_factory=list)
    clock_offset: float = 0.0
    checkpoint_save_seconds: list[float] = field(default_factory=list)
    checkpoint_load_seconds: float | None = None
    # where the tracked step first held more than TrainConfig.memory_limit (None: never)
    memory_limit_crossing: str | None = None
    # where the rank ran: its node (torchrun's GROUP_RANK; 0 under the launcher), the
    # host, and its rank among the `local_world` ranks of that node
    node: int = 0
    host: str = ""
    local_rank: int = 0
    local_world: int = 1
    # The model's FLOPs in this rank's step (6 Ψ T), and the two rates they are divided
    # by: the datasheet's peak of this rank's GPU in the matmuls' dtype (MFU; 0 where
    # none is known: a CPU) and this rank's matmul rate on the model's shapes, measured
    # at the run's start (matmul utilization; `rates.matmul_rate`)
    model_flops_per_step: float = 0.0
    peak_flops: float = 0.0
    matmul_flops: float = 0.0
    # each step's global gradient norm before clipping (TrainConfig.clip_norm; [] without)
    grad_norms: list[float] = field(default_factory=list)
    # the units the wrap policy made, for a strategy that takes units (`wrap.describe`)
    units: str | None = None
    # the checkpoint folder the run resumed from (None: it started from step 0)
    resumed_from: str | None = None


def ledger_totals(report: RunReport) -> dict[str, float]:
    """Collectives per step of a report: calls and bytes (steps after the first; the first
    can carry one-off set-up traffic)."""
    steps = len(report.step_times)
    if steps > 1:
        later, n = [r for r in report.ledger if r.step > 0], steps - 1
    else:
        later, n = list(report.ledger), 1
    return {"calls": sum(1 for _ in later) / n,
            "logical_bytes": sum(r.logical_bytes for r in later) / n,
            "sent_bytes": sum(r.sent_bytes for r in later) / n}


def steady_steps(report: RunReport) -> list[int]:
    """The steps whose times mean something: all but the first (warm-up) and the last
    (memory tracking), when there are enough."""
    n = len(report.step_times)
    return list(range(1, n - 1)) if n > 2 else list(range(n))


def median_step_time(report: RunReport, warmup: int = 1) -> float:
    """Median of the step times, leaving out the first `warmup` and the last (memory
    tracking) step when there are enough steps. A fresh process takes a few steps to
    settle (its allocator keeps a step's short-lived buffers only after the first ones
    have faulted their pages in), so a benchmark that times a few steps leaves out more
    than one."""
    if warmup < 1:
        raise ValueError(f"warmup leaves out at least the first step, got {warmup}")
    steps = steady_steps(report)
    if len(report.step_times) > warmup + 1:
        steps = list(range(warmup, len(report.step_times) - 1))
    return statistics.median(report.step_times[i] for i in steps)


def unit_sizes(report: RunReport) -> list[int]:
    """Each unit's full (padded) bytes, read off the ledger: a sharded strategy
    reduce-scatters each unit's gradients once a step (HSDP: inside its shard group).
    What the α-β model of a step (`shardlab.comm.fsdp_step_seconds`) takes."""
    last = max((r.step for r in report.ledger), default=0)
    return [r.logical_bytes for r in report.ledger
            if r.step == last and r.op == "reduce_scatter"]


def median_collective_time(report: RunReport) -> float:
    """The seconds of the step's collectives added up, median over the steady steps (on
    gloo and a CPU they barely overlap compute: close to the step's communication)."""
    return statistics.median(sum(r.seconds for r in report.ledger if r.step == s)
                             for s in steady_steps(report))


# ----------------------------------------------------------------------------- intervals
# Spans are (begin, end) pairs of one rank's clock; a "set" of spans is kept merged.


def _merge(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in spans if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersect(xs, ys) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _clip(spans, begin: float, end: float) -> list[tuple[float, float]]:
    return _intersect(spans, [(begin, end)])


# ----------------------------------------------------------------------------- the metrics

POINT_TO_POINT = ("send", "recv")
TIMED_OPS = ("all_gather", "reduce_scatter", "all_reduce")


def op_kind(op: str) -> str:
    """The collective's kind, ours or native: "ring_all_gather" is an all-gather."""
    op = op.removeprefix("ring_")
    return op if op in TIMED_OPS else "other"


def _end(record) -> float:
    end = getattr(record, "end", math.nan)
    return record.start + record.seconds if math.isnan(end) else end


def _timed(report: RunReport) -> bool:
    return bool(report.step_starts) and all(hasattr(r, "waits") for r in report.ledger)


def blocked_spans(report: RunReport) -> list[tuple[float, float]]:
    """When this rank waited on communication: in a wait for a collective, or at the end
    of backward while a collective was in flight."""
    waits = [w for r in report.ledger for w in r.waits]
    tails = [(a, b) for spans in report.phases for what, a, b in spans
             if what == "end of backward"]
    in_flight = _merge((r.start, _end(r)) for r in report.ledger)
    return _merge(waits + _intersect(_merge(tails), in_flight))


def arrival_spans(reports: list[RunReport]) -> list[list[tuple[float, float]]]:
    """For each rank, the spans from its launch of a collective to the launch by the
    last rank of that collective's group, in the rank's own clock: while in them, the
    collective could not progress, whatever this rank did."""
    out: list[list[tuple[float, float]]] = [[] for _ in reports]
    groups: dict[str, dict[int, list]] = {}
    for i, report in enumerate(reports):
        for record in report.ledger:
            if record.op not in POINT_TO_POINT:
                groups.setdefault(record.group, {}).setdefault(i, []).append(record)
    for members in groups.values():
        if len(members) < 2:
            continue
        for records in zip(*members.values()):  # the k-th collective of the group
            if len({r.op for r in records}) > 1:
                break  # the ranks' sequences part ways: pair no further
            ranks = list(members)
            latest = max(r.start - reports[i].clock_offset for i, r in zip(ranks, records))
            for i, r in zip(ranks, records):
                out[i].append((r.start, latest + reports[i].clock_offset))
    return [_merge(spans) for spans in out]


def rank_spans(reports: list[RunReport]) -> list[dict[str, Any]]:
    """Every rank's spans, the whole run: collectives in flight (all, and by kind), the
    exposed ones (waited for) and the idle ones (waited for another rank to arrive)."""
    arrivals = arrival_spans(reports) if all(_timed(r) for r in reports) else None
    out = []
    for i, report in enumerate(reports):
        if not _timed(report):
            out.append(None)
            continue
        by_kind: dict[str, list] = {}
        for r in report.ledger:
            by_kind.setdefault(op_kind(r.op), []).append((r.start, _end(r)))
        in_flight = _merge((r.start, _end(r)) for r in report.ledger)
        exposed = _intersect(blocked_spans(report), in_flight)
        out.append({"in_flight": in_flight,
                    "by_kind": {k: _merge(v) for k, v in by_kind.items()},
                    "exposed": exposed,
                    "idle": _intersect(exposed, arrivals[i]) if arrivals else []})
    return out


def step_metrics(reports: list[RunReport]) -> list[list[dict[str, Any]]]:
    """Every rank's metrics of every step (seconds; overlap a fraction, None without
    communication): `[rank][step] -> {...}`. Pass all ranks' reports: idle time compares
    them."""
    out = []
    for report, spans in zip(reports, rank_spans(reports)):
        rows = []
        for s, seconds in enumerate(report.step_times):
            row: dict[str, Any] = {
                "step": report.first_step + s, "seconds": seconds,
                "tokens_per_second": report.tokens_per_step / seconds if seconds else 0.0}
            if spans is not None:
                begin = report.step_starts[s]
                end = begin + seconds
                for kind in (*TIMED_OPS, "other"):
                    row[f"{kind}_seconds"] = _length(_clip(spans["by_kind"].get(kind, []),
                                                           begin, end))
                comm = _length(_clip(spans["in_flight"], begin, end))
                row["comm_seconds"] = comm
                row["exposed_seconds"] = _length(_clip(spans["exposed"], begin, end))
                row["overlap"] = (1 - row["exposed_seconds"] / comm) if comm > 0 else None
                row["idle_seconds"] = _length(_clip(spans["idle"], begin, end))
            rows.append(row)
        out.append(rows)
    return out


def step_timeline(reports: list[RunReport], step: int) -> list[dict[str, Any]]:
    """One step of every rank, in milliseconds from that rank's start of the step: what
    the loop did ("phases"), each collective's kind and span ("collectives"), and the
    spans of exposed communication and of idle time. What `shardlab.viz` draws."""
    out = []
    for report, spans in zip(reports, rank_spans(reports)):
        i = step - report.first_step
        begin = report.step_starts[i]
        end = begin + report.step_times[i]

        def ms(pairs):
            return [(1e3 * (a - begin), 1e3 * (b - begin)) for a, b in _clip(pairs, begin, end)]

        collectives = [(op_kind(r.op), *span) for r in report.ledger
                       for span in ms([(r.start, _end(r))])]
        out.append({"rank": report.rank, "milliseconds": 1e3 * report.step_times[i],
                    "phases": [(what, *span) for what, a, b in report.phases[i]
                               for span in ms([(a, b)])],
                    "collectives": collectives,
                    "exposed": ms(spans["exposed"]) if spans else [],
                    "idle": ms(spans["idle"]) if spans else []})
    return out


def production_metrics(reports: list[RunReport]) -> list[dict[str, Any]]:
    """One summary per rank: medians over the steady steps of the step's times (ms),
    tokens/s, overlap % over those steps together, peak memory, checkpoint seconds."""
    summaries = []
    for report, steps in zip(reports, step_metrics(reports)):
        rows = [steps[i] for i in steady_steps(report)] if steps else []

        def median(key: str) -> float | None:
            values = [row[key] for row in rows if row.get(key) is not None]
            return statistics.median(values) if values else None

        def ms(key: str) -> float | None:
            value = median(key)
            return None if value is None else 1e3 * value

        comm = sum(row.get("comm_seconds") or 0.0 for row in rows)
        step_s = median("seconds")
        achieved = report.model_flops_per_step / step_s if step_s else None
        mfu = (100 * achieved / report.peak_flops
               if achieved is not None and report.peak_flops > 0 else None)
        matmul_utilization = (100 * achieved / report.matmul_flops
                              if achieved is not None and report.matmul_flops > 0 else None)
        exposed = sum(row.get("exposed_seconds") or 0.0 for row in rows)
        saves = report.checkpoint_save_seconds
        summaries.append({
            "rank": report.rank,
            "step_ms": ms("seconds"),
            "tokens_per_s": median("tokens_per_second"),
            "mfu_pct": mfu,
            "matmul_utilization_pct": matmul_utilization,
            "all_gather_ms": ms("all_gather_seconds"),
            "reduce_scatter_ms": ms("reduce_scatter_seconds"),
            "all_reduce_ms": ms("all_reduce_seconds"),
            "other_comm_ms": ms("other_seconds"),
            "comm_ms": ms("comm_seconds"),
            "exposed_comm_ms": ms("exposed_seconds"),
            "overlap_pct": 100 * (1 - exposed / comm) if comm > 0 else None,
            "idle_ms": ms("idle_seconds"),
            "peak_allocated": report.peak.get("total"),
            "peak_reserved": report.peak.get("reserved"),
            "checkpoint_save_s": statistics.median(saves) if saves else None,
            "checkpoint_load_s": report.checkpoint_load_seconds,
            "memory_limit_crossing": report.memory_limit_crossing,
        })
    return summaries
