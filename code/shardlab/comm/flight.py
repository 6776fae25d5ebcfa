"""A flight recorder built on the ledger: each rank's last K collectives, kept in a file
that outlives the rank.

A hang leaves no metric behind: every rank sits in a collective until a timeout kills the
job. What tells the story is the list of each rank's last collectives, side by side:
PyTorch keeps one for NCCL (and, since 2.8 or so, for gloo) in a ring buffer it calls the
flight recorder. This one is the course's ledger (`shardlab.comm.ledger`) with three
changes:

* it keeps only the last `capacity` collectives (a ring), so it can stay on for a whole
  run, and numbers the collectives of each process group (`seq`, the same on every rank
  for the same call as long as the ranks agree);
* each entry says who issued it: the innermost functions of the course's or the
  reader's code on the stack, with the unit's name when a sharded unit issued it;
* the ring lives in a memory-mapped file (`rank{R}.flight` in a folder the caller
  chooses), written as each collective starts and again as it finishes. Nothing needs
  to run at the timeout: a rank that gloo aborts (it does, on a size mismatch) or that
  the launcher kills with SIGKILL leaves its file as it was at that instant.

`read_flight(folder)` reads the files back, one `FlightDump` per rank;
`shardlab.comm.hang_diagnosis` compares them.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardlab.comm.ledger import Ledger
from shardlab.comm.records import CollectiveRecord

SLOT = 512  # bytes of one entry in the file: one line of JSON, padded with spaces
# frames that say nothing of who called: torch, the ledger and ring, a context manager,
# the launcher that started the rank
_SKIPPED = (os.path.dirname(torch.__file__), os.path.dirname(__file__),
            os.path.join(os.path.dirname(os.path.dirname(__file__)), "launch"),
            os.path.dirname(multiprocessing.__file__), contextlib.__file__,
            threading.__file__)


@dataclass
class FlightEntry:
    """One collective as one rank's flight recorder saw it."""

    index: int         # this rank's count of collectives, all groups
    seq: int           # the count within its process group: how ranks' entries pair
    op: str
    group: str
    numel: int
    dtype: str
    issuer: str        # "innermost < caller < ..." functions, "[unit]" when one issued it
    step: int          # the training step (`mark_step`); -1 where the recorder has none
    started: float     # seconds since the recorder opened
    finished: bool

    def describe(self) -> str:
        return f"{self.op} of {self.numel} {self.dtype}"


@dataclass
class FlightDump:
    """A rank's file read back. state: "running" (the rank was stopped inside, or is still
    in it), "returned" (it left the recorded code normally), "raised" (with `error`)."""

    rank: int
    world: int
    state: str
    error: str
    entries: list[FlightEntry] = field(default_factory=list)


def caller_chain(frame, inner: int = 2, outer: int = 3) -> str:
    """Who called, from `frame` outward: the frames outside torch, the ledger and the
    launcher, innermost first, with a unit's or bucket's name where the frame's `self` has
    one. A long chain keeps its `inner` innermost frames (which unit, which hook) and its
    `outer` outermost (which part of the program: a training step, an evaluation, a
    generate). The launcher reads it off a rank's waiting thread too."""
    names = []
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(_SKIPPED) and not code.co_name.startswith("<"):
            owner = frame.f_locals.get("self") if "self" in code.co_varnames else None
            label = getattr(owner, "name", None)
            names.append(f"{code.co_name}[{label}]" if isinstance(label, str)
                         else code.co_name)
        frame = frame.f_back
    if len(names) > inner + outer:
        names = names[:inner] + ["..."] + names[-outer:]
    return " < ".join(names)


def _issuer() -> str:
    """Who called the collective being recorded (the recorder's own frames left out)."""
    return caller_chain(sys._getframe(2))


class _Ring:
    """The ledger's `records`, bounded, mirrored into the mapped file as they arrive."""

    def __init__(self, recorder: "FlightRecorder"):
        self.recorder = recorder

    def append(self, record: CollectiveRecord) -> None:
        self.recorder._started(record)

    def __iter__(self):  # the records still in the ring, oldest first (the ledger's sums)
        return iter(self.recorder.in_ring())


class _RecordsOnly(dict):
    """The ledger's works by id, holding only the records: the recorder must not keep a
    work (and the tensors it holds) alive a moment longer than the strategy does. A new
    work that takes a freed one's id is registered again at its launch, replacing it."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, (None, value[1], None))
        while len(self) > self.limit:
            del self[next(iter(self))]


class _Nothing(list):
    """The ledger's completion callbacks to wait for at exit: none for the recorder."""

    def append(self, item) -> None:
        pass


