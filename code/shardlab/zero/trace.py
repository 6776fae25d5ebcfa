"""The schedule of a ZeRO step, recorded for the chapter's timelines.

Every part of the optimizer (the step, the all-gathers, stage 2's reduce-scatters in
backward) marks its spans on one `StepTrace`, so one list holds the whole step in the
order it ran. Off (nothing recorded) unless `events` is a list.
"""

from __future__ import annotations

import contextlib
import time


class StepTrace:
    """Spans as (seconds, what, bucket, "start" | "end"), bucket -1 for a whole phase."""

    def __init__(self):
        self.events: list[tuple[float, str, int, str]] | None = None

    def mark(self, what: str, bucket: int, edge: str) -> None:
        if self.events is not None:
            self.events.append((time.perf_counter(), what, bucket, edge))

    @contextlib.contextmanager
    def span(self, what: str, bucket: int = -1):
        self.mark(what, bucket, "start")
        yield
        self.mark(what, bucket, "end")

    def end_when_done(self, work, what: str, bucket: int) -> None:
        """Mark the end of an asynchronous collective when the backend completes it, not
        when someone waits for it."""
        if self.events is not None:
            events = self.events
            work.get_future().then(lambda _: events.append(
                (time.perf_counter(), what, bucket, "end")))
