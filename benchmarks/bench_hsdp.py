"""HSDP against FSDP over all ranks as the link between "nodes" gets slower (SIMULATED).

    python benchmarks/bench_hsdp.py --world 4 --shard-group 2 --factors 1 2 4 8 16 --reps 3

One machine has one link: every rank talks to every other through shared memory. So the
"nodes" are groups of `--shard-group` consecutive ranks, and the link between them is
simulated: this machine's link is measured first (α, β fitted to all-gathers over all
ranks), then every collective of a group labelled "inter-node" sleeps, after it really
completes, the extra α-β time of its ring on a link `factor` times slower (α × factor,
β / factor; `shardlab.comm.links`). FSDP over all ranks runs on rings that span the
"nodes", as slow as their slowest hop: all its collectives are throttled. HSDP's
all-gathers and reduce-scatters stay in the shard group; only its all-reduce of the
gradient shard across the groups is throttled. What this measures is the schedule's
exposure to the slow link, not any network: on a cluster the slow link is a NIC.

For each factor the table gives the α-β model's prediction of the communication per
step (`shardlab.comm.fsdp_step_seconds`, `hsdp_step_seconds`, with this machine's fitted
link and the units' sizes read off the ledger), the ledger's measured communication
(the sum of the collectives' seconds; on gloo they do not overlap compute), the slowest
rank's median step, and the ratio FSDP / HSDP of both. HSDP's prediction has two forms:
`serial`, what these runs do (on a CPU every all-reduce returns when it is done, in the
course's `hsdp` as in PyTorch's FSDP2, whose streams are no-ops there), and `overlapped`,
each unit's all-reduce on a lane of its own beside the next units' gathers and
reduce-scatters, as PyTorch's FSDP2 runs it on GPUs (`comm.hsdp_overlap`): printed for
comparison, not measured here. The runs are interleaved: each repetition runs every
(factor, strategy) once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from shardlab import comm, workers
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.report import median_collective_time, median_step_time, unit_sizes


def step_time(reports) -> float:
    """A step is as slow as its slowest rank."""
    return max(median_step_time(r) for r in reports)


# the all-gathers this machine's link is fitted to: 4 kB to 4 MB (gpt-small's units are
# about 1 MB each)
LINK_SIZES = (2**12, 2**15, 2**18, 2**20, 2**22)


def measure_then_train(runs: list[tuple], ranks_per_node: int):
    """Worker: fit this machine's link on all-gathers of `LINK_SIZES`, then train."""
    link = workers.measure_link(LINK_SIZES)
    return workers.train_across_nodes(runs, ranks_per_node, link)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--shard-group", type=int, default=2)
    p.add_argument("--factors", type=float, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="steps per run (first and last "
                   "are left out of the timing)")
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--results", metavar="PATH", help="write the printed table as JSON")
    args = p.parse_args(argv)

    base = dict(world=args.world, model=args.model, steps=args.steps,
                batch_size=args.batch_size, seq_len=args.seq_len, measure_memory=False)
    strategies = {"fsdp2": TrainConfig(strategy="fsdp2", **base),
                  "hsdp": TrainConfig(strategy="hsdp", options={"shard_group": args.shard_group},
                                      **base)}
    for config in strategies.values():
        config.validate()
    runs, keys = [], []
    for rep in range(args.reps):
        for factor in args.factors:
            order = list(strategies) if rep % 2 == 0 else list(reversed(strategies))
            for name in order:
                runs.append((strategies[name], factor))
                keys.append((factor, name))
    ranks = launch(measure_then_train, args.world, runs, args.shard_group,
                   timeout=3600)
    fast = ranks[0][0]
    by_key: dict[tuple, list] = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append([r[1][i] for r in ranks])

    print(f"{args.model}, fp32, {args.world} gloo ranks in 'nodes' of {args.shard_group}, "
          f"{args.reps} interleaved repetitions. This machine's link (fitted): "
          f"α = {fast.alpha * 1e6:.1f} µs, β = {fast.beta / 1e9:.3f} GB/s. The inter-node "
          f"link is SIMULATED: factor × slower, by sleeping.")
    header = ("factor", "predicted comm ms FSDP / HSDP", "measured comm ms FSDP / HSDP",
              "step ms FSDP / HSDP", "FSDP / HSDP predicted", "FSDP / HSDP measured",
              "HSDP overlapped as FSDP2 on GPUs, ms")
    print(" | ".join(header))
    rows = []
    for factor in args.factors:
        slow = fast.slowed(factor)
        fsdp_runs, hsdp_runs = by_key[(factor, "fsdp2")], by_key[(factor, "hsdp")]
        pred_fsdp = comm.fsdp_step_seconds(unit_sizes(fsdp_runs[0][0]), args.world, slow)
        hsdp = comm.hsdp_step_seconds(unit_sizes(hsdp_runs[0][0]), args.world,
                                      args.shard_group, fast, slow)
        pred_hsdp = hsdp.serial  # what a CPU run does: each all-reduce blocks
        meas_fsdp = statistics.median(median_collective_time(run[0]) for run in fsdp_runs)
        meas_hsdp = statistics.median(median_collective_time(run[0]) for run in hsdp_runs)
        step_fsdp = statistics.median(step_time(run) for run in fsdp_runs)
        step_hsdp = statistics.median(step_time(run) for run in hsdp_runs)
        row = {"factor": factor, "predicted_comm_ms": [1e3 * pred_fsdp, 1e3 * pred_hsdp],
               "measured_comm_ms": [1e3 * meas_fsdp, 1e3 * meas_hsdp],
               "step_ms": [1e3 * step_fsdp, 1e3 * step_hsdp],
               "ratio_predicted": pred_fsdp / pred_hsdp, "ratio_measured": step_fsdp / step_hsdp,
               "hsdp_overlapped_ms": 1e3 * hsdp.overlapped}
        rows.append(row)
        print(f"{factor:g} | {1e3 * pred_fsdp:.1f} / {1e3 * pred_hsdp:.1f} | "
              f"{1e3 * meas_fsdp:.1f} / {1e3 * meas_hsdp:.1f} | "
              f"{1e3 * step_fsdp:.1f} / {1e3 * step_hsdp:.1f} | "
              f"{row['ratio_predicted']:.2f} | {row['ratio_measured']:.2f} | "
              f"{row['hsdp_overlapped_ms']:.1f}")
    if args.results:
        with open(args.results, "w") as f:
            json.dump({"command": "python benchmarks/bench_hsdp.py " + " ".join(
                argv if argv is not None else sys.argv[1:]),
                "alpha": fast.alpha, "beta": fast.beta, "rows": rows,
                "source": "measured by the command above"}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
