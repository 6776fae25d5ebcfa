"""ZeRO-1 and ZeRO-2 with the parameters' all-gather overlapped, against without (or, with
`--vary gradient_collective`, the gradients all-reduced against reduce-scattered).

    python benchmarks/bench_overlap.py --worlds 2 4 --reps 5
    python benchmarks/bench_overlap.py --vary gradient_collective --bucket-mb 4 --worlds 2 4 --reps 5

Without overlap, ZeRO-1/2 all-gather the updated parameters after the optimizer step,
with nothing to compute meanwhile: the whole step waits for it. With
`overlap_all_gather=True` (the default on NCCL; "auto" leaves it off on gloo, as this
benchmark measures why) each bucket's all-gather starts as soon as its chunk
is stepped and is waited for by the next forward, module by module.

For each world size, one launch runs every case `--reps` times, interleaved (each
repetition runs zero1 and zero2, overlap off and on, alternating which comes first), so
a noisy minute on a shared machine slows both sides of a pair alike. A run's step time
is its slowest rank's median step (steps after the first, before the last); a pair's
ratio is on / off, and the printed ratio is the median over repetitions. The exposed
communication (from the run report: time a rank waited for a collective) says where the
time went.

`--vary gradient_collective` pairs ZeRO-1/2's default reduce-scatter of each bucket's
gradients ("off") with an all-reduce of the same bucket ("on"), DeepSpeed's default: gloo
builds its reduce_scatter_tensor on an all-reduce, so there the two move the same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.report import median_step_time, production_metrics
from shardlab.train import train_many


def step_time(reports) -> float:
    """A step is as slow as its slowest rank."""
    return max(median_step_time(r) for r in reports)


def exposed_ms(reports) -> float:
    return max(m["exposed_comm_ms"] or 0.0 for m in production_metrics(reports))


# the ZeRO option a pair differs in: its value in the "off" run, and in the "on" run
VARIED = {"overlap_all_gather": (False, True),
          "gradient_collective": ("reduce-scatter", "all-reduce")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--strategies", nargs="+", default=["zero1", "zero2"],
                   choices=["zero1", "zero2"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="steps per run (first and last "
                   "are left out of the timing)")
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--bucket-mb", type=float, default=1.0,
                   help="bucket size: gpt-small's 12.4 MiB in 22 buckets (each cut before a parameter "
                        "would pass 1 MiB; 25 MB, "
                        "the default, suits models of billions of parameters: one bucket "
                        "here, and nothing to overlap)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--backend", default="auto")
    p.add_argument("--vary", default="overlap_all_gather", choices=sorted(VARIED),
                   help="the option the pairs differ in (off and on: %s)" % "; ".join(
                       f"{k} {a} and {b}" for k, (a, b) in VARIED.items()))
    p.add_argument("--json", metavar="PATH", help="write every run's numbers as JSON")
    p.add_argument("--results", metavar="PATH",
                   help="write the printed table as JSON (benchmarks/results/*.json: the "
                        "files the README's tables are checked against)")
    args = p.parse_args(argv)

    out = {}
    for world in args.worlds:
        base = TrainConfig(world=world, model=args.model, steps=args.steps,
                           batch_size=args.batch_size, seq_len=args.seq_len,
                           measure_memory=False)
        cases = []  # (rep, strategy, overlap)
        for rep in range(args.reps):
            for strategy in args.strategies:
                order = (False, True) if rep % 2 == 0 else (True, False)
                cases += [(rep, strategy, overlap) for overlap in order]
        configs = [replace(base, strategy=s, options={"bucket_mb": args.bucket_mb,
                                                      args.vary: VARIED[args.vary][on]})
                   for _, s, on in cases]
        for config in configs:
            config.validate()
        per_rank = launch(train_many, world, configs, backend=args.backend, timeout=3600)
        runs = {case: [rank[i] for rank in per_rank] for i, case in enumerate(cases)}
        print(f"\n{args.model} ({per_rank[0][0].psi:,} parameters), world {world}, "
              f"{args.bucket_mb:g} MB buckets, batch {args.batch_size} x {args.seq_len}, "
              f"{args.steps} steps x {args.reps} interleaved repetitions; "
              f"{args.vary} off = {VARIED[args.vary][0]}, on = {VARIED[args.vary][1]}")
        head = (f"{'strategy':<8} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'min-max':>11} "
                f"{'exposed off':>12} {'exposed on':>11}")
        print(head)
        print("-" * len(head))
        out[world] = {}
        for s in args.strategies:
            off = [step_time(runs[(r, s, False)]) for r in range(args.reps)]
            on = [step_time(runs[(r, s, True)]) for r in range(args.reps)]
            ratios = [a / b for a, b in zip(on, off)]
            exposed = {flag: statistics.median(exposed_ms(runs[(r, s, flag)])
                                               for r in range(args.reps))
                       for flag in (False, True)}
            ratio = statistics.median(ratios)
            print(f"{s:<8} {1e3 * statistics.median(off):>8.1f} "
                  f"{1e3 * statistics.median(on):>8.1f} {ratio:>7.2f} "
                  f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>11} "
                  f"{exposed[False]:>9.1f} ms {exposed[True]:>8.1f} ms")
            out[world][s] = {"off_s": off, "on_s": on, "ratios": ratios, "ratio": ratio,
                             "exposed_ms": {"off": exposed[False], "on": exposed[True]}}
    if args.results:
        rows = {str(world): {s: {
            "off_ms": round(1e3 * statistics.median(r["off_s"]), 1),
            "on_ms": round(1e3 * statistics.median(r["on_s"]), 1),
            "ratio": round(r["ratio"], 2),
            "ratio_min": round(min(r["ratios"]), 2), "ratio_max": round(max(r["ratios"]), 2),
            "exposed_off_ms": round(r["exposed_ms"]["off"], 1),
            "exposed_on_ms": round(r["exposed_ms"]["on"], 1)}
            for s, r in per_strategy.items()} for world, per_strategy in out.items()}
        with open(args.results, "w") as f:
            json.dump({"benchmark": "bench_overlap",
                       "command": " ".join(["python benchmarks/bench_overlap.py",
                                            *(argv or sys.argv[1:])]),
                       "setup": {"model": args.model, "bucket_mb": args.bucket_mb,
                                 "varied": args.vary, "off_on": VARIED[args.vary],
                                 "batch": [args.batch_size, args.seq_len],
                                 "steps": args.steps, "reps": args.reps},
                       "rows": rows, "source": "measured by the command above"}, f, indent=1)
            f.write("\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
