"""The diagrams draw what the package does: each one's data checked against the code it
claims to show (the ring's rounds against the ring collectives traced on a fake process
group, the cuts against ZeRO-3's and FSDP2's own `pieces()`, the bytes against
`memory`'s formulas and `comm`'s ring traffic), and each figure drawn at the page's width
with no text smaller than `viz.SMALLEST_PT`. No launch: a fake process group (PyTorch's
`torch.testing._internal.distributed.fake_pg`) plays one rank at a time in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import matplotlib
import pytest
import torch
import torch.distributed as dist
from torch import nn

matplotlib.use("Agg")

from shardlab import comm, diagrams, memory, report, viz  # noqa: E402
from shardlab.cards import card  # noqa: E402
from shardlab.comm.flight import FlightDump, FlightEntry  # noqa: E402
from shardlab.comm.records import CollectiveRecord  # noqa: E402

PSI = memory.num_params("llama-2-7b")


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    """This process as rank `rank` of `world`, on a process group whose collectives move
    nothing: enough to run a strategy's layout code or a ring's schedule for one rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a test left a process group open"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_readable(fig) -> None:
    """At most the column's width as the page receives it, and every text at least the
    smallest size the page shows (`viz.SMALLEST_PT`). The notebook's inline backend saves
    a figure cropped to what it draws plus 0.1 in of padding on each side
    (`bbox_inches="tight"`): that image, not the figure's nominal size, must fit the
    column, or the page scales it down and its text with it."""
    import io

    from matplotlib.text import Text
    from PIL import Image

    assert fig.get_figwidth() <= viz.MAX_WIDTH_IN + 1e-9 and fig.dpi == viz.DPI
    png = io.BytesIO()
    fig.savefig(png, format="png", bbox_inches="tight", dpi=viz.DPI)
    width = Image.open(io.BytesIO(png.getvalue())).width
    assert width <= viz.MAX_WIDTH_IN * viz.DPI, f"saved {width} px wide, over the column"
    fig.canvas.draw()
    small = [(t.get_text(), t.get_fontsize()) for t in fig.findobj(Text)
             if t.get_text().strip() and t.get_visible() and t.get_fontsize() < viz.SMALLEST_PT]
    assert not small, f"text below {viz.SMALLEST_PT} pt: {small[:5]}"
    matplotlib.pyplot.close(fig)


def check_player(anim, frames: int) -> None:
    html = viz.player_html(anim)
    assert html.count("data:image/png") == frames
    assert "http://" not in html and "https://" not in html  # works offline


# ----------------------------------------------------------------------------- the ring


