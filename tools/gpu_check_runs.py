"""Training runs for `tools/gpu_check.py` that fail soft: many cases in one launch, a
case that fails recorded with the last line of its error, and the cases after it launched
again.

A rank cannot skip a failed case and go on: its peers may be waiting in a collective it
will never join. So a case that raises ends the launch, and each rank's progress file
says which cases finished before it. `run_cases` is the rank's side (the ranks import this
module by name: the launcher hands them the check's `sys.path`, which holds `tools/`),
`launch_cases` the launching side.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab.config import TrainConfig
from shardlab.gpu_record import rank_summary
from shardlab.launch import RankFailed, launch, rank_device
from shardlab.train import train_worker

MIN_LAUNCH_SECONDS = 15  # a launch of the ranks with less time left than this is not started


def now() -> float:
    return time.time()


def placement(world: int, device: str) -> str:
    """World 1 on a GPU runs under NCCL; more ranks share the one GPU over gloo."""
    return "nccl" if device == "cuda" and world == 1 else "gloo"


def _append(path: Path, entry: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def run_cases(cases: list, progress_dir: str, memory_fraction: float | None = None) -> int:
    """Train each `(index, TrainConfig)` in turn; after each, append this rank's summary
    to `progress_dir/rank{r}.jsonl`. A case that raises ends the launch (its peers may
    be waiting in a collective it will never join): the launching side reads which
    cases finished, records the one that failed, and launches the rest again.

    `memory_fraction`: cap this process's CUDA caching allocator at that share of the
    GPU's memory (`torch.cuda.set_per_process_memory_fraction`), so that a step past it
    raises `torch.OutOfMemoryError` as a smaller GPU would."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = rank_device()
    if memory_fraction is not None and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(memory_fraction, device)
    progress = Path(progress_dir) / f"rank{rank}.jsonl"
    for index, config in cases:
        _append(progress, {"case": index, "started": True})
        before = None
        if device.type == "cuda":  # each case's peaks its own
            gc.collect()  # what an earlier case left in reference cycles
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated(device)
        summary = rank_summary(train_worker(config))
        # bytes still allocated from earlier cases: the peak counts them too, so the record
        # keeps them (0 when every earlier run freed what it made)
        summary["allocated_before"] = before
        _append(progress, {"case": index, "summary": summary})
    return len(cases)


def error_line(exc: BaseException) -> str:
    """The line that says what went wrong: a rank's last traceback line, with its rank."""
    if isinstance(exc, RankFailed):
        text, prefix = exc.rank_traceback, f"rank {exc.rank}: "
    else:
        text, prefix = str(exc), ""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return prefix + (lines[-1] if lines else type(exc).__name__)[:500]


def _read_progress(folder: Path, world: int) -> tuple[set[int], dict[int, dict[int, dict]]]:
    started, finished = set(), {}
    for rank in range(world):
        path = folder / f"rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            entry = json.loads(line)
            if "summary" in entry:
                finished.setdefault(entry["case"], {})[rank] = entry["summary"]
            else:
                started.add(entry["case"])
    return started, finished


def launch_cases(configs: list[TrainConfig], world: int, device: str, deadline: float,
                 memory_fraction: float | None = None) -> list[dict]:
    """Run every config on `world` ranks, in as few launches as failures allow; return one
    outcome per config: {"status": "ok", "ranks": [summary per rank]}, or a status with
    the error's last line. A case that fails (a rank raises, or the launch runs out of
    time in it) is recorded, and the cases after it run in a new launch."""
    outcomes: list[dict | None] = [None] * len(configs)
    for i, config in enumerate(configs):  # refused before any rank starts
        try:
            config.validate()
        except ValueError as exc:
            outcomes[i] = {"status": "failed", "error": f"refused: {exc}"}
    pending = [i for i, o in enumerate(outcomes) if o is None]
    backend = placement(world, device)
    while pending:
        left = deadline - now()
        if left < MIN_LAUNCH_SECONDS:
            for i in pending:
                outcomes[i] = {"status": "skipped: out of time", "error": None}
            break
        error, out_of_memory = None, False
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            try:
                launch(run_cases, world, [(i, configs[i]) for i in pending], tmp,
                       memory_fraction, backend=backend, device=device, timeout=left)
            except Exception as exc:  # noqa: BLE001 - recorded, and the rest goes on
                error = error_line(exc)
                # anywhere in the traceback: the allocator's message is long
                out_of_memory = "OutOfMemoryError" in getattr(exc, "rank_traceback", "")
            started, finished = _read_progress(Path(tmp), world)
        for i in pending:
            if len(finished.get(i, {})) == world:
                outcomes[i] = {"status": "ok", "error": None,
                               "ranks": [finished[i][r] for r in range(world)]}
        rest = [i for i in pending if outcomes[i] is None]
        if error is None or not rest:
            break
        if rest[0] not in started:  # the launch itself failed: no case began
            for i in rest:
                outcomes[i] = {"status": "failed", "error": f"launch failed: {error}"}
            break
        outcomes[rest[0]] = {"status": "failed", "error": error,
                             "out_of_memory": out_of_memory}
        pending = rest[1:]
    return outcomes  # type: ignore[return-value]


def per_rank(ranks: list[dict] | None, key: str) -> list | None:
    return [r["peak"].get(key) for r in ranks] if ranks and key in ranks[0]["peak"] else None


def case_entry(meta: dict, outcome: dict) -> dict:
    """What the record keeps of one case: its exit status, losses, bytes sent per step
    (the ledger's, rank 0), and each rank's peak allocated and reserved."""
    entry = {**meta, "status": outcome["status"], "error": outcome.get("error")}
    ranks = outcome.get("ranks")
    if ranks:
        entry.update(placement=ranks[0]["placement"], losses=ranks[0]["losses"],
                     sent_bytes_per_step=ranks[0]["sent_bytes_per_step"],
                     logical_bytes_per_step=ranks[0]["logical_bytes_per_step"],
                     collectives_per_step=ranks[0]["calls_per_step"],
                     state_bytes=[r["state_bytes"] for r in ranks],
                     peak_allocated=per_rank(ranks, "total"),
                     peak_reserved=per_rank(ranks, "reserved"),
                     allocated_before=[r.get("allocated_before") for r in ranks])
    return entry
