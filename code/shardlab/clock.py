"""The training loop's clock: when each phase of a step began and ended on this rank.

Apart from `shardlab.report`, which reads these timestamps after the run (exposed
communication, idle time), because recording is the loop's business and must stay small
and cheap: `with clock.phase("forward"): ...` around each phase, and one hook that notes
when autograd's own computation ends, so that a wrapper's waiting at the end of backward
(DDP's last buckets, ZeRO-2's last reduce-scatters) can be told from compute.

The clock keeps every step's phases for the report, and marks them on the step's tracer
too (`shardlab.trace`, whole-step events: `who` is None), so that a trace opened around a
step shows the loop's phases beside the strategy's own events.
"""

from __future__ import annotations

import time

import torch

from shardlab import trace
from shardlab.trace import Span


class StepClock:
    """The loop's timestamps of one step: `with clock.phase("forward"): ...`, and
    `clock.watch_backward(loss)` before `loss.backward()` to note when autograd's own
    computation ends (what follows, before `backward()` returns, is a wrapper's waiting:
    DDP's last buckets, ZeRO-2's last reduce-scatters)."""

    def __init__(self):
        self.spans: list[Span] = []

    def phase(self, what: str):
        return _Phase(self, what)

    def watch_backward(self, loss: torch.Tensor) -> None:
        if not loss.requires_grad:
            return
        from torch.autograd import Variable

        def note_end() -> None:
            self._computed = _now()

        def on_first_gradient(grad):
            # queued first, so it runs before any wrapper's end-of-backward callback
            Variable._execution_engine.queue_callback(note_end)
            return grad

        loss.register_hook(on_first_gradient)
        self._computed = None

    def close_backward(self, end: float) -> None:
        computed = getattr(self, "_computed", None)
        if computed is not None and end > computed:
            self.record("end of backward", computed, end)
        self._computed = None

    def record(self, what: str, begin: float, end: float) -> None:
        """A span timed by the caller, marked on the tracer once it is over."""
        self.spans.append(Span(what, begin, end))
        trace.mark(what, None, "start", begin)
        trace.mark(what, None, "end", end)


class _Phase:
    def __init__(self, clock: StepClock, what: str):
        self.clock, self.what = clock, what

    def __enter__(self) -> "_Phase":
        # a named range in a torch.profiler trace (next to nothing when none records)
        self.marker = torch.profiler.record_function(self.what)
        self.marker.__enter__()
        self.begin = _now()
        trace.mark(self.what, None, "start", self.begin)
        return self

    def __exit__(self, *exc) -> None:
        end = _now()
        self.marker.__exit__(*exc)
        self.clock.spans.append(Span(self.what, self.begin, end))
        trace.mark(self.what, None, "end", end)
        if self.what == "backward":
            self.clock.close_backward(end)


def _now() -> float:
    return time.perf_counter()
