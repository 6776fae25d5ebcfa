"""ZeRO-1/2 with the parameters' all-gather overlapped: the same training to the bit, a
schedule that no longer ends in an exposed all-gather, bucket sizes in MB.

`overlap_all_gather` only moves *when* each bucket's all-gather runs (started as soon as
its chunk is stepped, waited for before the first forward that needs it); the arithmetic
is the same, so every case below compares overlap on against off with `torch.equal`,
losses and parameters after every step's update. `keep_params` reads the parameters
right after the last step, while their all-gathers may still be in flight: a run that
forgot to wait would fail here.
"""

from dataclasses import replace

import pytest

import zero_workers as w
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.train import train_many
from shardlab.zero import ZERO_OPTIONS, schedule_timeline

SMALL = 4096  # elements: gpt-tiny in 19 buckets


def pairs(world: int) -> list[tuple[str, TrainConfig]]:
    base = TrainConfig(world=world, steps=6, batch_size=4 * world, seq_len=16,
                       keep_params=True, measure_memory=False)
    sgd = dict(optimizer="sgd-momentum", lr=0.05)
    cases = {
        "zero1 many buckets": replace(base, strategy="zero1", options={"bucket_numel": SMALL}),
        "zero2 many buckets": replace(base, strategy="zero2", options={"bucket_numel": SMALL}),
        "zero2 grad_accum": replace(base, strategy="zero2", grad_accum=2, **sgd,
                                    options={"bucket_numel": SMALL}),
        "zero1 bf16-mixed": replace(base, strategy="zero1", precision="bf16-mixed",
                                    options={"bucket_numel": SMALL}),
        "zero2 groups": replace(base, strategy="zero2",
                                options={"bucket_numel": SMALL, "param_groups": w.decay_groups}),
        "zero1 unused module": replace(base, strategy="zero1", model="toy-unused", **sgd),
        "zero2 tied, one bucket": replace(base, strategy="zero2", model="toy-tied"),
        "zero2 hf-llama": replace(base, strategy="zero2", model="hf-llama",
                                  options={"bucket_numel": SMALL}),
    }
    out = []
    for name, config in cases.items():
        for overlap in (True, False):
            out.append((name, replace(config, options={**config.options,
                                                       "overlap_all_gather": overlap})))
    return out


@pytest.fixture(scope="module", params=[2, 3])
def runs(request):
    world = request.param
    named = pairs(world)
    reports = launch(train_many, world, [c for _, c in named], timeout=600)
    return named, reports


def test_overlap_trains_bit_for_bit_like_no_overlap(runs):
    named, reports = runs
    for rank_reports in reports:
        for i in range(0, len(named), 2):
            on, off = rank_reports[i], rank_reports[i + 1]
            name = named[i][0]
            assert on.losses == off.losses, name
            assert on.params.keys() == off.params.keys()
            assert all(p.equal(off.params[k]) for k, p in on.params.items()), name
            assert on.losses[-1] < on.losses[0], name


def test_overlap_moves_the_same_bytes_in_one_all_gather_per_bucket(runs):
    """The same reduce-scatters in each step, and the same elements all-gathered: one
    all-gather per bucket when overlapped (each starts as its bucket is stepped), one per
    parameter group when not (a collective's fixed cost paid once, `zero.gather`)."""
    named, reports = runs
    for i in range(0, len(named), 2):
        name = named[i][0]
        on, off = reports[0][i], reports[0][i + 1]
        for step in {r.step for r in on.ledger}:
            def of(report, op):
                return [r.numel for r in report.ledger if r.step == step and r.op == op]
            if "groups" in name:  # the order of the buckets differs: the model's, not
                assert sorted(of(on, "reduce_scatter")) == sorted(of(off, "reduce_scatter"))
            else:
                assert of(on, "reduce_scatter") == of(off, "reduce_scatter"), name
            assert sum(of(on, "all_gather")) == sum(of(off, "all_gather")), name
            groups = 2 if "groups" in name else 1
            assert len(of(off, "all_gather")) == groups, name
            if "many buckets" in name:  # 19 buckets of gpt-tiny, one all-gather each
                assert len(of(on, "all_gather")) == 19, name


