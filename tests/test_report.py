"""The run report's production metrics, each checked against a run where it is known.

* idle time: rank 1 sleeps a known time before every forward (`slow_rank`); the other
  rank waits for it in the step's first collective, so it must show about that much idle
  time per step, and the slow rank itself about none. Checked for our DDP (async
  all-reduces waited in Python), PyTorch's DDP (waited in C++, at the end of backward),
  ZeRO-1 (blocking reduce-scatters) and ZeRO-3 (all-gathers before each unit).
  Tolerances are for a loaded 2-core machine: at least 60% of the sleep, and the slow
  rank under a quarter of it;
* exposed communication: none without collectives (single); DDP's bucketed all-reduces
  overlap backward, so its overlap is above zero;
* times per collective kind, tokens/s, peaks, checkpoint save and load times, the memory
  limit and recomputation;
* the arithmetic itself on hand-made timestamps, where every number is exact.

No wall-clock time is asserted except against the sleep the test itself injected.
"""

import json
from dataclasses import replace

import pytest
import torch

from shardlab import comm
from shardlab.cli import main
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.report import RunReport, production_metrics, step_metrics
from shardlab.report_output import summary_table
from shardlab.train import train_many, train_worker

SLEEP = 0.25
STRAGGLING = ["ddp", "torch-ddp", "zero1", "zero3"]