class FlightRecorder(Ledger):
    """`with FlightRecorder(folder):` keeps this rank's last `capacity` collectives in
    `folder/rank{R}.flight`. It is a ledger: opened beside the training loop's, it records
    the same collectives without changing what that one records."""

    def __init__(self, folder: str | os.PathLike, capacity: int = 256):
        super().__init__()
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 collectives, got {capacity!r}")
        self.capacity = capacity
        self.folder = Path(folder)
        self.records = _Ring(self)                  # type: ignore[assignment]
        self._by_work = _RecordsOnly(4 * capacity)  # type: ignore[assignment]
        self._pending = _Nothing()                  # type: ignore[assignment]
        self._lock = threading.Lock()
        self._count = 0
        self._seq: dict[str, int] = {}
        self._slot_of: dict[int, tuple[int, CollectiveRecord, dict]] = {}  # id(record)
        self._in_slot: dict[int, int] = {}  # slot -> id of the record that holds it
        self._map: mmap.mmap | None = None
        self._opened = 0.0

    def __enter__(self) -> "FlightRecorder":
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world = dist.get_world_size() if initialized else 1
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}.flight"
        with open(path, "wb") as f:
            f.truncate(SLOT * (self.capacity + 1))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self._map[:] = b" " * len(self._map)
        self._opened = time.perf_counter()
        self._write_header("running", "")
        super().__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        super().__exit__(exc_type, exc, tb)
        with self._lock:
            error = "" if exc is None else f"{type(exc).__name__}: {exc}".splitlines()[0]
            self._write_header("returned" if exc_type is None else "raised", error)
            self._map.flush()
            self._map.close()
            self._map = None

    def in_ring(self) -> list[CollectiveRecord]:
        with self._lock:
            return [record for _, record, _ in sorted(self._slot_of.values(),
                                                      key=lambda v: v[2]["index"])]

    # the ledger's hooks ----------------------------------------------------------------

    def _started(self, record: CollectiveRecord) -> None:
        issuer = _issuer()
        with self._lock:
            seq = self._seq.get(record.group, 0)
            self._seq[record.group] = seq + 1
            index = self._count
            self._count += 1
            entry = {"index": index, "seq": seq, "op": record.op, "group": record.group,
                     "numel": record.numel, "dtype": str(record.dtype).removeprefix("torch."),
                     "issuer": issuer, "step": self.step,
                     "started": round(record.start - self._opened, 4), "finished": False}
            slot = index % self.capacity
            self._slot_of.pop(self._in_slot.get(slot), None)  # it leaves the ring
            self._in_slot[slot] = id(record)
            self._slot_of[id(record)] = (slot, record, entry)
            self._write(slot + 1, entry)

    def ended(self, records: list[CollectiveRecord]) -> None:
        with self._lock:
            for record in records:
                found = self._slot_of.get(id(record))
                if found is None or found[1] is not record or math.isnan(record.end):
                    continue
                found[2]["finished"] = True
                self._write(found[0] + 1, found[2])

    def mark_step(self) -> None:
        self.step += 1  # works are forgotten by `_RecordsOnly`, not by steps

    # the file ------------------------------------------------------------------------------

    def _write_header(self, state: str, error: str) -> None:
        self._write(0, {"rank": self.rank, "world": self.world, "capacity": self.capacity,
                        "state": state, "error": error[:400]})

    def _write(self, slot: int, data: dict[str, Any]) -> None:
        if self._map is None:  # closed: a completion that arrived after the recorder
            return
        line = json.dumps(data, separators=(",", ":")).encode()
        over = len(line) - (SLOT - 1)
        if over > 0 and "issuer" in data:  # a long issuer is cut, never the entry
            issuer = data["issuer"]
            line = json.dumps({**data, "issuer": issuer[:max(0, len(issuer) - over - 8)]},
                              separators=(",", ":"), ensure_ascii=True).encode()
        self._map[slot * SLOT:(slot + 1) * SLOT] = line.ljust(SLOT - 1) + b"\n"


def read_flight(folder: str | os.PathLike) -> dict[int, FlightDump]:
    """Every rank's flight file in `folder`, by rank; entries oldest first."""
    dumps = {}
    for path in sorted(Path(folder).glob("rank*.flight")):
        lines = [line.strip() for line in path.read_text(errors="replace").split("\n")]
        if not lines or not lines[0]:
            continue
        header = json.loads(lines[0])
        entries = [FlightEntry(**json.loads(line)) for line in lines[1:] if line]
        entries.sort(key=lambda e: e.index)
        dumps[header["rank"]] = FlightDump(header["rank"], header["world"], header["state"],
                                           header["error"], entries)
    return dict(sorted(dumps.items()))


__all__ = ["FlightRecorder", "FlightEntry", "FlightDump", "read_flight", "caller_chain"]
