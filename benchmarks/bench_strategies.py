"""Strategies side by side: same model, data and world size, interleaved, repeated.

    python benchmarks/bench_strategies.py --world 2 --strategies ddp torch-ddp --reps 5

Each repetition runs every strategy once, in turn (so a slow minute on a shared machine
hits all of them alike), with memory tracking and the ledger off; the step time of a run
is the slowest rank's median step (a step ends when every rank has its gradients), and a
strategy's time is the median over repetitions. One more run per strategy, with memory
tracking and the ledger on, gives the bytes each rank holds and sends. The ratio compares
each strategy with its reference, named on its card (`shardlab.cards`): PyTorch's own
implementation of the same idea, or DeepSpeed's (`--against deepspeed`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

from shardlab.cards import CARDS
from shardlab.config import TrainConfig
from shardlab.report import ledger_totals, median_step_time, report_to_json
from shardlab.train import run

AGAINST = ("pytorch", "deepspeed")


def reference_of(strategy: str, against: str = "pytorch") -> str | None:
    """The implementation `strategy` is measured against, from its card: PyTorch's own
    (`reference`), or DeepSpeed's stage of the same number (`deepspeed_reference`)."""
    found = CARDS[strategy]
    return found.reference if against == "pytorch" else found.deepspeed_reference

MIB = 1024 * 1024


def step_time(reports) -> float:
    """A step is as slow as its slowest rank."""
    return max(median_step_time(r) for r in reports)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--strategies", nargs="+", default=["ddp", "torch-ddp"],
                   choices=sorted(CARDS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="steps per run (first and last "
                   "are left out of the timing)")
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--option", action="append", default=[], metavar="STRATEGY:KEY=VALUE")
    p.add_argument("--backend", default="auto")
    p.add_argument("--against", default="pytorch", choices=AGAINST,
                   help="whose implementation the ratio compares with")
    p.add_argument("--json", metavar="PATH", help="write every run's numbers as JSON")
    p.add_argument("--results", metavar="PATH",
                   help="write the printed table as JSON (benchmarks/results/*.json: the "
                        "files the README's tables are checked against)")
    args = p.parse_args(argv)

    options = parse_options(args.option)
    references = {s: reference_of(s, args.against) for s in args.strategies}
    base = TrainConfig(world=args.world, model=args.model, precision=args.precision,
                       steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                       measure_memory=False, record_ledger=False)
    configs = {s: replace(base, strategy=s, options=options.get(s, {}))
               for s in args.strategies}
    for config in configs.values():
        config.validate()

    times: dict[str, list[float]] = {s: [] for s in args.strategies}
    for rep in range(args.reps):
        for strategy, config in configs.items():
            times[strategy].append(step_time(run(config, backend=args.backend)))
        print(f"repetition {rep + 1}/{args.reps}: " + ", ".join(
            f"{s} {1e3 * t[-1]:.1f} ms" for s, t in times.items()), file=sys.stderr)
    measured = {s: run(replace(c, measure_memory=True, record_ledger=True),
                       backend=args.backend) for s, c in configs.items()}

    median = {s: statistics.median(t) for s, t in times.items()}
    psi = measured[args.strategies[0]][0].psi
    print(f"\n{args.model} ({psi:,} parameters), {args.precision}, world {args.world}, "
          f"batch {args.batch_size} x {args.seq_len}, {args.steps} steps x {args.reps} reps")
    head = (f"{'strategy':<12} {'step ms':>8} {'min-max ms':>13} {'reference':>11} "
            f"{'ratio':>6} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} "
            f"{'peak MiB':>9} {'sent MiB/step':>14}")
    print(head)
    print("-" * len(head))
    for s in args.strategies:
        ref = references.get(s)
        ratio = f"{median[s] / median[ref]:.2f}" if ref in median else "-"
        r0 = measured[s][0]
        state = r0.state_bytes
        spread = f"{1e3 * min(times[s]):.1f}-{1e3 * max(times[s]):.1f}"
        print(f"{s:<12} {1e3 * median[s]:>8.1f} {spread:>13} {ref if ref in median else '-':>11} "
              f"{ratio:>6} {state['params'] / MIB:>11.2f} {state['grads'] / MIB:>10.2f} "
              f"{state['optimizer'] / MIB:>10.2f} {r0.peak.get('total', 0) / MIB:>9.2f} "
              f"{ledger_totals(r0)['sent_bytes'] / MIB:>14.2f}")
    if args.results:
        rows = {}
        for s in args.strategies:
            ref = references.get(s)
            state, r0 = measured[s][0].state_bytes, measured[s][0]
            rows[s] = {
                "step_ms": round(1e3 * median[s], 1),
                "min_ms": round(1e3 * min(times[s]), 1),
                "max_ms": round(1e3 * max(times[s]), 1),
                "reference": ref if ref in median else None,
                "ratio": round(median[s] / median[ref], 2) if ref in median else None,
                "params_mib": round(state["params"] / MIB, 2),
                "grads_mib": round(state["grads"] / MIB, 2),
                "optimizer_mib": round(state["optimizer"] / MIB, 2),
                "peak_mib": round(r0.peak.get("total", 0) / MIB, 2),
                "sent_mib_per_step": round(ledger_totals(r0)["sent_bytes"] / MIB, 2)}
        write_results(args.results, {
            "benchmark": "bench_strategies",
            "command": " ".join(["python benchmarks/bench_strategies.py", *(argv or sys.argv[1:])]),
            "setup": {"model": args.model, "psi": psi, "precision": args.precision,
                      "world": args.world, "batch": [args.batch_size, args.seq_len],
                      "steps": args.steps, "reps": args.reps, "against": args.against},
            "rows": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times": times, "median": median,
                       "references": {s: references.get(s) for s in args.strategies},
                       "measured": {s: report_to_json(configs[s], r)
                                    for s, r in measured.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
