"""Run the faults of `shardlab.hangs` on N ranks, each under a flight recorder, and read
back what the recorders say.

Several faults run in one launch (a launch costs seconds of start-up): each on a process
group of its own, created with a per-collective timeout of a few seconds, so that a hang
ends as a gloo timeout in seconds and leaves the default group (and the launcher)
healthy; the ranks meet at a barrier on the default group before the next fault. A
fault that gloo answers by aborting the process (it aborts on a size mismatch) ends the
launch: run it last. Each fault's flight files are in a folder of its own, which the
launching process reads after the launch and then removes (`flight_folder`).

Beside the course's recorder, a run can switch on PyTorch's own tools for comparison:
`detail=True` creates each fault's group under `TORCH_DISTRIBUTED_DEBUG=DETAIL`, which
checks every collective's fingerprint across ranks before it runs; `torch_flight=True`
turns on PyTorch's flight recorder (`TORCH_FR_BUFFER_SIZE`), which each rank dumps when
its fault ends (gloo dumps nothing by itself on a timeout; NCCL's watchdog does).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab.comm.flight import FlightDump, FlightRecorder, read_flight
from shardlab.comm.hang_diagnosis import HangDiagnosis, diagnose
from shardlab.hangs import FAULTS
from shardlab.launch.errors import LaunchError
from shardlab.launch.launcher import launch
from shardlab.launch.recorders import flight_folder
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.wrap import unit_modules

@dataclass
class HangRun:
    """One fault's run: what the course's recorder says (`diagnosis`, from `dumps`), and,
    when asked for, PyTorch's DETAIL check (`detail`: each rank's error, "" when none)
    and PyTorch's flight recorder (`torch_flight`: each rank's entries of the fault's
    group, as (name, seq, state, input sizes))."""

    fault: str
    fixed: bool
    diagnosis: HangDiagnosis
    dumps: dict[int, FlightDump]
    detail: dict[int, str] = field(default_factory=dict)
    torch_flight: dict[int, list[tuple]] = field(default_factory=dict)

    @property
    def ended(self) -> dict[int, str]:
        """How each rank left the fault: returned, raised (its error), or stopped inside
        (its process ended there: gloo's abort, or the launcher)."""
        return {r: d.state if d.state != "raised" else d.error for r, d in self.dumps.items()}

    @property
    def timed_out(self) -> list[int]:
        """The ranks whose own collective timeout ended the hang (the others returned,
        or lost a peer that had timed out)."""
        return [r for r, how in self.ended.items() if ended_by_timeout(how)]


# gloo's two messages for a timeout in this process: the operation that timed out raises
# the first; it then closes every pair, and an operation on another thread (or the next
# one) raises the second. Which one a rank sees depends on scheduling, so both count.
# A peer of a rank that timed out sees "Connection closed by peer" instead: it lost
# its peer, its own timeout did not fire.
GLOO_TIMEOUT_MESSAGES = ("Timed out waiting", "Application timeout caused pair closure")


def ended_by_timeout(how: str) -> bool:
    """Whether a rank's error (as `HangRun.ended` gives it) is its own collective timeout."""
    return any(message in how for message in GLOO_TIMEOUT_MESSAGES)


def _sharded_tiny_gpt(group):
    """gpt-tiny as ZeRO-3 units on `group`, and one training step (forward, backward)."""
    from shardlab.sharded.model import shard_units
    from shardlab.zero3 import FlatUnit

    model = build_model("gpt-tiny", seed=0)
    shard_units(model, unit_modules(model, "auto"), FlatUnit, group=group,
                device=torch.device("cpu"))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    calls = iter(range(10**6))

    def train_step() -> None:
        x, y = get_batch(next(calls), rank, world, 2 * world, 8)
        loss_fn(model(x), y).backward()

    return model, train_step


def _torch_flight_entries(group) -> list[tuple[str, int, str]]:
    from torch._C._distributed_c10d import _dump_fr_trace
    trace = pickle.loads(_dump_fr_trace())
    name = group.group_name
    return [(e["profiling_name"], e["collective_seq_id"], e["state"], e["input_sizes"])
            for e in trace.get("entries", []) if e.get("process_group", ("",))[0] == name]


def hang_worker(cases: list[tuple[str, bool, bool]], folder: str,
                collective_timeout: float, torch_flight: bool) -> dict[str, str]:
    """Worker: run each (fault, fixed, detail) case on a new group, under a flight
    recorder in `folder/<case>`; return how this rank left each ("returned" or its error)."""
    outcome = {}
    timeout = datetime.timedelta(seconds=collective_timeout)
    for name, fixed, detail in cases:
        if detail:
            dist.set_debug_level(dist.DebugLevel.DETAIL)
        group = dist.new_group(backend="gloo", timeout=timeout)
        dist.set_debug_level(dist.DebugLevel.OFF)
        extra = _sharded_tiny_gpt(group) if name == "rank0_generate" else ()
        where = Path(folder) / case_name(name, fixed, detail)
        try:
            with FlightRecorder(where) as recorder:
                FAULTS[name](group, fixed, recorder.mark_step, *extra)
            outcome[where.name] = "returned"
        except RuntimeError as exc:
            outcome[where.name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if torch_flight:
            entries = _torch_flight_entries(group)
            (where / f"rank{dist.get_rank()}.torch").write_bytes(pickle.dumps(entries))
        dist.barrier()  # the default group, untouched by the fault: every rank is done
    return outcome


def case_name(fault: str, fixed: bool, detail: bool = False) -> str:
    """"skipped_sample", "skipped_sample:fixed", "skipped_sample:detail"."""
    return fault + (":fixed" if fixed else "") + (":detail" if detail else "")


@contextlib.contextmanager
def _environment(**values: str | None):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_hangs(faults=tuple(FAULTS), world: int = 2, *, fixed: bool | str = False,
              detail: bool | str = False, collective_timeout: float = 3.0,
              torch_flight: bool = False, timeout: float = 180.0) -> dict[str, HangRun]:
    """Run `faults` (names of `shardlab.hangs.FAULTS`, in order) in one launch of `world`
    ranks; return each case's `HangRun` by its `case_name`. fixed: False, True (each
    with its fix) or "both" (each fault, then its fix: "<fault>:fixed"); detail: False,
    True or "both" (the faults also under TORCH_DISTRIBUTED_DEBUG=DETAIL:
    "<fault>:detail"). The faulty "size_mismatch" runs last: gloo may abort a rank for
    it, which ends the launch."""
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; use some of {list(FAULTS)}")
    for name, value in (("fixed", fixed), ("detail", detail)):
        if value not in (False, True, "both"):
            raise ValueError(f"{name} must be False, True or 'both', got {value!r}")
    cases = [(name, f, d) for name in faults
             for f in ((False, True) if fixed == "both" else (bool(fixed),))
             for d in ((False, True) if detail == "both" else (bool(detail),))
             if not (f and d and detail == "both")]  # a fix needs no second opinion
    cases.sort(key=lambda case: case == ("size_mismatch", False, False))
    env = {"TORCH_FR_BUFFER_SIZE": "2000"} if torch_flight else {}
    runs = {}
    with flight_folder() as folder, _environment(**env):
        with contextlib.suppress(LaunchError):  # a fault that aborts a rank ends the launch
            launch(hang_worker, world, cases, folder, collective_timeout, torch_flight,
                   timeout=timeout)
        for name, f, d in cases:
            where = Path(folder) / case_name(name, f, d)
            dumps = read_flight(where)
            run = HangRun(name, f, diagnose(dumps), dumps)
            if d:
                run.detail = {r: dump.error for r, dump in dumps.items()}
            for path in sorted(where.glob("rank*.torch")):
                run.torch_flight[int(path.stem[4:])] = pickle.loads(path.read_bytes())
            runs[where.name] = run
    return runs


__all__ = ["HangRun", "hang_worker", "run_hangs", "case_name"]
