"""One tracer for a step's events (`shardlab.trace`): the loop's clock, DDP, ZeRO and the
sharded units all mark their events on it, in one shape, and only while a trace is open."""

import pytest
import torch

import trace_workers as w
from shardlab import trace
from shardlab.launch import launch
from shardlab.trace import Event, Span


def test_nothing_is_recorded_outside_a_trace_and_spans_pair_the_edges():
    trace.mark("forward")                     # no trace open: a check, nothing kept
    with trace.span("backward"):
        pass
    with trace.tracing() as events:
        trace.mark("all-gather", "blocks.0")
        trace.mark("free", "blocks.0")        # a moment: a start alone
        with trace.span("forward", "blocks.0"):
            with trace.span("forward", "blocks.0"):   # nested: paired inside out
                pass
        trace.mark("all-gather", "blocks.0", "end")
        with pytest.raises(RuntimeError, match="already open"):
            with trace.tracing():
                pass
    trace.mark("forward")
    assert [(e.who, e.what, e.edge) for e in events] == [
        ("blocks.0", "all-gather", "start"), ("blocks.0", "free", "start"),
        ("blocks.0", "forward", "start"), ("blocks.0", "forward", "start"),
        ("blocks.0", "forward", "end"), ("blocks.0", "forward", "end"),
        ("blocks.0", "all-gather", "end")]
    assert all(isinstance(e, Event) for e in events)
    paired = trace.spans(events)
    assert [s.what for s in paired] == ["all-gather", "forward", "forward"]
    outer, inner = paired[1:]
    assert outer.start <= inner.start <= inner.end <= outer.end
    shifted = trace.relative_to(events, events[0].t)
    assert shifted[0].t == 0 and [e.what for e in shifted] == [e.what for e in events]


def test_an_asynchronous_end_is_marked_by_its_future():
    class Work:  # a collective's work whose future the backend completes later
        def __init__(self):
            self.future = torch.futures.Future()

        def get_future(self):
            return self.future

    with trace.tracing() as events:
        work = Work()
        trace.mark("all-reduce", 0)
        marked = trace.end_when_done(work, "all-reduce", 0)
        assert [e.edge for e in events] == ["start"]
        work.future.set_result(None)
        marked.wait()
    assert [(e.who, e.what, e.edge) for e in events] == [(0, "all-reduce", "start"),
                                                         (0, "all-reduce", "end")]
    assert trace.end_when_done(Work(), "all-reduce", 0) is None  # no trace open


def test_the_loop_clock_ddp_zero_and_the_sharded_units_write_to_one_trace():
    cases = [("ddp", {"bucket_mb": 0.1, "first_bucket_mb": 0.1}),
             ("zero2", {"bucket_numel": 1 << 14, "overlap_all_gather": False}),
             ("fsdp2", {})]
    results = launch(w.one_traced_step, 2, cases)[0]
    for result in results:
        name, events = result["strategy"], result["events"]
        assert all(isinstance(e, Event) and e.edge in ("start", "end") for e in events), name
        # the loop's phases, whole-step events, in the trace and in the clock's spans
        phases = [e.what for e in events if e.who is None and e.edge == "start"]
        assert {"forward", "backward", "optimizer step"} <= set(phases), name
        untraced, traced = result["phases"]
        assert [s.what for s in untraced] == [s.what for s in traced], name
        assert all(isinstance(s, Span) and s.end >= s.start for s in traced), name
        assert {s.what for s in traced} <= set(phases)
        # the strategy's own events, each started one ended, under its bucket or unit
        own = [e for e in events if e.who is not None]
        starts = {(e.who, e.what) for e in own if e.edge == "start" and e.what != "free"}
        ends = {(e.who, e.what) for e in own if e.edge == "end"}
        assert starts == ends, name
        if name == "ddp":
            buckets = {e.who for e in own if e.what == "all-reduce"}
            assert len(buckets) > 2 and buckets == set(range(len(buckets)))
            assert "wait for all-reduce" in phases
        elif name == "zero2":
            scattered = {e.who for e in own if e.what == "reduce-scatter"}
            assert len(scattered) > 2
            # not overlapped: all the buckets' all-gathers in one, the group's
            assert {e.who for e in own if e.what == "all-gather"} == {"group 0"}
        else:
            units = {e.who for e in own}
            assert "root" in units and "blocks.0" in units
            for unit in units - {"root"}:
                assert {e.what for e in own if e.who == unit} == {
                    "all-gather", "forward", "backward", "reduce-scatter", "free"}
