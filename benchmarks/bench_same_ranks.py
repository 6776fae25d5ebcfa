"""Strategies side by side in the same ranks, taking turns step by step.

    python benchmarks/bench_same_ranks.py --worlds 2 4 --strategies ddp torch-ddp
    python benchmarks/bench_same_ranks.py --worlds 2 4 --rounds 60 --strategies ddp torch-ddp \\
        --option ddp:bucket_mb=4 --option torch-ddp:bucket_mb=4 \\
        --results benchmarks/results/same-ranks-1m-buckets.json

`bench_strategies.py` runs each strategy in processes of its own, one launch after the
other. On a 2-core machine shared by 4 ranks a launch's median step moves by tens of
percent from one launch to the next (the min-max columns of its tables), more than two
implementations of the same idea differ by. Here every strategy is built in the same ranks, each on its own
copy of the model (same seed), and they take turns: round k runs one optimizer step of
each, in an order that rotates and reverses from one round to the next, with a barrier
before each step, so that every step starts with the ranks together and nothing of the
step before still in flight. A step's time is its slowest rank's. A ratio is the median
over rounds of ours / theirs within one round: two steps a fraction of a second apart see
the same machine, so the ratio resolves a percent where separate launches resolve ten.

The strategies share the process: its allocator, caches and process group. What one frees
the next may reuse, which is why the order rotates. Both sides of a pair train on the same
batches, so their losses agree to float rounding; the table prints the largest difference
as the check that the two did the same work. The first `--warmup` rounds are left out. No
memory tracking and no ledger: `bench_strategies.py` measures those.

Each step's CPU time is recorded too: the CPU seconds the step took in every rank's process
(`time.process_time`, gloo's threads included: ProcessGroupGloo runs its collectives on
worker threads of the rank's own process, `threads_` and `runLoop` in
torch/csrc/distributed/c10d/ProcessGroupGloo.hpp), summed over the ranks: the work a step
costs the machine. Where the ranks are at least as many as the cores, the cores are busy
for most of a step, and its wall time is not much more than this sum over the cores; a
ratio of CPU times below 1 says ours did less work, whichever of the two finished first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from bench_strategies import add_run_arguments, parse_options, reference_of, write_results
from shardlab.cards import CARDS
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.launch.devices import rank_device
from shardlab.step import train_step
from shardlab.train import MicroBatches, build_and_wrap, loss_of


def turn_order(names: list[str], round_: int) -> list[str]:
    """Round k's order: the names rotated by k // 2, reversed in odd rounds, so that over
    2N rounds each strategy goes first twice and runs before each other as often as after
    it. (Rotating by k and reversing odd rounds cancels out for an even N: with two
    strategies the first would lead every round.)"""
    k = round_ // 2 % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if round_ % 2 else order


def same_ranks_worker(configs: dict[str, TrainConfig], rounds: int
                      ) -> dict[str, dict[str, list[float]]] | None:
    """Rank: build every strategy, run `rounds` rounds of one step each; return (on rank 0)
    each strategy's step times (the slowest rank's, seconds) and rank 0's losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    wrapped = {name: build_and_wrap(config, world, device)[0]
               for name, config in configs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    losses: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(rounds):
        for name in turn_order(list(configs), round_):
            config = configs[name]
            batches = MicroBatches(config, round_, rank, world, device)  # read in the step
            scaled = loss_of(config, round_, world)
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = train_step(wrapped[name], batches, scaled)
            if device.type == "cuda":  # the step is over when the GPU's queue is
                torch.cuda.synchronize(device)
            seconds[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu_start)
            losses[name].append(float(loss))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (seconds, cpu))
    if rank:
        return None
    return {name: {"seconds": [max(s[name][i] for s, _ in everyone) for i in range(rounds)],
                   "cpu_seconds": [sum(c[name][i] for _, c in everyone)
                                   for i in range(rounds)],
                   "losses": losses[name]}
            for name in configs}


def ratio_quartiles(ours: list[float], theirs: list[float]) -> list[float]:
    """The rounds' ratios ours / theirs, paired round by round: [q1, median, q3]."""
    return statistics.quantiles([a / b for a, b in zip(ours, theirs)], n=4)