@pytest.mark.parametrize("world", [3, 4])
def test_the_ring_rounds_are_what_the_course_s_rings_send(world, monkeypatch):
    """Each rank's ring_reduce_scatter and ring_all_gather, run on a fake group with
    `dist.isend` watched, send the chunks the diagram draws, round by round."""
    from shardlab.comm import ring_all_gather, ring_reduce_scatter

    sent: list[tuple[int, int]] = []
    real = dist.isend

    def watched(tensor, dst, group=None, **kwargs):
        sent.append((dst, tensor.storage_offset() // tensor.numel()))
        return real(tensor, dst, group=group, **kwargs)

    monkeypatch.setattr(dist, "isend", watched)
    rs, ag = diagrams.ring_sends("reduce_scatter", world), diagrams.ring_sends("all_gather", world)
    for rank in range(world):
        sent.clear()
        with fake_rank(rank, world):
            ring_reduce_scatter(torch.ones(2 * world), check=False)
            ring_all_gather(torch.ones(2), check=False)
        drawn = [(receiver, chunk) for rounds in (rs, ag) for sends in rounds
                 for sender, receiver, chunk in sends if sender == rank]
        assert sent == drawn
    # as many rounds as the ledger counts, and the all-reduce is the one then the other
    assert len(rs) == len(ag) == comm.ring_traffic("reduce_scatter", 100, world, 4)[2]
    assert diagrams.ring_sends("all_reduce", world) == rs + ag


@pytest.mark.parametrize("world", [2, 4, 5])
def test_the_ring_states_end_reduced_then_gathered(world):
    everyone = frozenset(range(world))
    rs = diagrams.ring_states("reduce_scatter", world)[-1]
    assert all(rs[r][r] == everyone for r in range(world))  # rank r: the sum of chunk r
    assert all(len(rs[r][c]) < world for r in range(world) for c in range(world) if c != r)
    for op in ("all_gather", "all_reduce"):
        assert all(held == everyone for row in diagrams.ring_states(op, world)[-1]
                   for held in row)


def test_the_ring_figure_and_its_animation_draw():
    check_readable(diagrams.ring_figure(4, numel=PSI))
    check_readable(diagrams.ring_figure(8))
    with pytest.raises(ValueError, match="2 to 8 ranks"):
        diagrams.ring_animation(9)
    check_player(diagrams.ring_animation(3), frames=2 * (3 - 1) + 1)
    with pytest.raises(ValueError, match="use one of"):
        diagrams.ring_sends("broadcast", 4)


# ----------------------------------------------------------------------------- ZeRO-1, stages


def test_the_zero1_step_reduces_steps_the_own_chunk_then_gathers():
    world = 4
    data = diagrams.zero1_step_data(world, PSI)
    first, scattered, stepped, gathered = data["moments"]
    for r in range(world):
        assert first["holds"][r]["grads"] == ["local"] * world
        assert scattered["holds"][r]["grads"][r] == "mean"
        assert stepped["holds"][r]["params"] == ["new" if c == r else "old"
                                                 for c in range(world)]
        assert gathered["holds"][r]["params"] == ["new"] * world
        assert first["holds"][r]["optimizer"] == [c == r for c in range(world)]
    assert data["sent"] == {op: comm.ring_traffic(op, PSI, world, 2)[0]
                            for op in ("reduce_scatter", "all_gather")}
    assert data["states"] == memory.model_states(PSI, world, 1)
    # where the collectives run is the card's: the reduce-scatter in the step
    assert card("zero1").schedule["reduce_scatter"][0] in scattered["note"]
    check_readable(diagrams.zero1_step_figure(world, PSI))


def test_each_stage_holds_what_its_formula_counts_and_runs_its_card_s_collectives():
    world = 4
    rows = diagrams.holdings_data(PSI, world)
    for stage, row in enumerate(rows):
        assert row["states"] == memory.model_states(PSI, world, stage)
        per = memory.bytes_per_param().as_dict()
        for r, chunks in enumerate(row["chunks"]):
            for category, held in chunks.items():
                whole = getattr(row["states"], category) == per[category] * PSI
                assert held == (list(range(world)) if whole else [r])
        assert {op for ops in row["phases"].values() for op in ops} == \
            set(card(row["strategy"]).schedule)
        assert card(row["strategy"]).zero_stage in (stage, None)
    assert [len(r["chunks"][0]["params"]) for r in rows] == [world, world, world, 1]
    check_readable(diagrams.holdings_figure(PSI, world))


def test_the_hsdp_mesh_is_the_groups_hsdp_builds():
    from shardlab.hsdp import hsdp_rank_lists

    data = diagrams.hsdp_mesh_data(8, 4, PSI)
    shard, replicate = hsdp_rank_lists(8, 4)
    assert data["grid"] == shard
    assert all(data["grid"][i][j] == replicate[j][i] for i in range(2) for j in range(4))
    assert data["volumes"] == comm.hsdp_volume_per_link(PSI, 8, 4, 2)
    with pytest.raises(ValueError, match="shard_group must divide world 8"):
        diagrams.hsdp_mesh_data(8, 3)
    check_readable(diagrams.hsdp_mesh_figure(8, 4, PSI))


# ----------------------------------------------------------------------------- layouts


class TwoLinear(nn.Module):
    """The diagrams' default unit (`diagrams.UNIT`) as a module."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 4, bias=False)
        self.b = nn.Linear(8, 6)

    def forward(self, x):
        return x


@pytest.mark.parametrize("world", [3, 4])
def test_the_cuts_are_zero3_s_and_fsdp2_s_own_ranges(world):
    """Wrapped on rank 0 of a fake group, zero3 and fsdp2 report every rank's range of
    every parameter (`Wrapped.pieces`): the diagram draws the same."""
    from shardlab.precision import get_precision
    from shardlab.optimizers import optimizer_spec
    from shardlab.strategy import get_strategy

    names = {"a.weight": "w1", "b.weight": "w2", "b.bias": "b2"}
    assert [(n, s) for n, s in diagrams.UNIT] == \
        [(names[n], tuple(p.shape)) for n, p in TwoLinear().named_parameters()]
    data = diagrams.cuts_data(diagrams.UNIT, world)
    with fake_rank(0, world):
        for strategy, cut in (("zero3", "flat"), ("fsdp2", "dim-0")):
            wrapped = get_strategy(strategy)(TwoLinear(), get_precision("fp32"),
                                             optimizer_spec("adamw", 1e-3), {"wrap": "model"})
            pieces = {names[p.name]: p.ranges for p in wrapped.pieces()}
            assert pieces == data[cut]["ranges"], strategy
    for cut, d in data.items():
        # every element owned once; every rank stores as much (the collectives are even)
        for name, shape in diagrams.UNIT:
            assert sum(b - a for _, a, b in d["ranges"][name]) == math.prod(shape)
        assert len({sum(n for _, n in row) for row in d["stored"]}) == 1, cut


def test_deepspeed_s_cut_is_the_one_its_predicted_bytes_count():
    """deepspeed_ref.predict counts Σ ceil(n_i/N) elements of optimizer state per rank
    (DeepSpeed's per-parameter partition): what each rank stores under the diagram's cut."""
    from shardlab.deepspeed_ref.predict import predicted_state_bytes
    from shardlab.models import build_model

    model, world = build_model("gpt-tiny"), 3
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    stored = diagrams.cuts_data(shapes, world)["per-parameter"]["stored"]
    elements = {sum(n for _, n in row) for row in stored}
    assert len(elements) == 1
    predicted = predicted_state_bytes(model, 3, world, "fp32")
    assert predicted["optimizer"] == (4 + 8) * elements.pop() + 4  # master, m, v, step


def test_a_flat_range_is_saved_as_the_checkpoint_s_rectangles():
    from shardlab.checkpoint.layout import boxes

    data = diagrams.checkpoint_data(diagrams.UNIT, 3)
    shapes = dict(diagrams.UNIT)
    for name, pieces in data.items():
        covered = []
        for rank, start, stop, rects in pieces:
            assert rects == boxes(shapes[name], start, stop)
            for offsets, sizes, first in rects:
                covered += list(range(first, first + math.prod(sizes)))
        assert covered == list(range(math.prod(shapes[name])))  # each element once
    # rank 1's range of w2 starts and ends inside a row: three rectangles
    assert [len(r) for rank, *_, r in data["w2"] if rank == 1] == [3]
    with pytest.raises(ValueError, match="unknown cut"):
        diagrams.checkpoint_data(diagrams.UNIT, 3, "rows")
    check_readable(diagrams.cuts_figure())
    check_readable(diagrams.checkpoint_figure())


def test_each_parallelism_gives_a_gpu_its_share_of_the_model():
    data = diagrams.parallelism_data("mixtral-8x7b", 4)
    cfg = memory.get_model("mixtral-8x7b")
    parts = {name: d["parts"] for name, d in data["parallelisms"].items()}

    def share(grid, gpu):
        cells = [g for row in grid for g in row]
        return sum(g == gpu for g in cells) / len(cells)

    layers, weights, acts = parts["pipeline"]
    assert [share(layers, g) * cfg.layers for g in range(4)] == [cfg.layers / 4] * 4
    assert share(parts["tensor"][1], 2) == share(parts["context"][2], 2) == 1 / 4
    assert share(parts["context"][1], None) == 1.0  # context parallel keeps every weight
    assert share(parts["expert"][1], 3) == 1 / 4 and share(parts["expert"][2], None) == 1
    assert "expert" not in diagrams.parallelism_data("llama-2-7b", 4)["parallelisms"]
    with pytest.raises(ValueError, match="does not divide the 32 layers"):
        diagrams.parallelism_data("llama-2-7b", 3)
    check_readable(diagrams.parallelism_figure())


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("stage", [0, 3])
def test_memory_over_a_step_adds_up_to_the_formulas(stage):
    world, model = 8, "llama-2-7b"
    cfg = memory.get_model(model)
    data = diagrams.step_memory_data(model, world, stage)
    events = {e["label"]: e["bytes"] for e in data["events"]}
    # after the step, before zero_grad: each unit's model states at this stage
    units = [cfg.root_params()] + [cfg.layer_params()] * cfg.layers
    expected = {part: sum(getattr(memory.model_states(p, world, stage), part) for p in units)
                for part in ("params", "grads", "optimizer")}
    assert {k: events["optimizer step"][k] for k in expected} == expected
    assert sum(expected.values()) == pytest.approx(
        memory.model_states(cfg.num_params(), world, stage).total, rel=1e-6)
    acts = memory.activations(cfg, 1, 4096)
    assert max(e["bytes"]["activations"] for e in data["events"]) == acts.layers + acts.output
    gathered = max(e["bytes"]["gathered"] for e in data["events"])
    assert gathered == (0 if stage < 3 else memory.gathered_unit_bytes(cfg.root_params())
                        + memory.gathered_unit_bytes(cfg.layer_params()))
    last = data["events"][-1]["bytes"]
    assert last["grads"] == last["gathered"] == last["activations"] == 0


def test_memory_figure_and_the_zero3_step_animation_draw():
    check_readable(diagrams.step_memory_figure())
    one_layer = dataclasses.replace(memory.get_model("llama-2-7b"), layers=1)
    frames = len(diagrams.step_memory_data(one_layer, 8, 3)["events"])
    check_player(diagrams.zero3_step_animation(layers=1), frames=frames)


# ----------------------------------------------------------------------------- a straggler


def straggler_reports(world: int = 3, slow: int = 1, delay: float = 0.04, steps: int = 4):
    """Reports of a run in which rank `slow` sleeps `delay` s before every forward, each
    rank on a clock of its own: what a ZeRO-3 run with `slow_rank` records, in small."""
    reports = []
    for rank in range(world):
        offset = 1000.0 * rank  # this clock minus rank 0's
        ledger, starts, times, phases = [], [], [], []
        for step in range(steps):
            t = 1.0 + 0.2 * step
            arrive = t + (delay if rank == slow else 0) + 0.03  # its forward ends
            done = t + delay + 0.035  # the all-gather ends once the slow rank is in
            spans = ([("injected delay", t, t + delay)] if rank == slow else []) + [
                ("forward", arrive - 0.03, arrive), ("backward", done, done + 0.06),
                ("optimizer step", done + 0.06, done + 0.07)]
            phases.append([(w, a + offset, b + offset) for w, a, b in spans])
            ledger.append(CollectiveRecord(
                "all_gather", torch.float32, 1000, 4000, 3000, 3000, done - arrive, step,
                world, start=arrive + offset, end=done + offset,
                waits=[(arrive + offset, done + offset)], group="0"))
            starts.append(t + offset)
            times.append(done + 0.07 - t)
        reports.append(report.RunReport(rank, world, "zero3", [0.0] * steps, {}, {}, ledger,
                                        times, step_starts=starts, phases=phases,
                                        clock_offset=offset))
    return reports


def test_the_straggler_is_the_rank_the_others_wait_for():
    reports = straggler_reports()
    data = diagrams.straggler_data(reports)
    metrics = report.step_metrics(reports)
    for d, rows in zip(data, metrics):  # the idle time of `report`'s metric, steps 1 and 2
        assert d["idle_ms"] == pytest.approx(1e3 * sum(rows[s]["idle_seconds"]
                                                       for s in (1, 2)))
    assert [round(d["idle_ms"]) for d in data] == [80, 0, 80]
    assert data[1]["phases"][0][0] == "injected delay"
    # on rank 0's clock: every rank's first drawn step starts at 0
    assert all(d["step_starts"][0] == pytest.approx(0.0) for d in data)
    check_readable(diagrams.straggler_figure(reports))
    with pytest.raises(ValueError, match="every rank's RunReport"):
        diagrams.straggler_data([])


# ----------------------------------------------------------------------------- a hang


def hang_dumps():
    """Rank 0 left after seq 3 (it decided alone to stop); ranks 1 and 2 wait in seq 4."""
    def entry(seq, finished=True, op="all_gather"):
        return FlightEntry(seq, seq, op, "0", 4096, "float32", "train_step", seq // 2,
                           0.01 * seq, finished)

    done = [entry(s) for s in range(4)]
    return {0: FlightDump(0, 3, "returned", "", done),
            1: FlightDump(1, 3, "raised", "Timed out", done + [entry(4, False)]),
            2: FlightDump(2, 3, "raised", "Timed out", done + [entry(4, False)])}


def test_the_hang_figure_draws_where_the_recorders_point():
    dumps = hang_dumps()
    data = diagrams.hang_data(dumps)
    found = comm.diagnose(dumps)
    assert (data["cause"], data["seq"], data["suspects"]) == ("behind", 4, [0]) == \
        (found.cause, found.seq, found.ranks)
    waits = {r: [e["seq"] for e in lane["entries"] if not e["finished"]]
             for r, lane in data["ranks"].items()}
    assert waits == {0: [], 1: [4], 2: [4]}
    check_readable(diagrams.hang_figure(dumps))
    with pytest.raises(ValueError, match="no flight recorder files"):
        diagrams.hang_data({})
