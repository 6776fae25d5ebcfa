"""The items of `tools/gpu_check.py`: each measures one thing and returns plain data.

Each item runs in a process of its own (the check starts `gpu_check.py --item NAME`), gets
a deadline (seconds since the epoch) and hands what it has measured so far to `save` as it
goes, so that an item stopped at its time limit still leaves its partial results. `Sizes`
says how big each item runs: `GPU` on a GPU, `DRY` for the dry run on a CPU, which takes
every code path but CUDA's in well under a minute.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import importlib.util
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from gpu_check_overlap import overlap, synchronize
from gpu_check_runs import (MIN_LAUNCH_SECONDS, case_entry, launch_cases, now,
                            per_rank, placement)
from gpu_check import head_commit, run_command
from shardlab.cards import CARDS, DEEPSPEED, card, required_options
from shardlab.config import TrainConfig
from shardlab.deepspeed_ref.setup import deepspeed_missing
from shardlab.gpu_record import MemoryExperiment, datasheet_bf16_peak, memory_run
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.rates import compute_rate, matmul_rate

ROOT = Path(__file__).resolve().parent.parent
Save = Callable[[Any], None]


@dataclass(frozen=True)
class Sizes:
    device: str                        # "cuda", or "cpu" for the dry run
    model: str                         # strategies and step-time ratios
    steps: int
    batch_size: int                    # global
    seq_len: int
    worlds: tuple[int, ...]            # world 1 on NCCL (gloo on a CPU); more share over gloo
    strategies: tuple[str, ...] | None  # None: every strategy of the registry
    precisions: tuple[str, ...]
    rehearse_failure: bool             # one case that fails on purpose: fail-soft, checked
    memory: MemoryExperiment
    oom_attempts: int
    gemm_n: int
    overlap_bytes: int
    repeats: int
    ratio_worlds: tuple[int, ...]
    ratio_reps: int
    ratio_steps: int


GPU = Sizes("cuda", "gpt-small", 3, 8, 64, (1, 4), None, ("fp32", "bf16-mixed"), False,
            MemoryExperiment(), 3, 8192, 64 * 2**20, 5, (1, 4), 3, 6)
# The dry run: the smallest of everything, two strategies where the GPU runs them all,
# and a rehearsed failure
DRY = Sizes("cpu", "gpt-tiny", 2, 4, 16, (1, 2), ("single", "ddp"), ("fp32", "bf16-mixed"),
            True, MemoryExperiment(model="gpt-tiny", model_config=None, world=2, batch_size=4,
                                   seq_len=32, steps=2, strategies=(("ddp", 0), ("zero3", 3)),
                                   oom_cap_bytes=int(3.5 * 2**20)),
            2, 128, 2**18, 2, (2,), 2, 3)

# ours -> PyTorch's implementation of the same idea, as each strategy's card names it
REFERENCES = {name: c.reference for name, c in CARDS.items() if c.reference}


def _shares(deadline: float, parts: int) -> Callable[[int], float]:
    """The deadline of part i of `parts`: an equal share of what is left when it starts
    (a part that finishes early leaves its time to the next)."""
    return lambda i: now() + (deadline - now()) / (parts - i)


# ----------------------------------------------------------------------------- items


def env(sizes: Sizes, deadline: float, save: Save) -> dict:
    """The device, the versions, the date."""
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "platform": platform.platform(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None,
            "cpus": os.cpu_count(), "gpus": torch.cuda.device_count()
            if torch.cuda.is_available() else 0,
            "deepspeed": version("deepspeed"), "transformers": version("transformers"),
            "pytest": version("pytest"), "commit": None}
    if info["gpus"]:
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count)
        try:
            nccl = torch.cuda.nccl.version()  # a tuple; an int in older torch
            info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception:  # noqa: BLE001 - a build without NCCL
            pass
    else:
        info["name"] = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    info["commit"] = head_commit()
    return info


def gemm_rate(n: int, dtype: torch.dtype, device: torch.device, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul, after a warm-up."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def matmul(sizes: Sizes, deadline: float, save: Save) -> dict:
    """The matmul rate reached, bf16 and fp32, against the datasheet's bf16 peak; the
    rate on the model's own matmuls (a run's MFU denominator) and on its forward and
    backward (the step-time model's F), one process."""
    device = torch.device(sizes.device)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    out: dict[str, Any] = {"device": name, "gemms": [],
                           "tf32_allowed": torch.backends.cuda.matmul.allow_tf32}
    for dtype in (torch.bfloat16, torch.float32):
        out["gemms"].append({"n": sizes.gemm_n, "dtype": str(dtype).replace("torch.", ""),
                             "flops_per_s": gemm_rate(sizes.gemm_n, dtype, device)})
        save(out)
    peak, source = datasheet_bf16_peak(name)
    bf16 = out["gemms"][0]["flops_per_s"]
    out.update(datasheet_bf16_flops=peak, datasheet_source=source,
               bf16_share_of_peak=bf16 / peak if peak else None)
    model = build_model(sizes.model).to(device)
    x, y = (t.to(device) for t in get_batch(0, 0, 1, sizes.batch_size, sizes.seq_len))
    out.update(model=sizes.model, tokens=x.numel(),
               model_matmul_flops_per_s=matmul_rate(model, x.numel(), device=device),
               model_forward_backward_flops_per_s=compute_rate(model, x, y, loss_fn))
    return out


def strategy_names(sizes: Sizes) -> tuple[list[str], dict[str, str]]:
    """The strategies to run, and those not run with why (DeepSpeed may be absent)."""
    wanted = list(CARDS) if sizes.strategies is None else list(sizes.strategies)
    missing = deepspeed_missing()
    not_run = {s: missing for s in wanted if card(s).family == DEEPSPEED and missing}
    return [s for s in wanted if s not in not_run], not_run


def strategies(sizes: Sizes, deadline: float, save: Save) -> dict:
    """Every strategy at world 1 (NCCL) and on ranks sharing the GPU (gloo), fp32 and
    bf16-mixed, a few steps each."""
    names, not_run = strategy_names(sizes)
    result = {"model": sizes.model, "steps": sizes.steps, "batch_size": sizes.batch_size,
              "seq_len": sizes.seq_len, "not_run": not_run, "cases": []}
    share = _shares(deadline, len(sizes.worlds))
    for part, world in enumerate(sizes.worlds):
        cases = [({"strategy": s, "world": world, "backend": placement(world, sizes.device),
                   "precision": p},
                  TrainConfig(strategy=s, world=world, model=sizes.model, precision=p,
                              steps=sizes.steps, batch_size=sizes.batch_size,
                              seq_len=sizes.seq_len, options=required_options(s, world)))
                 for s in names if not (s == "single" and world > 1)
                 for p in sizes.precisions]
        if sizes.rehearse_failure and world > 1:  # one rank raises: the rest must go on
            meta, config = cases[0]
            cases.insert(len(cases) // 2, ({**meta, "rehearsed_failure": True},
                                           dataclasses.replace(config, crash_at_step=1,
                                                               crash_rank=world - 1)))
        outcomes = launch_cases([c for _, c in cases], world, sizes.device, share(part))
        result["cases"] += [case_entry(meta, o) for (meta, _), o in zip(cases, outcomes)]
        save(result)
    return result


