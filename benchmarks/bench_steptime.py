"""Predict the step, then measure it: the step-time model against runs of every strategy.

    python benchmarks/bench_steptime.py --worlds 2 4 --reps 3 \
        --results benchmarks/results/steptime.json
    python benchmarks/bench_steptime.py --trace traces      # one profiled step each

For each world size, each repetition is one launch that first measures the machine as the
model sees it (`shardlab.workers.measure_machine`: the rate of each model's own forward and
backward, no communication, AdamW's costs per element, per tensor and per DTensor, how much
of an all-reduce compute hides, α and β, each kind of collective's cost inside a step, and
each strategy's own work per parameter tensor, on probes of tiny Linear layers, and the
training loop's own work a step and its ledger's a collective, on a probe of its own;
micro-benchmarks only) and then trains every
(model, strategy) once, in turn, so that a noisy minute on a shared machine hits them
alike. The prediction (`shardlab.steptime.predict_step`) is made from that repetition's
machine and the strategy's rules alone, before its run; the measured step is the slowest
rank's median step, the exposed communication the ranks' mean of the run report's.
A strategy's figures are medians over repetitions. The same runs are also predicted by the
plain model, without the parts `shardlab.stepparts` and `shardlab.probes` measure (AdamW
priced per element alone, as one flat tensor costs; each collective at its α-β time alone;
no work of the strategy's or the loop's own): the "plain" error
beside the parts' error.

Where a prediction misses by more than 20%, the line says which term is off most:
compute (predicted 6ΨT/F and the optimizer, against the measured step less its exposed
communication), exposed communication, or gloo's copies (the collectives' predicted time,
from each kind's in-step micro-benchmark, against their measured time in flight inside the
step, where their copies share the cores with compute); and how much of a communication
term is idle time, one rank waiting for another to arrive.

Then how cost grows with Ψ and N (bytes sent against 2Ψ(N-1)/N and 3Ψ(N-1)/N, step and
exposed time), and the tokens per rank above which the model says compute hides the
communication (`--trace`: the predicted timeline beside the profiled one, a figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

from shardlab import viz
from shardlab.cards import CARDS
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.models import build_model
from shardlab.report import ledger_totals, median_step_time, production_metrics
from shardlab.steptime import predict_step
from shardlab.train import train_many
from shardlab.workers import measure_machine, run_all

# the strategies of the results file (any strategy whose card has a schedule can run)
STRATEGIES = ["ddp", "torch-ddp", "zero1", "torch-zero1", "zero2", "zero3", "fsdp2",
              "torch-fsdp2"]
# three sizes of the course's GPT and a held-out Llama: {label: (model, config)}
MODELS = {"gpt-tiny": ("gpt-tiny", None),
          "gpt-mid": ("gpt-small", {"n_layer": 2, "d_model": 128}),
          "gpt-small": ("gpt-small", None),
          # held out: the model was never developed on it (Hugging Face's Llama, from a
          # config: 2 layers of width 64, grouped-query attention, SwiGLU, RMSNorm)
          "hf-llama": ("hf-llama", None)}
TARGET = 0.20
# steps left out at the start of each run: a fresh process's first steps fault in the
# pages of their buffers (`report.median_step_time`)
WARMUP = 3


def configs(world: int, args) -> list[TrainConfig]:
    base = TrainConfig(world=world, steps=args.steps, batch_size=args.batch_size,
                       seq_len=args.seq_len, measure_memory=False)
    return [replace(base, strategy=s, model=name, model_config=config)
            for label, (name, config) in MODELS.items() for s in args.strategies]


def choose_models(labels: list[str]) -> None:
    """Keep the models named (`--models`), in MODELS' order."""
    for label in list(MODELS):
        if label not in labels:
            del MODELS[label]


def measured(reports) -> dict:
    """The run's step (slowest rank), exposed and in-flight communication (ranks' mean),
    seconds, and the bytes rank 0 sends per step."""
    metrics = production_metrics(reports)
    return {"step": max(median_step_time(r, WARMUP) for r in reports),
            "exposed": statistics.mean(m["exposed_comm_ms"] for m in metrics) / 1e3,
            "comm": statistics.mean(m["comm_ms"] for m in metrics) / 1e3,
            "idle": statistics.mean(m["idle_ms"] for m in metrics) / 1e3,
            "sent": ledger_totals(reports[0])["sent_bytes"],
            # a share of the measured matmul rate, not MFU (no datasheet peak on a CPU)
            "matmul_utilization": statistics.mean(m["matmul_utilization_pct"]
                                                  for m in metrics)}