@pytest.fixture(autouse=True)
def _one_thread_everywhere(one_thread):
    """The in-process runs below use one thread, as each launched rank does."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    base = TrainConfig(world=2, steps=4, measure_memory=False)
    # six steps: the median of the four steady ones passes over a one-off (PyTorch DDP
    # rebuilds its buckets in the second forward, waiting in C++ where no wait is timed)
    configs = {s: replace(base, strategy=s, steps=6, slow_rank=1, slow_seconds=SLEEP)
               for s in STRAGGLING}
    configs["ddp overlapped"] = replace(base, strategy="ddp", model="gpt-small", steps=5,
                                        options={"bucket_mb": 1.0, "first_bucket_mb": 1.0})
    configs["zero2 saved"] = replace(base, strategy="zero2", measure_memory=True,
                                     save_every=2, checkpoint_dir=str(root))
    configs["zero2 resumed"] = replace(base, strategy="zero2", steps=6, resume=True,
                                       checkpoint_dir=str(root))
    per_rank = launch(train_many, 2, list(configs.values()), timeout=600)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(configs)}


def medians(reports):
    return production_metrics(reports)


@pytest.mark.parametrize("strategy", STRAGGLING)
def test_a_straggler_shows_as_idle_time_on_the_other_rank(runs, strategy):
    waiting, slow = medians(runs[strategy])
    assert waiting["idle_ms"] >= 0.6 * 1e3 * SLEEP, (strategy, waiting)
    assert slow["idle_ms"] < 0.25 * 1e3 * SLEEP, (strategy, slow)
    # the wait is exposed communication, and every rank's step pays for the sleep
    assert waiting["exposed_comm_ms"] >= waiting["idle_ms"]
    assert min(waiting["step_ms"], slow["step_ms"]) >= 1e3 * SLEEP


def test_per_step_idle_of_every_steady_step(runs):
    steps = step_metrics(runs["zero1"])
    for s in (1, 2):
        assert steps[0][s]["idle_seconds"] >= 0.6 * SLEEP
        assert steps[1][s]["idle_seconds"] < 0.25 * SLEEP


def test_single_has_no_communication_to_expose():
    report = train_worker(TrainConfig(steps=4, measure_memory=False))
    [m] = production_metrics([report])
    assert m["comm_ms"] == m["exposed_comm_ms"] == m["idle_ms"] == 0
    assert m["all_gather_ms"] == m["reduce_scatter_ms"] == m["all_reduce_ms"] == 0
    assert m["overlap_pct"] is None  # nothing to overlap
    for row in step_metrics([report])[0]:
        assert row["tokens_per_second"] == 8 * 32 / row["seconds"]


def test_ddp_buckets_overlap_backward(runs):
    for m in medians(runs["ddp overlapped"]):
        assert m["all_reduce_ms"] > 0
        assert m["overlap_pct"] > 0
        assert m["exposed_comm_ms"] <= m["comm_ms"] <= m["step_ms"]


def test_each_collective_kind_is_timed_where_it_runs(runs):
    kinds = {"ddp": {"all_reduce"}, "torch-ddp": {"all_reduce"},
             "zero1": {"all_gather", "reduce_scatter"},
             "zero3": {"all_gather", "reduce_scatter"}}
    for strategy, expected in kinds.items():
        for m in medians(runs[strategy]):
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                assert (m[f"{kind}_ms"] > 0) == (kind in expected), (strategy, kind)


def test_tokens_per_second_per_rank(runs):
    for report, steps in zip(runs["zero1"], step_metrics(runs["zero1"])):
        assert report.tokens_per_step == 8 // 2 * 32  # this rank's rows of the batch
        for row, seconds in zip(steps, report.step_times):
            assert row["tokens_per_second"] == report.tokens_per_step / seconds


def test_peaks_and_checkpoint_times(runs):
    saved, resumed = runs["zero2 saved"], runs["zero2 resumed"]
    for report, m in zip(saved, medians(saved)):
        assert m["peak_allocated"] == report.peak["total"] > 0
        assert m["peak_reserved"] is None  # a CPU run: no caching allocator
        assert len(report.checkpoint_save_seconds) == 2  # after steps 2 and 4
        assert all(t > 0 for t in report.checkpoint_save_seconds)
        assert m["checkpoint_save_s"] > 0 and m["checkpoint_load_s"] is None
    for report, m in zip(resumed, medians(resumed)):
        assert report.first_step == 4 and m["checkpoint_load_s"] > 0
        assert m["checkpoint_save_s"] is None


def test_a_memory_limit_is_crossed_where_the_peak_is():
    base = TrainConfig(steps=2, batch_size=16)
    peak = train_worker(base).peak["total"]
    at_peak = train_worker(replace(base, memory_limit=peak))
    below = train_worker(replace(base, memory_limit=peak - 1))
    tiny = train_worker(replace(base, memory_limit=1))
    assert at_peak.memory_limit_crossing is None
    assert below.memory_limit_crossing is not None
    assert below.memory_limit_crossing.startswith(("forward", "backward", "optimizer step"))
    assert "(step 1)" in below.memory_limit_crossing
    # half the peak is crossed earlier, in the forward of a layer
    half = train_worker(replace(base, memory_limit=peak // 2)).memory_limit_crossing
    assert half.startswith("forward of blocks.")
    # the model states alone exceed one byte: crossed at the step's first operation
    assert tiny.memory_limit_crossing.startswith("forward")
    with pytest.raises(ValueError, match="memory_limit must be a whole number of bytes"):
        train_worker(replace(base, memory_limit=0))


def test_recomputation_trades_activations_for_compute_and_changes_nothing_else():
    base = TrainConfig(steps=3, batch_size=16, keep_params=True)
    plain = train_worker(base)
    recomputed = train_worker(replace(base, recompute=True))
    assert recomputed.losses == plain.losses
    assert all(torch.equal(recomputed.params[k], p) for k, p in plain.params.items())
    assert recomputed.peak["activations"] < plain.peak["activations"]


def test_the_arithmetic_on_known_timestamps():
    """Two ranks, one step from t=0 to t=1 s on each. Rank 0 launches a blocking
    all-reduce at 0.2 and waits in it until 0.7; rank 1 launches it at 0.6 (it computed
    until then) and is done at 0.7. Then both all-gather asynchronously from 0.7 to 0.9
    while computing, and wait for nothing. Rank 1's clock reads 10 s more than rank 0's."""
    def record(op, start, end, waits, offset):
        return comm.CollectiveRecord(op, torch.float32, 4, 16, 12, 12, end - start, 0, 2,
                                     2, 8, start + offset, end + offset,
                                     [(a + offset, b + offset) for a, b in waits], "0")

    def report(rank, offset, all_reduce):
        ledger = [record("all_reduce", *all_reduce, offset),
                  record("all_gather", 0.7, 0.9, [], offset)]
        return RunReport(rank, 2, "hand-made", [1.0], {}, {}, ledger, [1.0],
                         tokens_per_step=100, step_starts=[offset], phases=[[]],
                         clock_offset=offset)

    ranks = [report(0, 0.0, (0.2, 0.7, [(0.2, 0.7)])),
             report(1, 10.0, (0.6, 0.7, [(0.6, 0.7)]))]
    zero, one = step_metrics(ranks)
    assert zero[0]["all_reduce_seconds"] == pytest.approx(0.5)
    assert zero[0]["all_gather_seconds"] == pytest.approx(0.2)
    assert zero[0]["comm_seconds"] == pytest.approx(0.7)
    assert zero[0]["exposed_seconds"] == pytest.approx(0.5)
    assert zero[0]["overlap"] == pytest.approx(0.2 / 0.7)
    assert zero[0]["idle_seconds"] == pytest.approx(0.4)  # from 0.2 to rank 1's 0.6
    assert one[0]["exposed_seconds"] == pytest.approx(0.1)
    assert one[0]["idle_seconds"] == pytest.approx(0.0)
    assert zero[0]["tokens_per_second"] == 100


def test_command_line_prints_and_writes_every_metric(tmp_path, capsys):
    path = tmp_path / "report.json"
    assert main(["--strategy", "zero2", "--world", "2", "--steps", "4", "--no-progress",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    for column in ("tokens/s", "AG ms", "RS ms", "AR ms", "exposed", "overlap%", "idle ms",
                   "alloc MiB", "rsrvd MiB", "save s", "load s"):
        assert column in out
    ranks = json.loads(path.read_text())["ranks"]
    for r in ranks:
        assert set(r["metrics"]) >= {
            "step_ms", "tokens_per_s", "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms",
            "exposed_comm_ms", "overlap_pct", "idle_ms", "peak_allocated", "peak_reserved",
            "checkpoint_save_s", "checkpoint_load_s"}
        assert r["metrics"]["all_gather_ms"] > 0 and r["metrics"]["peak_allocated"] > 0
        assert len(r["steps"]) == 4 and r["ledger"][0]["waits"]


def test_clock_offset_is_zero_on_one_host():
    assert launch(comm.clock_offset, 2) == [0.0, 0.0]


def test_summary_table_lists_every_rank(runs):
    table = summary_table(runs["zero1"])
    assert table.count("\n   0 ") == 2 and table.count("\n   1 ") == 2


def test_the_median_step_leaves_out_the_warm_up_steps_asked():
    from types import SimpleNamespace

    from shardlab.report import median_step_time
    settling = SimpleNamespace(step_times=[9.0, 5.0, 4.0, 1.0, 1.0, 1.0, 1.0, 7.0])
    assert median_step_time(settling) == 1.0 and median_step_time(settling, 3) == 1.0
    assert median_step_time(SimpleNamespace(step_times=[9.0, 5.0, 4.0, 1.0, 7.0]), 1) == 4.0
    assert median_step_time(SimpleNamespace(step_times=[9.0, 5.0, 4.0, 1.0, 7.0]), 3) == 1.0
    # too few steps to leave out that many: the steady ones (all but the first and last)
    assert median_step_time(SimpleNamespace(step_times=[9.0, 5.0, 7.0]), 3) == 5.0
    with pytest.raises(ValueError, match="at least the first"):
        median_step_time(settling, 0)