def parse_junit(path: Path) -> dict[str, dict]:
    """Each test's outcome from pytest's JUnit XML: passed, failed, error or skipped,
    with the first line of its message."""
    outcomes = {}
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or child.text or "").strip().splitlines()
                message = message[0][:300] if message else ""
        outcomes[case.get("name")] = {"outcome": outcome, "message": message,
                                      "seconds": float(case.get("time") or 0)}
    return outcomes


def parse_verbose(output: str) -> dict[str, dict]:
    """Each finished test's outcome from pytest's -v lines (`path::name[id] PASSED`)."""
    outcomes = {}
    for line in output.splitlines():
        match = re.match(r"^\S+::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", line)
        if match:
            outcomes[match.group(1)] = {"outcome": match.group(2).lower(), "message": "",
                                        "seconds": None}
    return outcomes


def pytest_cuda(sizes: Sizes, deadline: float, save: Save) -> dict:
    """`pytest -m cuda tests/test_cuda.py`, in a process of its own: each test's outcome."""
    if importlib.util.find_spec("pytest") is None:
        return {"skipped": "pytest is not installed here", "outcomes": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        xml, log = Path(tmp) / "junit.xml", Path(tmp) / "pytest.log"
        command = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py",
                   "-p", "no:cacheprovider", "-v", "-rA", f"--junitxml={xml}"]
        returncode, seconds = run_command(command, deadline - now(), log, cwd=ROOT)
        output = log.read_text(errors="replace")
        # pytest writes the XML at the end; stopped before, its -v lines still say
        # which tests had finished
        source = "junit xml" if xml.exists() else "-v lines"
        outcomes = parse_junit(xml) if xml.exists() else parse_verbose(output)
        tail = output.strip().splitlines()[-15:]
    print(output)  # into the check's log, whole
    return {"command": "python -m pytest -m cuda tests/test_cuda.py", "seconds": seconds,
            "returncode": returncode, "timed_out": returncode is None,
            "outcomes_from": source,
            "counts": dict(Counter(o["outcome"] for o in outcomes.values())),
            "outcomes": outcomes, "output_tail": tail}


