"""What a failed launch's flight recorders say: which rank waits in which collective.

A hang ends at the timeout with nothing but the ranks still running; a rank that dies
leaves its peers failing in collectives that name a socket. What tells the story is each
rank's last collectives, side by side (`shardlab.comm.hang_diagnosis`). So every launch
keeps a recorder in every rank:

* PyTorch's own flight recorder, switched on in each rank (`TORCH_FR_BUFFER_SIZE`): it
  records gloo's collectives (and NCCL's) in C++, with their process group, sequence
  number, sizes and dtypes, for a few microseconds per collective at most (on a 2-core
  CPU machine the main thread's CPU time for a 4-float gloo all-reduce was 32 us without
  it, 37 us with it, medians of 6 interleaved launches, within the machine's noise;
  the course's recorder, a Python kernel on every collective, adds about 100 us). It
  keeps them in memory and writes nothing by itself on gloo, so each rank dumps it into
  the run folder when its function raises, and when the launcher asks (a launch that
  failed or timed out), from a thread of its own: a rank blocked in a collective has
  released the GIL there. The dump leaves out PyTorch's stack traces (their first
  symbolisation took 2.5 to 6 s on that machine); the collective a rank waits in is told
  by the waiting thread's own stack instead (who called it, and the function of
  `torch.distributed` it called). A rank that died takes its recorder with it; the others
  still say where they waited.
* the course's recorder (`shardlab.comm.FlightRecorder`), where the function keeps one in
  a `flight_folder` (the training loop does): memory-mapped, it outlives a killed rank,
  and knows the step and the unit. Its diagnosis, when it has one, replaces PyTorch's.

The ranks that died (`LaunchError.died`, from their exits) are said first: a death is
not a disagreement of the ranks' code. (Under torchrun the ranks are torchrun's, and each
node's agent reports them: nothing here runs.)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from shardlab.comm.flight import FlightDump, FlightEntry, caller_chain, read_flight
from shardlab.comm.hang_diagnosis import diagnose
from shardlab.launch.errors import LaunchError
from shardlab.launch.hygiene import OWNER, RUN_DIR_PREFIX, RankProcess

BUFFER = "1000"  # collectives each rank keeps (all groups): a few steps of a small model
REQUEST = "dump-collectives"  # the file whose appearance asks every rank for its dump
POLL = 0.1       # seconds between a rank's looks for the request
DUMP_GRACE = 3.0  # seconds the launcher waits for the living ranks' dumps

_TORCH = os.path.dirname(torch.__file__)
_returned_ns: int | None = None  # when this rank's function returned (its collectives end)


# ----------------------------------------------------------------------------- in a rank


def turn_on(run_dir: Path) -> None:
    """Before the process group: PyTorch's flight recorder on, unless the environment
    says otherwise; a dump NCCL's watchdog writes on a timeout goes to the run folder."""
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and \
            "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = BUFFER
    if "TORCH_FR_DUMP_TEMP_FILE" not in os.environ and \
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ:
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(run_dir / "nccl_trace_rank_")


def answer_requests(run_dir: Path, rank: int) -> None:
    """A thread that dumps this rank's collectives once the launcher asks for them."""
    request = run_dir / REQUEST

    def wait_then_dump() -> None:
        while not request.exists():
            time.sleep(POLL)
        main = sys._current_frames().get(threading.main_thread().ident)
        dump(run_dir, rank, main)

    threading.Thread(target=wait_then_dump, name="shardlab-flight-dump", daemon=True).start()


def returned() -> None:
    """The function has returned: what the launcher runs after it is not the function's."""
    global _returned_ns
    _returned_ns = time.time_ns()


def dump(run_dir: Path, rank: int, where: Any = None) -> None:
    """Write this rank's collectives to the run folder. `where`: the waiting thread's
    innermost frame, or the exception the function raised; if it is inside a collective,
    that collective is the rank's newest, unfinished, and its caller is known."""
    traces = []
    for name in ("_dump_fr_trace", "_dump_nccl_trace"):  # gloo's (CPU) and NCCL's
        read = getattr(torch._C._distributed_c10d, name, None)
        if read is None:  # a build without NCCL
            continue
        try:
            traces.append(pickle.loads(read(includeCollectives=True, includeStackTraces=False,
                                            onlyActive=False)))
        except Exception:  # noqa: BLE001 - one recorder that fails leaves the other's
            pass
    try:
        if isinstance(where, BaseException):
            tb, frame = where.__traceback__, None
            while tb is not None:
                frame, tb = tb.tb_frame, tb.tb_next
            where = frame
        # a rank whose function has returned waits in the launcher's barrier, not in it
        record = {"entries": [e for t in traces for e in t.get("entries", [])],
                  "returned_ns": _returned_ns,
                  "waiting": _waiting_in(where) if _returned_ns is None else None}
        tmp = run_dir / f"rank{rank}.collectives.{threading.get_ident()}"
        tmp.write_bytes(pickle.dumps(record))
        tmp.rename(run_dir / f"rank{rank}.collectives")
    except Exception:  # noqa: BLE001 - a dump that fails leaves the launch's error as it is
        pass