def test_the_all_gathers_run_during_the_step_and_are_waited_for_in_the_next_forward():
    timelines = launch(schedule_timeline, 2, ("zero1", "zero2"), 2, SMALL,
                       overlap_all_gather=True)
    for rank_timelines in timelines:
        for name, events in rank_timelines.items():
            def first(what, edge="start"):
                return min(t for t, _, w, e in events if w == what and e == edge)

            def last(what, edge="end"):
                return max(t for t, _, w, e in events if w == what and e == edge)

            buckets = {b for _, b, w, _ in events if w == "all-gather"}
            assert len(buckets) > 2, name
            # bucket 0's all-gather starts before the last bucket is stepped
            assert first("all-gather") < last("optimizer step"), name
            # each bucket is stepped, then gathered: one optimizer step per bucket
            steps = [b for _, b, w, e in events if w == "optimizer step" and e == "start"]
            gathers = [b for _, b, w, e in events if w == "all-gather" and e == "start"]
            assert steps == gathers == sorted(buckets), name
            # the next forward waits for each bucket, in the model's order; so did this
            # step's forward, for the previous step's all-gathers
            waits = [(t, b) for t, b, w, e in events if w == "wait for all-gather"
                     and e == "start"]
            begin, end = first("next forward"), last("next forward")
            assert [b for t, b in waits if begin <= t <= end] == sorted(buckets), name
            begin, end = first("forward"), last("forward")
            assert [b for t, b in waits if begin <= t <= end] == sorted(buckets), name
            assert len(waits) == 2 * len(buckets), name


def test_without_overlap_the_all_gathers_follow_the_whole_step():
    timelines = launch(schedule_timeline, 2, ("zero1",), 2, SMALL)[0]
    events = timelines["zero1"]
    step_end = max(t for t, _, w, e in events if w == "optimizer step" and e == "end")
    assert min(t for t, _, w, e in events if w == "all-gather") >= step_end
    assert not any(w == "wait for all-gather" for _, _, w, _ in events)


def test_bucket_mb_is_bytes_and_bucket_numel_elements():
    """Defaults: 25 MB buckets (gpt-tiny's 0.46 MB of fp32 is one bucket), overlap "auto":
    off on gloo, so one all-gather for all the buckets. A size in MB makes the same
    buckets as the same size in elements of the dtype: fp32 4 bytes, bf16 2 bytes."""
    assert ZERO_OPTIONS["bucket_mb"] == 25.0 and ZERO_OPTIONS["overlap_all_gather"] == "auto"
    base = TrainConfig(strategy="zero1", world=2, steps=2, measure_memory=False)
    mb = SMALL * 4 / 2**20
    configs = [base, replace(base, options={"bucket_mb": mb}),
               replace(base, options={"bucket_numel": SMALL}),
               replace(base, precision="bf16-mixed", options={"bucket_mb": mb / 2})]
    default, by_mb, by_numel, bf16 = launch(train_many, 2, configs)[0]

    def calls(report, op):
        return [r.numel for r in report.ledger if r.step == 1 and r.op == op]

    assert len(calls(default, "reduce_scatter")) == len(calls(default, "all_gather")) == 1
    assert len(calls(by_mb, "reduce_scatter")) > 2  # a reduce-scatter per bucket
    assert calls(by_mb, "reduce_scatter") == calls(by_numel, "reduce_scatter") \
        == calls(bf16, "reduce_scatter")
    # gloo: "auto" does not overlap, and the buckets are gathered in one collective
    assert len(calls(by_mb, "all_gather")) == 1
    assert calls(by_mb, "all_gather") == [sum(calls(by_mb, "reduce_scatter"))]
