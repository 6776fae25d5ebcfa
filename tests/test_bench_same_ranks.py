"""`benchmarks/bench_same_ranks.py`'s own arithmetic: the turns it gives the strategies,
the ratio it reports, and what it refuses. Nothing is timed here (its runs are in the
README, checked by `test_readme_results.py`)."""

import importlib.util
import itertools
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it reads bench_strategies' helpers
    spec = importlib.util.spec_from_file_location("bench_same_ranks",
                                                  BENCHMARKS / "bench_same_ranks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("count", [2, 3, 8])
def test_every_strategy_goes_first_and_follows_each_other_alike(bench, count):
    names = [f"s{i}" for i in range(count)]
    rounds = [bench.turn_order(names, k) for k in range(2 * count)]
    assert all(sorted(order) == names for order in rounds)
    firsts = [order[0] for order in rounds]
    assert all(firsts.count(n) == 2 for n in names)
    before = {pair: 0 for pair in itertools.permutations(names, 2)}
    for order in rounds:
        for i, a in enumerate(order):
            for b in order[i + 1:]:
                before[a, b] += 1
    assert all(before[a, b] == before[b, a] for a, b in before)


def test_a_ratio_is_the_median_of_the_rounds_ratios_after_the_warmup(bench):
    ours = {"seconds": [9.0, 1.0, 2.0, 3.0, 4.0, 5.0], "losses": [1.0] * 6,
            "cpu_seconds": [9.0, 4.0, 4.0, 1.0, 4.0, 4.0]}
    theirs = {"seconds": [1.0, 2.0, 2.0, 2.0, 2.0, 2.0], "losses": [1.0] * 5 + [1.25],
              "cpu_seconds": [1.0, 5.0, 4.0, 4.0, 5.0, 8.0]}
    rows = bench.rows_of({"ddp": ours, "torch-ddp": theirs}, {"ddp": "torch-ddp"}, warmup=1)
    # rounds 2-6: ratios 0.5, 1, 1.5, 2, 2.5 (the warm-up round's 9.0 left out)
    assert rows["ddp"]["ratio"] == 1.5 and rows["ddp"]["step_ms"] == 3000.0
    assert rows["ddp"]["ratio_q1"] < 1.5 < rows["ddp"]["ratio_q3"]
    # CPU time, summed over the ranks: rounds 2-6 give ratios 0.8, 1, 0.25, 0.8, 0.5
    assert rows["ddp"]["cpu_ratio"] == 0.8 and rows["ddp"]["cpu_ms"] == 4000.0
    assert rows["torch-ddp"]["cpu_ms"] == 5000.0
    assert rows["ddp"]["cpu_ratio_q1"] < 0.8 <= rows["ddp"]["cpu_ratio_q3"]
    assert rows["ddp"]["loss_diff"] == 0.25
    assert rows["torch-ddp"]["reference"] is None and rows["torch-ddp"]["ratio"] is None


@pytest.mark.parametrize("argv, says", [
    (["--strategies", "ddp"], "two or more different strategies"),
    (["--strategies", "ddp", "ddp"], "two or more different strategies"),
    (["--rounds", "6", "--warmup", "3"], "at least 4 timed rounds"),
])
def test_bad_arguments_are_refused_before_any_launch(bench, argv, says):
    with pytest.raises(SystemExit, match=says):
        bench.main(argv)