def predicted(strategy: str, label: str, world: int, machine, args) -> dict:
    name, config = MODELS[label]
    model = build_model(name, 0, config)
    tokens = args.batch_size // world * args.seq_len
    step = predict_step(strategy, model, world, {}, machine, tokens=tokens)
    # the plain model: AdamW per element only, as one flat tensor costs, each collective
    # at its α-β time alone, and no work of the strategy's or the loop's own
    plain = predict_step(strategy, model, world, {}, replace(
        machine, adam_tensor_seconds=0.0, dtensor_tensor_seconds=0.0, in_step={},
        strategy_work={}, unit_work={}, loop_seconds=0.0, ledger_seconds=0.0),
        tokens=tokens)
    return {"step": step.step_seconds, "exposed": step.exposed_seconds,
            "comm": step.comm_seconds, "compute": step.compute_seconds,
            "optimizer": step.compute["step"], "sent": step.sent_bytes,
            "strategy_work": step.compute.get("strategy", 0.0),
            "loop": step.compute.get("loop", 0.0),
            "step_plain": plain.step_seconds}


def off_term(p: dict, m: dict) -> str:
    """The term whose prediction is furthest from the run, in ms."""
    terms = {"compute": (p["compute"], m["step"] - m["exposed"]),
             "exposed communication": (p["exposed"], m["exposed"]),
             "gloo's copies": (p["comm"], m["comm"])}
    name, (pred, meas) = max(terms.items(), key=lambda kv: abs(kv[1][0] - kv[1][1]))
    note = f"{name} off: predicted {1e3 * pred:.1f} ms, measured {1e3 * meas:.1f} ms"
    if name != "compute" and m.get("idle", 0) > 0.25 * m["exposed"]:
        # the model has the ranks arrive together; the report's idle time says they did not
        note += f" ({1e3 * m['idle']:.1f} ms of it idle: ranks arriving apart)"
    return note


def sweep(world: int, args) -> dict:
    """{(label, strategy): {"predicted": [...], "measured": [...]}} over repetitions, and
    the machines measured."""
    rows: dict = {}
    machines = []
    runs = configs(world, args)
    for rep in range(args.reps):
        out = launch(run_all, world, [(measure_machine, (MODELS, args.batch_size,
                                                         args.seq_len, 5, args.strategies)),
                                      (train_many, (runs,))])
        machine = out[0][0]
        machines.append(machine)
        for i, config in enumerate(runs):
            label = next(k for k, v in MODELS.items()
                         if v == (config.model, config.model_config))
            row = rows.setdefault((label, config.strategy), {"predicted": [], "measured": []})
            row["predicted"].append(predicted(config.strategy, label, world, machine[label],
                                              args))
            row["measured"].append(measured([o[1][i] for o in out]))
        print(f"world {world}: repetition {rep + 1}/{args.reps} done", file=sys.stderr)
    return {"rows": rows, "machines": machines}


def median_of(samples: list[dict]) -> dict:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def table(world: int, result: dict, args) -> list[dict]:
    m0 = result["machines"][0][list(MODELS)[-1]]
    print(f"\nworld {world}: α {1e6 * m0.alpha:.0f} µs, β {m0.beta / 1e9:.2f} GB/s, "
          f"hiding {m0.hiding:.2f}, AdamW {1e9 * m0.adam_seconds:.1f} ns/param + "
          f"{1e6 * m0.adam_tensor_seconds:.1f} µs/tensor + "
          f"{1e6 * m0.dtensor_tensor_seconds:.1f} µs/DTensor, inside a step "
          + ", ".join(f"{k} {1e6 * c.fixed:.0f} µs + {1e9 * c.per_byte:.2f} ns/B"
                      for k, c in m0.in_step.items())
          + "; the strategies' own work per tensor: "
          + ", ".join(f"{k} {1e6 * w:.0f} µs" for k, w in m0.strategy_work.items()
                      if k in args.strategies)
          + "; per unit past the first: "
          + ", ".join(f"{k} {1e6 * w:.0f} µs" for k, w in m0.unit_work.items()
                      if k in args.strategies)
          + f"; the loop {1e6 * m0.loop_seconds:.0f} µs a step + "
          f"{1e6 * m0.ledger_seconds:.0f} µs a collective (its ledger); compute "
          + ", ".join(f"{k} {r[k].flops / 1e9:.1f}" for r in result["machines"][:1]
                      for k in MODELS) + " GFLOP/s per rank (repetition 1)")
    head = (f"{'model':<10} {'strategy':<12} {'plain':>6} {'pred ms':>8} {'meas ms':>8} {'ratio':>6} "
            f"{'pred exp':>9} {'meas exp':>9} {'ratio':>6} {'mm-util %':>9}  term off")
    print(head)
    print("-" * len(head))
    out = []
    for (label, strategy), row in result["rows"].items():
        p, m = median_of(row["predicted"]), median_of(row["measured"])
        ratio = p["step"] / m["step"]
        plain_ratio = p["step_plain"] / m["step"]
        exp_ratio = p["exposed"] / m["exposed"] if m["exposed"] > 0 else float("nan")
        note = off_term(p, m) if abs(ratio - 1) > TARGET else ""
        print(f"{label:<10} {strategy:<12} {plain_ratio:>6.2f} "
              f"{1e3 * p['step']:>8.1f} {1e3 * m['step']:>8.1f} "
              f"{ratio:>6.2f} {1e3 * p['exposed']:>9.1f} {1e3 * m['exposed']:>9.1f} "
              f"{exp_ratio:>6.2f} {m['matmul_utilization']:>9.1f}  {note}")
        out.append({"world": world, "model": label, "strategy": strategy,
                    "psi": sum(q.numel() for q in build_model(
                        MODELS[label][0], 0, MODELS[label][1]).parameters()),
                    "predicted": {k: round(v, 6) for k, v in p.items()},
                    "measured": {k: round(v, 6) for k, v in m.items()},
                    "step_ratio": round(ratio, 3), "exposed_ratio": round(exp_ratio, 3),
                    # each repetition's own ratio, for the spread over repetitions
                    "step_ratio_reps": [round(pr["step"] / mr["step"], 3) for pr, mr in
                                        zip(row["predicted"], row["measured"])],
                    "plain_ratio": round(plain_ratio, 3),
                    "term_off": note or None})
    return out