def _oom_attempt(sizes: Sizes, rows: int, deadline: float) -> dict:
    exp = sizes.memory
    on_gpu = sizes.device == "cuda"
    fraction = (exp.oom_cap_bytes / torch.cuda.get_device_properties(0).total_memory
                if on_gpu else None)
    config = TrainConfig(strategy=exp.oom_strategy, **{
        **exp.train_fields(), "batch_size": rows * exp.world, "steps": 2,
        "record_ledger": False, "memory_limit": None if on_gpu else exp.oom_cap_bytes})
    [outcome] = launch_cases([config], exp.world, sizes.device, deadline, fraction)
    ranks, error = outcome.get("ranks"), outcome.get("error")
    if not ranks:  # on a GPU the allocator raises; any other error ends the search
        fits = False if outcome.get("out_of_memory") else None
    else:  # a CPU has nothing to run out of: where the watch saw the step cross the cap
        crossed = [r["memory_limit_crossing"] for r in ranks if r["memory_limit_crossing"]]
        fits, error = not crossed, (crossed[0] if crossed else None)
    stage = dict(exp.strategies)[exp.oom_strategy]
    return {"rows_per_rank": rows, "fits": fits, "status": outcome["status"], "error": error,
            "peak_allocated": per_rank(ranks, "total"),
            "peak_reserved": per_rank(ranks, "reserved"),
            "predicted_total": int(exp.predicted(stage, False, rows).total)}


def oom_point(sizes: Sizes, deadline: float, save: Callable[[dict], None]) -> dict:
    """DDP's out-of-memory point under a cap per process: start at the planner's largest
    micro-batch, step up until it fails, then halve the gap; as many tries as time and
    `sizes.oom_attempts` allow."""
    exp = sizes.memory
    on_gpu = sizes.device == "cuda"
    how = ("torch.cuda.set_per_process_memory_fraction: the allocator raises past it"
           if on_gpu else "TrainConfig.memory_limit: the step's first crossing as "
                          "MemTracker counts it (a CPU has no allocator to run out)")
    oom = {"strategy": exp.oom_strategy, "world": exp.world, "cap_bytes": exp.oom_cap_bytes,
           "how": how, "seq_len": exp.seq_len, "precision": exp.precision,
           "predicted_largest": exp.predicted_largest_batch(), "attempts": [],
           "largest_fit": None, "first_failure": None}
    fit, failed = 0, None
    rows = max(1, oom["predicted_largest"])
    while len(oom["attempts"]) < sizes.oom_attempts and deadline - now() > MIN_LAUNCH_SECONDS:
        attempt = _oom_attempt(sizes, rows, deadline)
        oom["attempts"].append(attempt)
        save(oom)
        if attempt["fits"] is None:
            break
        if attempt["fits"]:
            fit = rows
        else:
            failed = rows
        oom["largest_fit"], oom["first_failure"] = fit or None, failed
        if failed is None:  # the planner's edge first, then doubling
            rows = rows + 1 if len(oom["attempts"]) == 1 else rows * 2
        elif failed - fit <= 1:
            break
        else:
            rows = (fit + failed) // 2 if fit else max(1, failed // 2)
    return oom


