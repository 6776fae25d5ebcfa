"""A run's reports as the command line prints them (one table of what each rank holds and
sends, one of where its step's time went, with the legend under it) and as JSON
(`--json`, and the benchmarks' results files). The numbers are `shardlab.report`'s."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from shardlab.launch.torchrun import Whereabouts
from shardlab.report import (RunReport, ledger_totals, median_step_time, production_metrics,
                             step_metrics)


def _cell(value, scale: float = 1.0, digits: int = 1, width: int = 8) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value * scale:>{width}.{digits}f}"


def summary_table(reports: list[RunReport]) -> str:
    """Two blocks of one line per rank: what it holds and sends (final loss, median step
    time, model states, peak, traffic), then where its step's time went (the production
    metrics, ms per step, medians over the steady steps). "MFU %" is against the GPU's
    datasheet peak ("-" on a CPU); "mm-util %" against the matmul rate the rank measured."""
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
    head = (f"{'rank':>4} {'tokens/s':>9} {'MFU %':>6} {'mm-util %':>9} {'AG ms':>7} "
            f"{'RS ms':>7} {'AR ms':>7} "
            f"{'exposed':>8} {'overlap%':>8} {'idle ms':>8} {'alloc MiB':>9} "
            f"{'rsrvd MiB':>9} {'save s':>7} {'load s':>7}")
    lines += ["", head, "-" * len(head)]
    for m in production_metrics(reports):
        lines.append(f"{m['rank']:>4} {_cell(m['tokens_per_s'], 1, 0, 9)} "
                     f"{_cell(m['mfu_pct'], width=6)} "
                     f"{_cell(m['matmul_utilization_pct'], width=9)} "
                     f"{_cell(m['all_gather_ms'], width=7)} "
                     f"{_cell(m['reduce_scatter_ms'], width=7)} "
                     f"{_cell(m['all_reduce_ms'], width=7)} "
                     f"{_cell(m['exposed_comm_ms'])} {_cell(m['overlap_pct'])} "
                     f"{_cell(m['idle_ms'])} {_cell(m['peak_allocated'], 1 / mib, 3, 9)} "
                     f"{_cell(m['peak_reserved'], 1 / mib, 3, 9)} "
                     f"{_cell(m['checkpoint_save_s'], 1, 3, 7)} "
                     f"{_cell(m['checkpoint_load_s'], 1, 3, 7)}")
    crossings = [f"rank {r.rank}: {r.memory_limit_crossing}" for r in reports
                 if r.memory_limit_crossing]
    if crossings:
        lines += ["", "memory limit crossed in " + "; ".join(crossings)]
    return "\n".join(lines)


# What each column of `summary_table` means, printed under it by the command line; chapter 8
# ("Debugging a sharded run") measures each.
TABLE_LEGEND = """\
loss: the global batch's loss at the last step (the progress bar shows rank 0's rows'
only). params, grads, optim MiB: the model states this rank holds after the last step;
peak MiB: that step's peak; sent MiB/step, colls/step: bytes sent and collectives called
per step (the ledger). Medians over the steady steps: tokens/s, this rank's; MFU %: model
FLOP/s over the GPU's datasheet peak ("-" on a CPU); mm-util %: over the matmul rate
measured at the start; AG, RS, AR ms: time in flight of all-gathers, reduce-scatters,
all-reduces; exposed: ms the loop waited on communication; overlap%: the share of it hidden
behind compute; idle ms: the part of exposed spent waiting for another rank to arrive;
alloc, rsrvd MiB: the CUDA allocator's peaks; save s, load s: checkpoint times. Chapter 8,
"Debugging a sharded run", measures each."""


def whereabouts_lines(reports: list[RunReport]) -> str:
    """One line per rank: the node and host it ran on, and its local rank there."""
    return "\n".join(f"rank {r.rank}: "
                     f"{Whereabouts(r.node, r.host, r.local_rank, r.local_world)}"
                     for r in reports)


def _plain(value):
    """JSON has no NaN, dtype, tuple or dataclass: None, a string, a list, a dict."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))  # a setting such as a SimulatedNetwork
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def report_to_json(config: Any, reports: list[RunReport]) -> dict:
    def record(r) -> dict:
        fields = r.__dict__ if hasattr(r, "__dict__") else r._asdict()
        return {k: _plain(v) for k, v in fields.items()}

    metrics = production_metrics(reports)
    steps = step_metrics(reports)
    return {"config": _plain({**config.__dict__}),
            "ranks": [{"rank": r.rank, "world": r.world, "strategy": r.strategy,
                       "placement": r.placement, "node": r.node, "host": r.host,
                       "local_rank": r.local_rank, "local_world": r.local_world,
                       "psi": r.psi, "losses": r.losses, "state_bytes": r.state_bytes,
                       "peak": r.peak, "step_times": r.step_times,
                       "metrics": _plain(m), "steps": _plain(s),
                       "collectives_per_step": ledger_totals(r),
                       "checkpoint_save_seconds": r.checkpoint_save_seconds,
                       "checkpoint_load_seconds": r.checkpoint_load_seconds,
                       "step_starts": r.step_starts, "phases": _plain(r.phases),
                       "clock_offset": r.clock_offset, "grad_norms": r.grad_norms,
                       "ledger": [record(x) for x in r.ledger]}
                      for r, m, s in zip(reports, metrics, steps)]}