def errors_by_strategy(rows: list[dict], key: str = "step_ratio") -> dict:
    """{strategy: {world: median |predicted/measured - 1| over the model sizes}}"""
    out: dict = {}
    for r in rows:
        out.setdefault(r["strategy"], {}).setdefault(r["world"], []).append(
            abs(r[key] - 1))
    return {s: {w: round(statistics.median(v), 3) for w, v in ws.items()}
            for s, ws in out.items()}


def error_spread(rows: list[dict]) -> dict:
    """{strategy: {world: (least, most)}}: each repetition's median error over the model
    sizes, the least and the most of them (how much one repetition's verdict can move)."""
    out: dict = {}
    for r in rows:
        out.setdefault(r["strategy"], {}).setdefault(r["world"], []).append(
            [abs(x - 1) for x in r["step_ratio_reps"]])
    return {s: {w: (round(min(map(statistics.median, zip(*v))), 3),
                    round(max(map(statistics.median, zip(*v))), 3))
                for w, v in ws.items()} for s, ws in out.items()}


def growth(rows: list[dict], worlds: list[int]) -> None:
    """How step time, bytes sent and exposed time grow with Ψ and N, beside the model."""
    print("\nhow cost grows: bytes sent per step / Ψ·4·(N-1)/N (the model: 2 for DDP and "
          "ZeRO-1/2, 3 for ZeRO-3/FSDP2; more where gloo or PyTorch add collectives)")
    print(f"{'strategy':<12} " + " ".join(f"{m + ' N=' + str(w):>18}" for w in worlds
                                          for m in MODELS))
    for s in {r["strategy"]: None for r in rows}:
        cells = []
        for w in worlds:
            for label in MODELS:
                r = next(x for x in rows if (x["strategy"], x["world"], x["model"])
                         == (s, w, label))
                factor = r["measured"]["sent"] / (r["psi"] * 4 * (w - 1) / w)
                cells.append(f"{factor:>6.2f} {1e3 * r['measured']['step']:>5.0f}"
                             f"/{1e3 * r['measured']['exposed']:>4.0f}ms")
        print(f"{s:<12} " + " ".join(f"{c:>18}" for c in cells))
    print("(each cell: sent factor, measured step / exposed ms)")


def hide_threshold(world: int, machine, strategy: str, label: str) -> float:
    """Tokens per rank from which the backward's 4ΨT/F covers the step's communication
    (the model's crossover: above it, a perfect overlap hides everything)."""
    name, config = MODELS[label]
    step = predict_step(strategy, build_model(name, 0, config), world, {}, machine, tokens=1)
    return step.comm_seconds * machine.flops / (4 * sum(
        p.numel() for p in build_model(name, 0, config).parameters()))


