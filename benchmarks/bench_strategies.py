"""Strategies side by side: same model, data and world size, interleaved, repeated.

    python benchmarks/bench_strategies.py --world 2 --strategies ddp torch-ddp --reps 5
    python benchmarks/bench_strategies.py --worlds 2 4 --warmup 3 --steps 10 ...

Each repetition runs every strategy once, in turn (so a slow minute on a shared machine
hits all of them alike; with `--worlds`, every strategy at every world size), with memory
tracking and the ledger off; the step time of a run is the slowest rank's median step (a
step ends when every rank has its gradients) over the steps after the first `--warmup`
ones and before the last, and a strategy's time is the median over repetitions. Its ratio
to its reference is the median of the ratios within each repetition, where the two ran one
after the other (the order of the runs is reversed every other repetition): the pairs are
what interleaving makes comparable, where the medians of the two columns can come from
different moments of a shared machine. A fresh
process takes a few steps to settle: its allocator has not yet kept the pages that each
step's short-lived buffers reuse, so the first steps fault them in again (measured on
`zero2` with 2^20-element buckets, the 4 ranks' minor page faults by `getrusage`: about
31,000 and 14,000 in steps 1 and 2, 5,000 to 12,000 in each later one; DeepSpeed's stage
2, whose bucket lives for the whole run, about 7,000 and 5,000, then mostly under 2,000). One more run per strategy, with memory
tracking and the ledger on, gives the bytes each rank holds and sends. The ratio compares
each strategy with its reference, named on its card (`shardlab.cards`): PyTorch's own
implementation of the same idea, or DeepSpeed's (`--against deepspeed`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

from shardlab.cards import CARDS
from shardlab.config import TrainConfig
from shardlab.report import ledger_totals, median_step_time
from shardlab.report_output import report_to_json
from shardlab.train import run

AGAINST = ("pytorch", "deepspeed")


def reference_of(strategy: str, against: str = "pytorch") -> str | None:
    """The implementation `strategy` is measured against, from its card: PyTorch's own
    (`reference`), or DeepSpeed's stage of the same number (`deepspeed_reference`)."""
    found = CARDS[strategy]
    return found.reference if against == "pytorch" else found.deepspeed_reference

MIB = 1024 * 1024


def step_time(reports, warmup: int = 1) -> float:
    """A step is as slow as its slowest rank; a rank's step is its median over the steps
    after the first `warmup` and before the last (the one that tracks memory)."""
    return max(median_step_time(r, warmup) for r in reports)


def write_results(path: str, results: dict) -> None:
    """The table as printed (ms to 0.1, ratios and MiB to 0.01), with the command that
    produced it: the README's tables are checked against these files."""
    results = {**results, "source": "measured by the command above"}
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


def parse_options(items: list[str]) -> dict[str, dict]:
    """["ddp:bucket_mb=4", ...] -> {"ddp": {"bucket_mb": 4.0}}"""
    out: dict[str, dict] = {}
    for item in items:
        strategy, _, assignment = item.partition(":")
        key, sep, value = assignment.partition("=")
        if not sep or strategy not in CARDS:
            raise SystemExit(f"--option takes STRATEGY:KEY=VALUE with a known strategy, "
                             f"got {item!r}")
        try:
            parsed: object = float(value) if "." in value else int(value)
        except ValueError:
            parsed = {"true": True, "false": False}.get(value.lower(), value)
        out.setdefault(strategy, {})[key] = parsed
    return out


def rows_of(strategies, references, times, measured) -> dict[str, dict]:
    """One world's table as the results file keeps it (ms to 0.1, ratios and MiB to 0.01):
    a ratio is the median over repetitions of ours / theirs in the same repetition, with
    the least and the most of those ratios."""
    median = {s: statistics.median(t) for s, t in times.items()}
    rows = {}
    for s in strategies:
        ref = references.get(s)
        pairs = [a / b for a, b in zip(times[s], times[ref])] if ref in median else None
        r0 = measured[s][0]
        state = r0.state_bytes
        rows[s] = {
            "step_ms": round(1e3 * median[s], 1),
            "min_ms": round(1e3 * min(times[s]), 1),
            "max_ms": round(1e3 * max(times[s]), 1),
            "reference": ref if ref in median else None,
            "ratio": round(statistics.median(pairs), 2) if pairs else None,
            "ratio_min": round(min(pairs), 2) if pairs else None,
            "ratio_max": round(max(pairs), 2) if pairs else None,
            "params_mib": round(state["params"] / MIB, 2),
            "grads_mib": round(state["grads"] / MIB, 2),
            "optimizer_mib": round(state["optimizer"] / MIB, 2),
            "peak_mib": round(r0.peak.get("total", 0) / MIB, 2),
            "sent_mib_per_step": round(ledger_totals(r0)["sent_bytes"] / MIB, 2)}
    return rows