def rows_of(measured: dict[str, dict[str, list[float]]], references: dict[str, str | None],
            warmup: int) -> dict[str, dict]:
    """One world's table (ms to 0.1, ratios to 0.01): each strategy's median step and median
    CPU time (all ranks) over the rounds after `warmup`; against its reference, the median
    of the rounds' ratios of each with their quartiles, and the largest difference of rank
    0's losses over all rounds."""
    rows = {}
    for name, got in measured.items():
        timed, cpu = got["seconds"][warmup:], got["cpu_seconds"][warmup:]
        ref = references.get(name)
        row = {"step_ms": round(1e3 * statistics.median(timed), 1),
               "cpu_ms": round(1e3 * statistics.median(cpu), 1),
               "reference": ref if ref in measured else None,
               "ratio": None, "ratio_q1": None, "ratio_q3": None,
               "cpu_ratio": None, "cpu_ratio_q1": None, "cpu_ratio_q3": None,
               "loss_diff": None}
        if row["reference"]:
            theirs = measured[ref]
            q1, median, q3 = ratio_quartiles(timed, theirs["seconds"][warmup:])
            c1, cpu_median, c3 = ratio_quartiles(cpu, theirs["cpu_seconds"][warmup:])
            apart = max(abs(a - b) for a, b in zip(got["losses"], theirs["losses"]))
            row.update(ratio=round(median, 2), ratio_q1=round(q1, 2), ratio_q3=round(q3, 2),
                       cpu_ratio=round(cpu_median, 2), cpu_ratio_q1=round(c1, 2),
                       cpu_ratio_q3=round(c3, 2), loss_diff=float(f"{apart:.1e}"))
        rows[name] = row
    return rows


def print_table(title: str, rows: dict[str, dict]) -> None:
    print(f"\n{title}")
    head = (f"{'strategy':<16} {'step ms':>8} {'reference':>16} {'ratio':>6} "
            f"{'quartiles':>10} {'CPU ms':>8} {'ratio':>6} {'quartiles':>10} "
            f"{'largest loss difference':>24}")
    print(head)
    print("-" * len(head))
    for name, r in rows.items():
        if r["reference"] is None:
            ratio = quartiles = cpu_ratio = cpu_quartiles = loss_diff = "-"
        else:
            ratio, loss_diff = f"{r['ratio']:.2f}", f"{r['loss_diff']:.1e}"
            quartiles = f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}"
            cpu_ratio = f"{r['cpu_ratio']:.2f}"
            cpu_quartiles = f"{r['cpu_ratio_q1']:.2f}-{r['cpu_ratio_q3']:.2f}"
        print(f"{name:<16} {r['step_ms']:>8.1f} {r['reference'] or '-':>16} {ratio:>6} "
              f"{quartiles:>10} {r['cpu_ms']:>8.1f} {cpu_ratio:>6} {cpu_quartiles:>10} "
              f"{loss_diff:>24}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2], metavar="N")
    p.add_argument("--strategies", nargs="+", default=["ddp", "torch-ddp"],
                   choices=sorted(CARDS))
    p.add_argument("--rounds", type=int, default=40,
                   help="rounds of one step of every strategy (default 40)")
    p.add_argument("--warmup", type=int, default=5,
                   help="rounds at the start left out of the timing (default 5)")
    add_run_arguments(p)
    p.add_argument("--results", metavar="PATH",
                   help="write the printed tables as JSON (benchmarks/results/*.json: the "
                        "files the README's tables are checked against)")
    args = p.parse_args(argv)
    if len(set(args.strategies)) != len(args.strategies) or len(args.strategies) < 2:
        raise SystemExit(f"--strategies takes two or more different strategies, got "
                         f"{args.strategies}")
    if not 0 <= args.warmup <= args.rounds - 4:
        raise SystemExit(f"--warmup must leave at least 4 timed rounds (the quartiles "
                         f"need them): between 0 and --rounds - 4 = {args.rounds - 4}, "
                         f"got {args.warmup}")

    options = parse_options(args.option)
    references = {s: reference_of(s, args.against) for s in args.strategies}
    load = {"start": [round(x, 2) for x in os.getloadavg()]}
    tables = {}
    for world in args.worlds:
        base = TrainConfig(world=world, model=args.model, precision=args.precision,
                           steps=args.rounds, batch_size=args.batch_size,
                           seq_len=args.seq_len, measure_memory=False, record_ledger=False)
        configs = {s: replace(base, strategy=s, options=options.get(s, {}))
                   for s in args.strategies}
        for config in configs.values():
            config.validate()
        measured = launch(same_ranks_worker, world, configs, args.rounds,
                          backend=args.backend)[0]
        tables[world] = rows_of(measured, references, args.warmup)
        print_table(f"{args.model}, {args.precision}, world {world}, batch "
                    f"{args.batch_size} x {args.seq_len}, {args.rounds} rounds "
                    f"({args.warmup} warm-up), every strategy in the same ranks",
                    tables[world])
    load["end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"\nload average (1, 5, 15 min) at the start {load['start']}, at the end "
          f"{load['end']}, on {os.cpu_count()} cores")
    if args.results:
        setup = {"model": args.model, "precision": args.precision,
                 "batch": [args.batch_size, args.seq_len], "rounds": args.rounds,
                 "warmup": args.warmup, "against": args.against,
                 "cores": os.cpu_count(), "load_average": load}
        command = " ".join(["python benchmarks/bench_same_ranks.py",
                            *(sys.argv[1:] if argv is None else argv)])
        write_results(args.results, {"benchmark": "bench_same_ranks", "command": command,
                                     "setup": setup,
                                     "worlds": {str(w): {"rows": t}
                                                for w, t in tables.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
