"""ZeRO-Infinity on a disk: the course's zero3 with its states on disk beside DeepSpeed's
ZeRO-Infinity, and beside zero3 in memory.

    python benchmarks/bench_infinity.py --reps 3 --steps 4

Three runs of the same model, data and precision on 2 gloo ranks, interleaved (each
repetition runs the three in turn, starting one later each time):

* `zero3`               the course's ZeRO-3, every state in memory: the losses to match
                        and the compute time the disk adds to;
* `zero3 + disk`        zero3 with offload="optimizer+params" (`shardlab.infinity`): the
                        master copy, m, v and the parameter shards in files (O_DIRECT);
* `deepspeed-zero3 + nvme`  DeepSpeed's own: offload_optimizer and offload_param with
                        device "nvme", through its async-I/O op (libaio; the op is
                        compiled on first use, minutes: `apt-get install libaio-dev`).

Each gets the same chunk: the course's `offload_buffer_numel` and DeepSpeed's
`sub_group_size` are 2^20 elements; DeepSpeed's parameter buffers hold the largest
parameter's partition (`offload_param_buffer_size`), and every parameter goes to the disk
(`offload_param_max_in_cpu` 0, `stage3_param_persistence_threshold` 0). For each run:
the slowest rank's median step (steps after the first), the bytes rank 0 read and wrote
per step as the kernel counts them (/proc/self/io: the same count for both libraries'
I/O), its peak resident memory during the steps above what it held before building the
model (VmHWM), and the largest difference of its losses from zero3's in memory. Before
the runs, the disk's read and write bandwidth is measured on both ranks at once, and the
disk tier's step is predicted from it (`shardlab.infinity_costs.step_seconds`).

Timings on a shared CPU machine vary: compare the ratios of one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardlab.deepspeed_ref.setup import deepspeed_missing
from shardlab.infinity_costs import disk_traffic, step_seconds
from shardlab.infinity_runs import disk_runs
from shardlab.launch import launch
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision

MODEL = {"n_layer": 2, "d_model": 1024, "n_head": 16}  # every weight's partition >= 1 MiB
CHUNK = 1 << 20
# DeepSpeed swaps only tensors of at least 1 MiB (MIN_AIO_BYTES,
# deepspeed/runtime/swap_tensor/utils.py): at d_model 1024 every weight's partition is.
# It needs a parameter buffer for every partition it holds at once: with its default of 5
# it stops on this model ("Not enough buffers 0 for swapping 1"); 8 runs.
DEEPSPEED = {"offload_optimizer": "nvme", "offload_param": "nvme",
             "sub_group_size": CHUNK, "offload_param_buffer_size": 1 << 21,
             "offload_param_buffer_count": 8, "offload_param_max_in_cpu": 0,
             "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
             "reduce_bucket_size": CHUNK,
             # DeepSpeed's linear would replace torch's for the rest of the process, and
             # every later run's arithmetic with it (see deepspeed_ref.strategies)
             "memory_efficient_linear": False}
NAMES = ("zero3", "zero3 + disk", "deepspeed-zero3 + nvme")


def deepspeed_nvme_missing() -> str | None:
    """None when DeepSpeed's nvme path can run here, else why not: DeepSpeed itself, or
    its async-I/O op, which builds only against libaio (its own check,
    `AsyncIOBuilder.is_compatible` in deepspeed/ops/op_builder/async_io.py, compiles a
    program that calls io_submit). Run in a child process: importing DeepSpeed picks its
    accelerator for good."""
    missing = deepspeed_missing()
    if missing:
        return missing
    check = ("from deepspeed.ops.op_builder.cpu import AsyncIOBuilder\n"
             "raise SystemExit(0 if AsyncIOBuilder().is_compatible() else 1)")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if done.returncode != 0:
        return ("DeepSpeed's async-I/O op cannot build here: it needs libaio's headers and "
                "library (Debian: apt-get install libaio-dev)")
    return None


def cases(folder: str, precision: str, reps: int, names=NAMES) -> list[dict]:
    base = dict(model="gpt-tiny", model_config=MODEL, precision=precision, batch_size=8,
                seq_len=32)
    runs = {"zero3": dict(base),
            "zero3 + disk": dict(base, options={"offload": "optimizer+params",
                                                "offload_dir": folder,
                                                "offload_buffer_numel": CHUNK}),
            "deepspeed-zero3 + nvme": dict(base, strategy="deepspeed-zero3",
                                           options={**DEEPSPEED, "nvme_path": folder})}
    out = []
    for rep in range(reps):  # interleaved, each repetition starting one later
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            out.append(dict(runs[name], name=name, rep=rep))
    return out


def summarize(ranks: list[dict], precision: str) -> dict:
    runs = list(zip(*(rank["runs"] for rank in ranks)))  # per case: every rank's result
    reference = next(r[0]["losses"] for r in runs if r[0]["case"]["name"] == "zero3")
    rows = {}
    for name in NAMES:
        mine = [r for r in runs if r[0]["case"]["name"] == name]
        if not mine:
            continue
        failed = next((r[0]["error"] for r in mine if r[0]["error"]), None)
        if failed:
            rows[name] = {"error": failed}
            continue
        steps = [max(statistics.median(rank["step_seconds"][1:]) for rank in r) for r in mine]
        io = [step for r in mine for step in r[0]["io"][1:]]
        rows[name] = {
            "step_ms": round(1e3 * statistics.median(steps), 1),
            "min_ms": round(1e3 * min(steps), 1), "max_ms": round(1e3 * max(steps), 1),
            "read_mib_per_step": round(statistics.median(s["read"] for s in io) / 2**20, 1),
            "written_mib_per_step": round(statistics.median(s["written"] for s in io) / 2**20, 1),
            "peak_mib": round(max(rank["peak_above_start"] for r in mine for rank in r)
                              / 2**20, 1),
            "max_loss_diff": max(abs(a - b) for r in mine
                                 for a, b in zip(r[0]["losses"], reference)),
        }
    ours = rows["zero3 + disk"]
    for row in rows.values():
        if "step_ms" in row and "step_ms" in ours:
            row["ratio"] = round(row["step_ms"] / ours["step_ms"], 2)
    disk = next(r[0] for r in runs if r[0]["case"]["name"] == "zero3 + disk")
    bandwidth = {k: min(rank["bandwidth"][k] for rank in ranks) for k in ("read", "write")}
    traffic = disk_traffic(disk["shards"], get_precision(precision),
                           optimizer_spec("adamw", 1e-3), "optimizer+params", CHUNK)
    # the first unit of a step, the root (embeddings and the last norm), is read before
    # anything computes
    first = disk["shards"][-1][0] * get_precision(precision).param_dtype.itemsize
    predicted = step_seconds(rows["zero3"]["step_ms"] / 1e3, traffic, bandwidth["read"],
                             bandwidth["write"], first_read=first)
    model = {"bandwidth_mb_s": {k: round(v / 1e6) for k, v in bandwidth.items()},
             "predicted_step_ms": round(1e3 * predicted["step"], 1),
             "predicted_efficiency": round(predicted["efficiency"], 2),
             "measured_efficiency": round(rows["zero3"]["step_ms"] / ours["step_ms"], 2),
             "formula_read_mib": round((traffic["gathers read"] + traffic["step read"]) / 2**20, 1),
             "formula_written_mib": round(traffic["step written"] / 2**20, 1),
             "psi": disk["psi"]}
    return {"rows": rows, "model": model}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "fp32"])
    p.add_argument("--folder", default=None,
                   help="a folder on the disk to hold the states (default: a temporary "
                        "folder in the current directory)")
    p.add_argument("--results", default=None, help="write the table as JSON here")
    args = p.parse_args(argv)
    names, why_not = NAMES, deepspeed_nvme_missing()
    if why_not:
        names = NAMES[:2]
        print(f"deepspeed-zero3 + nvme left out: {why_not}")
    with tempfile.TemporaryDirectory(dir=args.folder or ".") as folder:
        ranks = launch(disk_runs, 2, cases(folder, args.precision, args.reps, names),
                       steps=args.steps, bandwidth={"root": folder, "nbytes": 256 << 20},
                       backend="gloo", timeout=3600)
    out = summarize(ranks, args.precision)
    print(f"gpt {MODEL}, Ψ = {out['model']['psi']:,}, {args.precision}, 2 gloo ranks, "
          f"{args.reps} interleaved repetitions of {args.steps} steps")
    print(f"{'run':<24} {'step ms (min-max)':>22} {'ratio':>6} {'read MiB':>9} "
          f"{'written MiB':>12} {'peak MiB':>9} {'loss diff':>10}")
    for name, row in out["rows"].items():
        if "error" in row:
            print(f"{name:<24} failed: {row['error']}")
            continue
        print(f"{name:<24} {row['step_ms']:>8.1f} ({row['min_ms']:.0f}-{row['max_ms']:.0f})"
              f"{'':>3} {row.get('ratio', float('nan')):>6.2f} {row['read_mib_per_step']:>9.1f} "
              f"{row['written_mib_per_step']:>12.1f} {row['peak_mib']:>9.1f} "
              f"{row['max_loss_diff']:>10.2e}")
    m = out["model"]
    print(f"disk: read {m['bandwidth_mb_s']['read']} MB/s, write "
          f"{m['bandwidth_mb_s']['write']} MB/s per rank (both ranks at once); the disk "
          f"tier's formula: {m['formula_read_mib']} MiB read, {m['formula_written_mib']} MiB "
          f"written per step; predicted step {m['predicted_step_ms']} ms (efficiency "
          f"{m['predicted_efficiency']}), measured efficiency {m['measured_efficiency']}")
    if args.results:
        command = "python benchmarks/bench_infinity.py " + " ".join(
            sys.argv[1:] if argv is None else argv)
        data = {"benchmark": "bench_infinity", "command": command,
                "setup": {"model_config": MODEL, "psi": m["psi"], "precision": args.precision,
                          "world": 2, "batch": [8, 32], "steps": args.steps,
                          "reps": args.reps, "chunk": CHUNK, "deepspeed": DEEPSPEED},
                **out, "deepspeed_left_out": why_not, "source": "benchmarks/bench_infinity.py"}
        Path(args.results).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