def print_table(title: str, rows: dict[str, dict]) -> None:
    print(f"\n{title}")
    head = (f"{'strategy':<16} {'step ms':>8} {'min-max ms':>13} {'reference':>16} "
            f"{'ratio':>6} {'min-max':>10} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} "
            f"{'peak MiB':>9} {'sent MiB/step':>14}")
    print(head)
    print("-" * len(head))
    for s, r in rows.items():
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        ratios = (f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}" if r["ratio"] is not None
                  else "-")
        spread = f"{r['min_ms']:.1f}-{r['max_ms']:.1f}"
        print(f"{s:<16} {r['step_ms']:>8.1f} {spread:>13} {r['reference'] or '-':>16} "
              f"{ratio:>6} {ratios:>10} {r['params_mib']:>11.2f} {r['grads_mib']:>10.2f} "
              f"{r['optimizer_mib']:>10.2f} {r['peak_mib']:>9.2f} "
              f"{r['sent_mib_per_step']:>14.2f}")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """What every run of a comparison shares: model, precision, batch, per-strategy
    options, backend, and whose implementation a ratio compares with."""
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--option", action="append", default=[], metavar="STRATEGY:KEY=VALUE")
    p.add_argument("--backend", default="auto")
    p.add_argument("--against", default="pytorch", choices=AGAINST,
                   help="whose implementation the ratio compares with")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--worlds", type=int, nargs="+", metavar="N",
                   help="several world sizes, interleaved in each repetition (instead of "
                        "--world); the results file then keeps a table per world")
    p.add_argument("--strategies", nargs="+", default=["ddp", "torch-ddp"],
                   choices=sorted(CARDS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="steps per run (the first "
                   "--warmup ones and the last are left out of the timing)")
    p.add_argument("--warmup", type=int, default=1,
                   help="steps at the start left out of the timing (default 1)")
    add_run_arguments(p)
    p.add_argument("--json", metavar="PATH", help="write every run's numbers as JSON")
    p.add_argument("--results", metavar="PATH",
                   help="write the printed table as JSON (benchmarks/results/*.json: the "
                        "files the README's tables are checked against)")
    args = p.parse_args(argv)
    if not 1 <= args.warmup <= args.steps - 2:
        raise SystemExit(f"--warmup must leave at least one timed step: between 1 and "
                         f"--steps - 2 = {args.steps - 2}, got {args.warmup}")

    worlds = args.worlds or [args.world]
    options = parse_options(args.option)
    references = {s: reference_of(s, args.against) for s in args.strategies}
    configs = {}
    for world in worlds:
        base = TrainConfig(world=world, model=args.model, precision=args.precision,
                           steps=args.steps, batch_size=args.batch_size,
                           seq_len=args.seq_len, measure_memory=False, record_ledger=False)
        for s in args.strategies:
            configs[world, s] = replace(base, strategy=s, options=options.get(s, {}))
    for config in configs.values():
        config.validate()

    load = {"start": [round(x, 2) for x in os.getloadavg()]}
    times: dict[tuple, list[float]] = {key: [] for key in configs}
    for rep in range(args.reps):
        in_turn = list(configs.items())
        for key, config in (in_turn if rep % 2 == 0 else in_turn[::-1]):
            times[key].append(step_time(run(config, backend=args.backend), args.warmup))
        print(f"repetition {rep + 1}/{args.reps}: " + ", ".join(
            f"{s} ({w} ranks) {1e3 * t[-1]:.1f} ms" for (w, s), t in times.items()),
            file=sys.stderr)
    measured = {key: run(replace(c, measure_memory=True, record_ledger=True),
                         backend=args.backend) for key, c in configs.items()}
    load["end"] = [round(x, 2) for x in os.getloadavg()]

    psi = measured[worlds[0], args.strategies[0]][0].psi
    tables = {}
    for world in worlds:
        tables[world] = rows_of(args.strategies, references,
                                {s: times[world, s] for s in args.strategies},
                                {s: measured[world, s] for s in args.strategies})
        print_table(f"{args.model} ({psi:,} parameters), {args.precision}, world {world}, "
                    f"batch {args.batch_size} x {args.seq_len}, {args.steps} steps "
                    f"({args.warmup} warm-up) x {args.reps} reps", tables[world])
    print(f"\nload average (1, 5, 15 min) at the start {load['start']}, at the end "
          f"{load['end']}, on {os.cpu_count()} cores")
    if args.results:
        setup = {"model": args.model, "psi": psi, "precision": args.precision,
                 "batch": [args.batch_size, args.seq_len], "steps": args.steps,
                 "warmup": args.warmup, "reps": args.reps, "against": args.against,
                 "cores": os.cpu_count(), "load_average": load}
        command = " ".join(["python benchmarks/bench_strategies.py",
                            *(argv if argv is not None else sys.argv[1:])])
        if args.worlds:
            write_results(args.results, {
                "benchmark": "bench_strategies", "command": command,
                "setup": {**setup, "worlds": worlds},
                "worlds": {str(w): {"rows": tables[w]} for w in worlds}})
        else:
            write_results(args.results, {
                "benchmark": "bench_strategies", "command": command,
                "setup": {**setup, "world": worlds[0]}, "rows": tables[worlds[0]]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{w} {s}": {"times": times[w, s], "reference": references.get(s),
                                    "measured": report_to_json(configs[w, s], r)}
                       for (w, s), r in measured.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