def trace(folder: str, args) -> None:
    """One profiled step per strategy (gpt-small, world 2): Chrome traces in
    FOLDER/STRATEGY/rankR.json, and FOLDER/timelines.png, the predicted timeline beside
    the profiled one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    world = 2
    label = "gpt-small"
    runs = [replace(c, profile_dir=str(Path(folder) / c.strategy), steps=4)
            for c in configs(world, args) if c.model == MODELS[label][0]
            and c.model_config is None]
    out = launch(run_all, world, [(measure_machine, ({label: MODELS[label]},
                                                     args.batch_size, args.seq_len, 5,
                                                     args.strategies)),
                                  (train_many, (runs,))])
    machine = out[0][0][label]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.5 * len(runs)), squeeze=False)
    for ax, config in zip(axes[:, 0], runs):
        step = predict_step(config.strategy, build_model(config.model, 0, config.model_config),
                            world, {}, machine,
                            tokens=args.batch_size // world * args.seq_len)
        viz.predicted_beside_profiled(
            ax, step.timeline(), viz.profiled_spans(Path(config.profile_dir) / "rank0.json"),
            title=config.strategy)
    axes[-1, 0].set_xlabel("ms from the step's start (rank 0; red: collectives)")
    plt.tight_layout()
    fig.savefig(Path(folder) / "timelines.png", dpi=120)
    print(f"traces in {folder}/STRATEGY/rank0.json ... (open in ui.perfetto.dev or "
          f"chrome://tracing); the figure in {folder}/timelines.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--strategies", nargs="+", default=STRATEGIES,
                   choices=sorted(n for n, c in CARDS.items()
                                  if c.schedule is not None and not c.one_process))
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS),
                   help="the model sizes to run (default: all three)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="steps per run (the first "
                   f"{WARMUP} and the last "
                   "left out of the timing)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--results", metavar="PATH", help="write the rows as JSON "
                   "(benchmarks/results/steptime.json: the chapter's figure reads it)")
    p.add_argument("--trace", metavar="DIR", help="instead: one profiled step per strategy, "
                   "Chrome traces and the predicted timeline beside the profiled one")
    args = p.parse_args(argv)
    if args.trace:
        trace(args.trace, args)
        return 0
    choose_models(args.models)
    # what else ran: a shared machine's load slows the runs and the micro-benchmarks alike,
    # but not always at the same moments
    load = {"start": [round(x, 2) for x in os.getloadavg()]}
    rows, machines, first_machine = [], {}, {}
    for world in args.worlds:
        result = sweep(world, args)
        rows += table(world, result, args)
        machines[world] = [{k: asdict(m) for k, m in ms.items()} for ms in result["machines"]]
        first_machine[world] = result["machines"][0][list(MODELS)[-1]]
    load["end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average (1, 5, 15 min) at the start {load['start']}, at the end "
          f"{load['end']}")
    errors = errors_by_strategy(rows)
    plain = errors_by_strategy(rows, "plain_ratio")
    spread = error_spread(rows)
    print("\nmedian |predicted / measured - 1| of the step, over the model sizes "
          "(in brackets: the same runs, the plain model: AdamW as one flat tensor, "
          "collectives at their α-β time alone, no work of the strategy's or the loop's own; "
          "then the "
          "least and the most of the repetitions' own medians):")
    for s, ws in errors.items():
        print(f"  {s:<12} " + "  ".join(
            f"world {w}: {100 * e:.0f}% ({100 * plain[s][w]:.0f}%) "
            f"[{100 * spread[s][w][0]:.0f}-{100 * spread[s][w][1]:.0f}%]"
            f"{' (misses 20%)' if e > TARGET else ''}" for w, e in ws.items()))
    growth(rows, args.worlds)
    print("\ntokens per rank from which backward covers the step's communication "
          f"(the model, repetition 1's machine, {list(MODELS)[-1]}):")
    for world in args.worlds:
        print(f"  world {world}: " + ", ".join(
            f"{s} {hide_threshold(world, first_machine[world], s, list(MODELS)[-1]):,.0f}"
            for s in args.strategies)
            + f"   (runs here: {args.batch_size // world * args.seq_len})")
    if args.results:
        Path(args.results).write_text(json.dumps({
            "benchmark": "bench_steptime",
            "command": " ".join(["python benchmarks/bench_steptime.py",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "setup": {"models": {k: [v[0], v[1]] for k, v in MODELS.items()},
                      "batch": [args.batch_size, args.seq_len], "steps": args.steps,
                      "reps": args.reps, "worlds": args.worlds},
            "machines": {str(w): m for w, m in machines.items()},
            "load_average": load,
            "median_error": {s: {str(w): e for w, e in ws.items()}
                             for s, ws in errors.items()},
            "median_error_plain": {s: {str(w): e for w, e in ws.items()}
                                   for s, ws in plain.items()},
            "median_error_spread": {s: {str(w): list(e) for w, e in ws.items()}
                                    for s, ws in spread.items()},
            "rows": rows, "source": "measured by the command above"}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
