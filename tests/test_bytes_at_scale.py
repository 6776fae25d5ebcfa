"""Bytes at scale without values: one rank of N = 2 .. 1,024 (`shardlab.many_ranks`, a
fake process group), measured on the strategies' own code, against the formulas.

* every strategy's model states after a step and its bytes sent in the step equal the
  formulas with their padding exactly, at N that divides everything and at N that does
  not (a flat buffer of Ψ = 120,576 over 1,000 ranks; 64-row tensors over 48);
* the planner's uneven-split term (`memory.dim0_states`): the course's FSDP2 pads every
  rank alike, PyTorch's `fully_shard` keeps Adam's states of the rows that exist, so its
  last rank holds less: both as the planner says, rank by rank;
* HSDP's meshes 2 x 4 and 4 x 16: the bytes on each link are HSDP's formula
  (`comm.hsdp_volume_per_link`);
* padding's cost passes 1% of the course's formula where the formula says.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from matplotlib.text import Text

from shardlab import viz
from shardlab.comm import INTER, INTRA
from shardlab.launch import LaunchError
from shardlab.many_ranks import (ALL, bytes_against_world, ideal, measure_one_rank,
                                 one_rank_of, padding_cost, predicted, sweep)
from shardlab.many_ranks.formulas import STEP_COUNTER
from shardlab.memory import dim0_states, parameter_shapes
from shardlab.models import build_model

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]
WORLDS = [3, 48, 1000, 1024]  # 1000 and 3 divide no flat buffer, 48 no 64-row tensor


@pytest.fixture(scope="module")
def gpt():
    return build_model("gpt-tiny")


def fields(b) -> tuple:
    return b.params, b.grads, b.optimizer, b.sent


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_rank_of_n_holds_and_sends_what_the_formulas_say(gpt, strategy):
    for world in WORLDS:
        assert fields(measure_one_rank(strategy, world)) == \
            fields(predicted(strategy, gpt, world)), (strategy, world)


@pytest.mark.parametrize("model", ["toy-frozen", "toy-tied"])
def test_frozen_and_tied_parameters_at_an_uneven_n(model):
    """A frozen embedding is held whole below stage 3 and sharded, never stepped, at stage
    3; a tied weight is counted once."""
    shapes = build_model(model)
    for strategy in STRATEGIES:
        assert fields(measure_one_rank(strategy, 48, model=model)) == \
            fields(predicted(strategy, shapes, 48)), (model, strategy)


def test_the_formulas_without_padding_are_exact_where_n_divides(gpt):
    """Ψ = 120,576 = 2^8·3·157 and every tensor's rows are multiples of 64: at N = 64
    nothing is padded, and what a rank holds is the course's formula (plus Adam's step
    counters, which the formula leaves out); the ring chunks are whole too."""
    for strategy in STRATEGIES:
        exact, plain = predicted(strategy, gpt, 64), ideal(strategy, gpt, 64)
        assert exact.held - exact.counters == plain.held, strategy
        assert exact.sent == plain.sent, strategy
        assert padding_cost(strategy, gpt, 64) == {"held": 0.0, "sent": 0.0}


@pytest.mark.parametrize("world,rank", [(48, 47), (1000, 999)])
def test_the_planners_uneven_split_rank_by_rank(gpt, world, rank):
    shapes = parameter_shapes(gpt)
    counters = STEP_COUNTER * len(shapes)
    for strategy, padded in (("fsdp2", True), ("torch-fsdp2", False)):
        held = measure_one_rank(strategy, world, rank=rank)
        plan = dim0_states(shapes, world, rank, "fp32", "adamw", optimizer_padded=padded)
        assert (held.params, held.grads, held.optimizer - counters) == \
            (plan.params, plan.grads, plan.optimizer), (strategy, world, rank)
    # PyTorch's last rank holds Adam's states of fewer rows than its first
    first = dim0_states(shapes, world, 0, "fp32", "adamw", optimizer_padded=False)
    assert held.optimizer - counters < first.optimizer


@pytest.mark.parametrize("replicas,shard", [(2, 4), (4, 16)])
def test_hsdp_meshes_send_the_formulas_bytes_on_each_link(gpt, replicas, shard):
    options = {"shard_group": shard}
    world = replicas * shard
    for rank in (0, world - 1):
        got = measure_one_rank("hsdp", world, rank=rank, options=options)
        assert fields(got) == fields(predicted("hsdp", gpt, world, options))
    # gpt-tiny's rows divide by 4 and 16, and its units' shards by the replicas: the
    # chapter's formula, 3Ψ(S-1)/S inside and 2(R-1)/R·Ψ/S across, holds exactly
    assert got.sent == ideal("hsdp", gpt, world, options).sent
    assert set(got.sent) == {INTRA, INTER} and got.sent[INTER] < got.sent[INTRA]


def test_padding_passes_one_percent_where_the_formulas_say(gpt):
    """FSDP2 pads each tensor to ⌈d0/N⌉ rows: gpt-tiny's 64-row tensors cost it 1% by
    N = 3. ZeRO-3 pads each of its 3 units by fewer than N elements: not before N = 420.
    Measured on both sides of each threshold."""
    def first_past(strategy):
        return next(n for n in range(2, 1025)
                    if padding_cost(strategy, gpt, n)["held"] > 0.01)

    assert (first_past("fsdp2"), first_past("zero3")) == (3, 420)
    for strategy, n in (("fsdp2", 3), ("zero3", 420), ("zero3", 419)):
        measured = measure_one_rank(strategy, n)
        padding = measured.held - predicted(strategy, gpt, n).counters - \
            ideal(strategy, gpt, n).held
        assert (padding / ideal(strategy, gpt, n).held > 0.01) == (n != 419), (strategy, n)


def test_the_figure_draws_the_sweep():
    rows = sweep(["zero3", "fsdp2"], [2, 8, 64], measure=[8])
    assert [r["measured"] is not None for r in rows] == [False, True, False] * 2
    fig = bytes_against_world(rows)
    held, sent = fig.axes
    assert len(held.lines) == 2 * 3 and held.get_xscale() == "log"
    assert sent.get_legend() is not None
    # the book's column: no wider, and no text smaller than it shows (`shardlab.viz`)
    assert fig.get_figwidth() <= viz.MAX_WIDTH_IN and fig.dpi == viz.DPI
    fig.canvas.draw()
    assert min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip()) \
        >= viz.SMALLEST_PT


def test_bad_input_is_refused_in_one_line(gpt):
    with pytest.raises(ValueError, match="no formula here for strategy 'torch-ddp'"):
        predicted("torch-ddp", gpt, 8)
    with pytest.raises(ValueError, match="hsdp needs options=.*shard_group.*dividing"):
        predicted("hsdp", gpt, 8, {"shard_group": 3})
    with pytest.raises(ValueError, match="rank must be in 0..7"):
        with one_rank_of(8, rank=8):
            pass
    with one_rank_of(8, rank=5):
        assert (dist.get_rank(), dist.get_world_size()) == (5, 8)
        with pytest.raises(LaunchError, match="no process group"):
            with one_rank_of(2):
                pass
    assert not dist.is_initialized()
    assert ALL == "all"