def memory(sizes: Sizes, deadline: float, save: Save) -> dict:
    """The memory experiment (`shardlab.gpu_record.MemoryExperiment`): each run's peaks
    beside the planner's prediction, then DDP's out-of-memory point."""
    exp = sizes.memory
    runs = exp.runs()
    result = {"experiment": {**exp.train_fields(), "strategies": [s for s, _ in exp.strategies],
                             "planner_model": exp.planner_model().name,
                             "planner_psi": exp.planner_model().num_params()},
              "runs": [], "oom": None}
    configs = [TrainConfig(strategy=r["strategy"], recompute=r["recompute"],
                           record_ledger=False, **exp.train_fields()) for r in runs]
    outcomes = launch_cases(configs, exp.world, sizes.device, now() + 0.6 * (deadline - now()))
    for run, outcome in zip(runs, outcomes):
        entry = memory_run(exp, run, outcome.get("ranks"), outcome.get("error"))
        result["runs"].append({**entry, "status": outcome["status"]})
    save(result)

    def save_oom(oom):
        save({**result, "oom": oom})

    result["oom"] = oom_point(sizes, deadline, save_oom)
    return result


def step_ratios(sizes: Sizes, deadline: float, save: Save) -> dict:
    """Step time of ours over PyTorch's, per strategy, the runs interleaved: each
    repetition runs every strategy once, in turn, the order reversed every other one."""
    names, _ = strategy_names(sizes)
    result: dict[str, Any] = {"model": sizes.model, "precision": "bf16-mixed",
                              "steps": sizes.ratio_steps, "reps": sizes.ratio_reps,
                              "worlds": {}}
    share = _shares(deadline, len(sizes.ratio_worlds))
    for part, world in enumerate(sizes.ratio_worlds):
        pairs = {ours: ref for ours, ref in REFERENCES.items()
                 if ours in names and ref in CARDS
                 # HSDP (groups that label their own links) needs replicas: 2 ranks or more
                 and not (card(ours).labels_own_links and world < 2)}
        order = list(dict.fromkeys([*pairs, *pairs.values()]))
        runs = [name for rep in range(sizes.ratio_reps)
                for name in (order if rep % 2 == 0 else order[::-1])]
        configs = [TrainConfig(strategy=s, world=world, model=sizes.model,
                               precision="bf16-mixed", steps=sizes.ratio_steps,
                               batch_size=sizes.batch_size, seq_len=sizes.seq_len,
                               options=required_options(s, world), measure_memory=False,
                               record_ledger=False) for s in runs]
        outcomes = launch_cases(configs, world, sizes.device, share(part))
        times: dict[str, list[float | None]] = {s: [] for s in order}
        errors = {}
        for s, o in zip(runs, outcomes):
            if o.get("ranks"):
                times[s].append(max(r["median_step_s"] for r in o["ranks"]))
            else:
                times[s].append(None)
                errors.setdefault(s, f"{o['status']}: {o.get('error')}")
        ratios = {}
        for ours, ref in pairs.items():
            per_rep = [a / b for a, b in zip(times[ours], times[ref]) if a and b]
            ratios[ours] = {"reference": ref, "ratio": (statistics.median(per_rep)
                                                        if per_rep else None),
                            "min": min(per_rep, default=None), "max": max(per_rep, default=None),
                            "ours_ms": _median_ms(times[ours]), "reference_ms": _median_ms(times[ref])}
        result["worlds"][str(world)] = {"backend": placement(world, sizes.device),
                                        "references": pairs, "step_seconds": times, "ratios": ratios,
                                        "errors": errors}
        save(result)
    return result


def _median_ms(values: list[float | None]) -> float | None:
    values = [v for v in values if v]
    return 1e3 * statistics.median(values) if values else None


# name -> the function that measures it, in the order the check runs them
ITEMS = {"env": env, "matmul": matmul, "strategies": strategies, "pytest_cuda": pytest_cuda,
         "memory": memory, "overlap": overlap, "step_ratios": step_ratios}
