"""The per-rank figure draws exactly the bytes it is given: a hatched predicted bar beside
each rank's measured bar, stacked by category, and refuses predictions that do not match
the ranks."""

import matplotlib
import pytest

matplotlib.use("Agg")

from shardlab import memory, viz  # noqa: E402


def _stack_tops(ax):
    """{x of a bar's centre: (top of its stack, hatched?)}"""
    tops = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2, 3)
        top = bar.get_y() + bar.get_height()
        hatched = bool(bar.get_hatch())
        old = tops.get(x, (0.0, hatched))
        tops[x] = (max(old[0], top), hatched)
    return [tops[x] for x in sorted(tops)]


def test_per_rank_figure_draws_predictions_beside_every_rank():
    psi, world = 120_576, 4
    predicted = {s: memory.model_states(psi, world, s).as_dict() for s in (0, 3)}
    # rank 2 of the second run measured 1,000 bytes more optimizer state than predicted
    measured3 = [dict(predicted[3]) for _ in range(world)]
    measured3[2]["optimizer"] += 1000
    groups = [{"name": "ddp", "predicted": predicted[0], "measured": [predicted[0]] * world},
              {"name": "zero3", "predicted": [predicted[3]] * world, "measured": measured3}]
    fig = viz.per_rank_figure(groups, unit="B")
    ax = fig.axes[0]
    tops = _stack_tops(ax)
    assert len(tops) == 2 * 2 * world  # a pair per rank per run
    expected = []
    for total_p, ms in [(sum(predicted[0].values()), [sum(predicted[0].values())] * world),
                        (sum(predicted[3].values()), [sum(m.values()) for m in measured3])]:
        for m in ms:
            expected += [(total_p, True), (m, False)]
    assert [t for t, _ in tops] == pytest.approx([t for t, _ in expected])
    assert [h for _, h in tops] == [h for _, h in expected]
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"r{r}" for r in range(world)] * 2


def test_per_rank_figure_refuses_a_prediction_per_rank_of_the_wrong_length():
    one = memory.model_states(1000, 2, 1).as_dict()
    with pytest.raises(ValueError, match="one per rank"):
        viz.per_rank_figure([{"name": "zero1", "predicted": [one] * 3, "measured": [one] * 2}])


def test_reduction_precision_figure_draws_one_line_per_case_at_its_errors():
    from shardlab.comm.reduction_precision import ReductionError
    rows = [ReductionError(n, acc, red, 1e-3 * n if red == "bf16" else 1e-7)
            for n in (2, 4, 8) for acc, red in (("fp32", "fp32"), ("fp32", "bf16"),
                                                ("bf16", "bf16"))]
    ax = viz.reduction_precision_figure(rows)
    lines = {line.get_label(): line for line in ax.get_lines()
             if not line.get_label().startswith("_")}
    assert set(lines) == {"reduce in fp32, accumulate in fp32",
                          "reduce in bf16, accumulate in fp32",
                          "reduce in bf16, accumulate in bf16"}
    bf16 = lines["reduce in bf16, accumulate in fp32"]
    assert list(bf16.get_xdata()) == [2, 4, 8]
    assert list(bf16.get_ydata()) == pytest.approx([2e-3, 4e-3, 8e-3])
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