def _waiting_in(frame: Any) -> dict[str, str] | None:
    """The function of torch.distributed that `frame` (innermost first) is inside, and
    who called it; None when it is in no collective."""
    api, caller = None, frame
    while caller is not None and caller.f_code.co_filename.startswith(_TORCH):
        if caller.f_code.co_filename.endswith("distributed_c10d.py"):
            api = caller.f_code.co_name
        caller = caller.f_back
    if api is None:
        return None
    return {"api": api, "issuer": caller_chain(caller)}


# ----------------------------------------------------------------------------- the launcher


def ask_ranks(run_dir: Path, ranks: list[RankProcess]) -> None:
    """Ask every living rank for its collectives; wait, briefly, until each has answered
    or ended (a rank that raised has dumped already)."""
    with contextlib.suppress(OSError):
        (run_dir / REQUEST).touch()
    deadline = time.monotonic() + DUMP_GRACE
    while time.monotonic() < deadline and any(
            r.process.exitcode is None and not (run_dir / f"rank{r.rank}.collectives").exists()
            for r in ranks):
        time.sleep(0.02)


# names a backend gives its collectives, as the course's ledger names them
_KINDS = {"allreduce": "all_reduce", "allgather": "all_gather",
          "_allgather_base": "all_gather", "all_gather_into_tensor": "all_gather",
          "all_gather_single": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "reduce_scatter_single": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
          "reducescatter": "reduce_scatter", "alltoall": "all_to_all",
          "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all"}
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16",
           "BFloat16": "bfloat16", "Long": "int64", "Int": "int32", "Short": "int16",
           "Char": "int8", "Byte": "uint8", "Bool": "bool"}


def _kind(name: str) -> str:
    name = name.rsplit(":", 1)[-1]  # "gloo:all_reduce"
    return _KINDS.get(name, name)


def _numel(sizes: list) -> int:
    total = 0
    for shape in sizes or []:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def _entries(record: dict) -> list[FlightEntry]:
    """A rank's dump as the course's entries: its collectives (point-to-point left out:
    a send and its recv pair across ranks, not by a shared number), up to when its
    function returned."""
    raw = [e for e in record["entries"] if not e.get("is_p2p")
           and (record["returned_ns"] is None or e["time_created_ns"] <= record["returned_ns"])]
    raw.sort(key=lambda e: e["time_created_ns"])
    start = raw[0]["time_created_ns"] if raw else 0
    entries = []
    for index, e in enumerate(raw):
        entries.append(FlightEntry(
            index=index, seq=e["collective_seq_id"], op=_kind(e["profiling_name"]),
            group=str(e["process_group"][0]),
            # an all-gather's size is what it gathers, a reduce-scatter's what it scatters
            numel=max(_numel(e.get("input_sizes")), _numel(e.get("output_sizes"))),
            dtype=_DTYPES.get((e.get("input_dtypes") or ["?"])[0],
                              str((e.get("input_dtypes") or ["?"])[0]).lower()),
            issuer="", step=-1, started=round((e["time_created_ns"] - start) / 1e9, 4),
            finished=bool(e.get("retired")) or e.get("state") == "completed"))
    waiting = record["waiting"]
    if waiting and entries:
        newest = entries[-1]
        newest.finished = False
        # the function called, where the backend names it otherwise (gloo runs a
        # reduce_scatter_tensor as an all-reduce)
        api = waiting["api"] if _kind(waiting["api"]) != newest.op else ""
        newest.issuer = " < ".join(n for n in (api, waiting["issuer"]) if n)
    return entries


def read(run_dir: Path, world: int) -> dict[int, FlightDump]:
    """Every rank's dump in `run_dir`, as the course's recorder's files read back."""
    dumps = {}
    for rank in range(world):
        path = run_dir / f"rank{rank}.collectives"
        try:
            record = pickle.loads(path.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError):
            continue
        error = run_dir / f"rank{rank}.error"
        if (run_dir / f"rank{rank}.result").exists():
            state, said = "returned", ""
        elif error.exists():
            lines = error.read_text(errors="replace").strip().splitlines()
            state, said = "raised", lines[-1] if lines else ""
        else:
            state, said = "running", ""
        dumps[rank] = FlightDump(rank, world, state, said[:400], _entries(record))
    return dumps


def explain(failure: LaunchError, run_dir: Path, world: int) -> None:
    """End `failure`'s message with what the ranks' dumps say, if they say something."""
    found = diagnose(read(run_dir, world), failure.died, world)
    if found.cause != "none":
        failure.explain(found)


@contextlib.contextmanager
def flight_folder() -> Iterator[str]:
    """A folder for the course's recorders (`shardlab.comm.FlightRecorder`), for the
    length of a launch. If the launch fails and their files say something, the error
    carries their diagnosis (`exc.hang`, and its message ends with the paragraph), in
    place of PyTorch's. Named as the launcher names its run folders, so that if this
    process is killed the next launch removes it."""
    with tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX) as folder:
        (Path(folder) / OWNER).write_text(str(os.getpid()))
        try:
            yield folder
        except LaunchError as exc:
            found = diagnose(read_flight(folder), exc.died)
            if found.cause != "none":
                exc.explain(found)
            raise


__all__ = ["flight_folder", "turn_on", "answer_requests", "returned", "dump", "ask_ranks",
           "read", "explain"]
