"""The run report: what one rank did in a training run, and its summaries.

`shardlab.train` fills a `RunReport` on every rank; this module turns the ranks' reports
into what a reader looks at: collectives per step, a robust step time, a summary table,
and JSON.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RunReport:
    """What one rank did. `losses` are global-batch losses, the same on every rank.

    `state_bytes` is measured after the last step's `optimizer.step()` and before its
    `zero_grad()`, when parameters, gradients and optimizer states all exist. `peak` is
    the peak of the last step (tracked, which slows that step: `step_times[-1]` is not a
    timing to use; neither is `step_times[0]`, which pays for warm-up).
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


def median_step_time(report: RunReport) -> float:
    """Median of the step times, leaving out the first (warm-up) and the last (memory
    tracking) step when there are enough steps."""
    times = report.step_times[1:-1] if len(report.step_times) > 2 else report.step_times
    return statistics.median(times)


def summary_table(reports: list[RunReport]) -> str:
    """One line per rank: final loss, median step time, model states, peak, traffic."""
    mib = 1024 * 1024
    head = (f"{'rank':>4} {'loss':>8} {'step ms':>8} {'params MiB':>11} {'grads MiB':>10} "
            f"{'optim MiB':>10} {'peak MiB':>9} {'sent MiB/step':>14} {'colls/step':>11}")
    lines = [head, "-" * len(head)]
    for r in reports:
        s, t = r.state_bytes, ledger_totals(r)
        lines.append(f"{r.rank:>4} {r.losses[-1]:>8.4f} {1e3 * median_step_time(r):>8.1f} "
                     f"{s.get('params', 0) / mib:>11.3f} {s.get('grads', 0) / mib:>10.3f} "
                     f"{s.get('optimizer', 0) / mib:>10.3f} "
                     f"{r.peak.get('total', 0) / mib:>9.3f} {t['sent_bytes'] / mib:>14.3f} "
                     f"{t['calls']:>11.1f}")
    return "\n".join(lines)


def report_to_json(config: Any, reports: list[RunReport]) -> dict:
    def record(r) -> dict:
        fields = r.__dict__ if hasattr(r, "__dict__") else r._asdict()
        return {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in fields.items()}

    return {"config": {**config.__dict__},
            "ranks": [{"rank": r.rank, "world": r.world, "strategy": r.strategy,
                       "placement": r.placement,
                       "psi": r.psi, "losses": r.losses, "state_bytes": r.state_bytes,
                       "peak": r.peak, "step_times": r.step_times,
                       "collectives_per_step": ledger_totals(r),
                       "ledger": [record(x) for x in r.ledger]} for r in reports]}
