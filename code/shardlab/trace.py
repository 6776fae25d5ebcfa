"""What a step did, and when: one tracer that every part of a step writes to.

The parts that schedule a step's work mark its edges here: the loop's phases
(`shardlab.clock.StepClock`), DDP's all-reduces (`shardlab.ddp`), ZeRO's reduce-scatters,
optimizer steps and all-gathers (`shardlab.zero`), and each sharded unit's gathers,
computes, frees and reduce-scatters (`shardlab.sharded`). A reader opens a trace around
what it wants to see:

    with tracing() as events:
        train_step(wrapped, micro_batches)
    events  ->  [Event(t, who, what, edge), ...]

One shape for every event: `t`, when (`time.perf_counter()` seconds of this process);
`who`, a unit's name or a bucket's index (None for the whole step: a phase); `what`
("forward", "all-gather", ...); `edge`, "start" or "end" (a moment, like a unit's free,
is a start alone). An asynchronous collective ends when its backend completes it, not
when someone waits for it (`end_when_done`). `spans` pairs the edges into
`Span(what, start, end)`, the shape a timeline draws.

Nothing is recorded while no trace is open: each mark then costs one check, so the
marks stay in the code that trains. The timeline workers (`shardlab.ddp.timeline_worker`,
`shardlab.zero.schedule_timeline`, `shardlab.fsdp.step_probe`) open one around one step;
the run report keeps its own record of every step (the loop's phases as `Span`s, the
ledger's collectives).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Iterable, Iterator, NamedTuple


class Event(NamedTuple):
    t: float                 # time.perf_counter() seconds of this process
    who: str | int | None    # a unit's name, a bucket's index; None: the whole step
    what: str                # "forward", "all-gather", "optimizer step", ...
    edge: str                # "start" | "end"


class Span(NamedTuple):
    what: str
    start: float
    end: float


# The open trace of this process (a rank is one process), or None.
_events: list[Event] | None = None


@contextlib.contextmanager
def tracing() -> Iterator[list[Event]]:
    """Record every event of this process inside the block; yields their list."""
    global _events
    if _events is not None:
        raise RuntimeError("a trace is already open in this process: close it first")
    _events = events = []
    try:
        yield events
    finally:
        _events = None


def mark(what: str, who: str | int | None = None, edge: str = "start",
         t: float | None = None) -> None:
    """One edge, now (or at `t`, a time taken earlier), if a trace is open."""
    if _events is not None:
        _events.append(Event(time.perf_counter() if t is None else t, who, what, edge))


class _Span:
    def __init__(self, what: str, who: str | int | None):
        self.what, self.who = what, who

    def __enter__(self) -> None:
        mark(self.what, self.who, "start")

    def __exit__(self, *exc) -> None:
        mark(self.what, self.who, "end")


_NOTHING = contextlib.nullcontext()


def span(what: str, who: str | int | None = None) -> ContextManager:
    """`with span("all-gather", bucket): ...` marks the block's start and end."""
    return _Span(what, who) if _events is not None else _NOTHING


def end_when_done(work: Any, what: str, who: str | int | None = None):
    """Mark the end of the asynchronous collective `work` when its backend completes it.

    Returns the future that marks it (wait for it to be sure the mark is in), or None
    when no trace is open or the backend cannot tell (gloo's reduce-scatter has no
    future): the code that waits for `work` then marks the end itself."""
    events = _events
    if events is None:
        return None
    try:
        done = work.get_future()
    except RuntimeError:
        return None
    return done.then(lambda _: events.append(Event(time.perf_counter(), who, what, "end")))


# ----------------------------------------------------------------------------- reading


def relative_to(events: Iterable[Event], origin: float) -> list[Event]:
    """The events with their times in seconds from `origin` (a step's start)."""
    return [e._replace(t=e.t - origin) for e in events]


def spans(events: Iterable[Event]) -> list[Span]:
    """Each end paired with the latest open start of the same (who, what) (spans of one
    name nest: the loop's optimizer step around ZeRO's), in order of start; a start with
    no end (a moment) is left out."""
    opened: dict[tuple, list[float]] = {}
    out = []
    for e in sorted(events, key=lambda e: e.t):
        if e.edge == "start":
            opened.setdefault((e.who, e.what), []).append(e.t)
        elif opened.get((e.who, e.what)):
            out.append(Span(e.what, opened[(e.who, e.what)].pop(), e.t))
    return sorted(out, key=lambda s: s.start)
