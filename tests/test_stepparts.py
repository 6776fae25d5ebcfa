"""The optimizer's part of the step, as each strategy lays out what a rank steps.

* the layouts on the cards list the tensors the wrapped strategies' optimizers really step,
  rank by rank (one launch of 2 ranks, gpt-tiny, every timed strategy): DDP's 28 whole
  parameters, ZeRO-1/2's one flat shard, ZeRO-3's flat shard per unit, FSDP2's dim-0 shard
  of each parameter (DTensors under PyTorch's fully_shard), ZeroRedundancyOptimizer's whole
  parameters split by size;
* the time model prices them per element, per tensor and per DTensor (no clock read);
* a collective inside a step costs its kind's measured in-step line (seconds a call plus
  seconds per byte), which every rank measures alike; a kind not measured costs its α-β
  time alone;
* a strategy's own work is priced per parameter tensor and per unit past the first,
  measured on probes alike on every rank; the training loop's own work a step and its
  ledger's a collective likewise;
* a strategy without a layout is refused in one line.
"""

import pytest

from shardlab.cards import CARDS
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.models import build_model
from shardlab.probes import loop_costs
from shardlab.stepparts import (LAYOUTS, InStepCost, OptimizerCosts, optimizer_seconds,
                                stepped_tensors)
from shardlab.steptime import Machine, predict_step
from shardlab.workers import optimizer_layouts, run_all
from steptime_workers import returned_work

TIMED = [n for n, c in CARDS.items() if c.schedule is not None and not c.one_process]


@pytest.fixture(scope="module")
def model():
    return build_model("gpt-tiny", 0)


@pytest.fixture(scope="module")
def launched():
    unledgered = TrainConfig(world=2, batch_size=4, seq_len=8, record_ledger=False)
    return launch(run_all, 2, [(optimizer_layouts, (TIMED,)),
                               (returned_work, (["torch-fsdp2"],)),
                               (loop_costs, (unledgered, 1, 2))])


@pytest.fixture(scope="module")
def wrapped(launched):
    return [out[0] for out in launched]


def test_every_timed_strategy_has_a_layout():
    assert TIMED and all(CARDS[n].optimizer_layout in LAYOUTS for n in TIMED)


@pytest.mark.parametrize("strategy", TIMED)
def test_the_layout_lists_what_the_optimizer_steps(wrapped, model, strategy):
    expected = stepped_tensors(strategy, model, 2)
    dtensors = LAYOUTS[CARDS[strategy].optimizer_layout][1]
    for rank, out in enumerate(wrapped):
        numels, kinds = out[strategy]
        assert sorted(numels) == sorted(expected[rank]), (strategy, rank)
        assert kinds == {dtensors}, strategy


def test_layouts_differ_in_count_not_in_elements(model):
    psi = sum(p.numel() for p in model.parameters())
    counts = {s: len(stepped_tensors(s, model, 2)[0]) for s in TIMED}
    assert counts["ddp"] == counts["fsdp2"] == counts["torch-fsdp2"] == 28
    assert counts["zero1"] == counts["zero2"] == 1 and counts["zero3"] == 3
    for s in ("zero1", "zero2", "zero3", "fsdp2", "torch-fsdp2"):
        assert sum(stepped_tensors(s, model, 2)[0]) == psi // 2, s
    owned = stepped_tensors("torch-zero1", model, 2)
    assert sum(map(sum, owned)) == psi and sorted(map(len, owned)) == [6, 22]


def test_the_optimizer_is_priced_per_element_per_tensor_and_per_dtensor(model):
    costs = OptimizerCosts(per_element=1e-8, per_tensor=1e-5, per_dtensor=1e-4)
    psi = sum(p.numel() for p in model.parameters())
    assert optimizer_seconds("ddp", model, 2, costs) == pytest.approx(psi * 1e-8 + 28e-5)
    assert optimizer_seconds("zero2", model, 2, costs) == pytest.approx(psi / 2 * 1e-8 + 1e-5)
    assert optimizer_seconds("torch-fsdp2", model, 2, costs) == pytest.approx(
        psi / 2 * 1e-8 + 28 * (1e-5 + 1e-4))
    # the slowest rank: ZeroRedundancyOptimizer's rank of 22 small tensors
    owned = stepped_tensors("torch-zero1", model, 2)
    assert optimizer_seconds("torch-zero1", model, 2, costs) == pytest.approx(
        max(sum(r) * 1e-8 + len(r) * 1e-5 for r in owned))
    machine = Machine(flops=1e9, alpha=1e-4, beta=1e8, adam_seconds=1e-8, hiding=0.0,
                      adam_tensor_seconds=1e-5, dtensor_tensor_seconds=1e-4)
    step = predict_step("torch-fsdp2", model, 2, {}, machine, tokens=128)
    assert step.compute["step"] == optimizer_seconds("torch-fsdp2", model, 2, costs)


def test_costs_are_measured_on_every_rank(wrapped):
    for out in wrapped:
        costs = out["costs"]
        assert isinstance(costs, OptimizerCosts)
        assert costs.per_element > 0 and costs.per_tensor >= 0 and costs.per_dtensor >= 0


def test_collectives_cost_their_kind_s_in_step_line(model):
    from dataclasses import replace

    from shardlab import comm
    plain = Machine(flops=1e9, alpha=1e-4, beta=1e8, adam_seconds=1e-8, hiding=0.0,
                    gloo=False)
    lines = {"all_gather": InStepCost(fixed=3e-4, per_byte=2e-8),
             "reduce_scatter": InStepCost(fixed=5e-4, per_byte=1e-8)}
    measured = replace(plain, in_step=lines)
    a = predict_step("zero3", model, 2, {}, plain, tokens=128)
    b = predict_step("zero3", model, 2, {}, measured, tokens=128)
    assert [c.seconds for c in a.collectives] == [
        pytest.approx(comm.predict_seconds(c.op, c.nbytes, 2, 1e-4, 1e8))
        for c in a.collectives]
    assert [c.seconds for c in b.collectives] == pytest.approx(
        [lines[c.op].fixed + c.nbytes * lines[c.op].per_byte for c in b.collectives])
    # nothing hidden (hiding 0): the step grows by the collectives' extra time alone
    assert b.step_seconds - a.step_seconds == pytest.approx(b.comm_seconds - a.comm_seconds)
    assert b.compute == a.compute
    # a kind the machine has no line for (DDP's all-reduce) keeps its α-β time
    ddp = predict_step("ddp", model, 2, {}, measured, tokens=128)
    assert ddp.comm_seconds == predict_step("ddp", model, 2, {}, plain, tokens=128).comm_seconds
    # gloo's broadcast, measured as gloo runs it: no binomial-tree rule on top
    broadcast = replace(plain, gloo=True, in_step={"broadcast": InStepCost(1e-3, 0.0)})
    owner = predict_step("torch-zero1", model, 4, {}, broadcast, tokens=128)
    sent = [c for c in owner.collectives if c.op == "broadcast"]
    assert sent and all(c.seconds == pytest.approx(1e-3) for c in sent)


def test_in_step_costs_are_measured_alike_on_every_rank(wrapped):
    lines = [out["in_step"] for out in wrapped]
    assert lines[0] == lines[1]
    assert set(lines[0]) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
    for line in lines[0].values():
        assert line.fixed >= 0 and line.per_byte >= 0 and line.seconds(1 << 14) > 0


def test_a_strategy_s_own_work_is_priced_per_parameter_tensor(model):
    from dataclasses import replace
    plain = Machine(flops=1e9, alpha=1e-4, beta=1e8, adam_seconds=1e-8, hiding=0.0)
    working = replace(plain, strategy_work={"torch-fsdp2": 1e-4})
    a = predict_step("torch-fsdp2", model, 2, {}, plain, tokens=128)
    b = predict_step("torch-fsdp2", model, 2, {}, working, tokens=128)
    assert "strategy" not in a.compute
    assert b.compute["strategy"] == pytest.approx(28 * 1e-4)  # gpt-tiny's 28 tensors
    assert b.step_seconds - a.step_seconds == pytest.approx(28 * 1e-4)
    # a strategy the machine has no figure for is priced without it
    assert "strategy" not in predict_step("ddp", model, 2, {}, working, tokens=128).compute
    assert b.timeline()[-1][1] == "strategy's own work"


def test_a_round_of_the_compute_rate_counts_at_the_slowest_rank_s_time(wrapped):
    # rank r timed r + 1 seconds: every rank takes the longest, the pace of a step
    assert [out["slowest"] for out in wrapped] == [2.0, 2.0]


def test_the_strategies_own_work_is_measured_alike_on_every_rank(wrapped):
    works = [out["work"] for out in wrapped]
    per_tensor, per_unit = works[0]
    assert works[0] == works[1] and set(per_tensor) == {"ddp", "torch-fsdp2"}
    assert set(per_unit) == {"torch-fsdp2"}  # DDP has no units
    assert all(w >= 0 for w in per_tensor.values())  # a unit's figure may be below 0


def test_a_strategy_s_own_work_is_priced_per_unit_past_the_first(model):
    from dataclasses import replace

    from shardlab.wrap import unit_modules
    plain = Machine(flops=1e9, alpha=1e-4, beta=1e8, adam_seconds=1e-8, hiding=0.0)
    working = replace(plain, strategy_work={"zero3": 1e-5}, unit_work={"zero3": 1e-3})
    units = len(unit_modules(model, "auto"))
    step = predict_step("zero3", model, 2, {}, working, tokens=128)
    assert units > 1
    assert step.compute["strategy"] == pytest.approx(28 * 1e-5 + (units - 1) * 1e-3)
    # one unit (the whole model): nothing per unit
    whole = predict_step("zero3", model, 2, {"wrap": "model"}, working, tokens=128)
    assert whole.compute["strategy"] == pytest.approx(28 * 1e-5)


def test_a_unit_below_0_comes_off_the_collectives_not_the_compute(model):
    """A unit's figure below 0 says a step's collectives cost less than their lines: the
    step is shorter by it, taken off every collective in proportion, and the compute keeps
    the work per tensor."""
    from dataclasses import replace

    from shardlab.wrap import unit_modules
    plain = Machine(flops=1e9, alpha=1e-4, beta=1e8, adam_seconds=1e-8, hiding=0.0)
    units = len(unit_modules(model, "auto"))
    lines = predict_step("zero3", model, 2, {}, replace(plain, strategy_work={"zero3": 1e-5}),
                         tokens=128)
    less = predict_step("zero3", model, 2, {}, replace(
        plain, strategy_work={"zero3": 1e-5}, unit_work={"zero3": -1e-4}), tokens=128)
    assert less.compute["strategy"] == pytest.approx(28 * 1e-5)
    assert lines.comm_seconds - less.comm_seconds == pytest.approx((units - 1) * 1e-4)
    ratios = {c.seconds / d.seconds for c, d in zip(less.collectives, lines.collectives)}
    assert max(ratios) == pytest.approx(min(ratios))  # each by its share
    assert lines.step_seconds - less.step_seconds == pytest.approx((units - 1) * 1e-4)
    # never below nothing
    none = predict_step("zero3", model, 2, {}, replace(plain, unit_work={"zero3": -1.0}),
                        tokens=128)
    assert none.comm_seconds == 0.0 and "strategy" not in none.compute


def test_the_loop_s_own_work_is_measured_alike_on_every_rank(wrapped):
    loops = [out["loop"] for out in wrapped]
    assert loops[0] == loops[1]
    assert loops[0].per_step >= 0 and loops[0].per_collective >= 0


def test_the_loop_s_own_work_is_priced_a_step_and_a_collective(model):
    from dataclasses import replace
    plain = Machine(flops=1e9, alpha=1e-4, beta=1e8, adam_seconds=1e-8, hiding=0.0)
    looped = replace(plain, loop_seconds=2e-4, ledger_seconds=1e-4)
    for strategy in ("ddp", "zero1", "fsdp2"):
        a = predict_step(strategy, model, 2, {}, plain, tokens=128)
        b = predict_step(strategy, model, 2, {}, looped, tokens=128)
        assert "loop" not in a.compute
        assert b.compute["loop"] == pytest.approx(2e-4 + 1e-4 * len(b.collectives))
        assert b.step_seconds - a.step_seconds == pytest.approx(b.compute["loop"])
        assert b.timeline()[-1][1] == "the loop's own work"
    # a run on one rank has no collective to record
    alone = predict_step("ddp", model, 1, {}, looped, tokens=128)
    assert alone.compute["loop"] == pytest.approx(2e-4)


def test_a_loop_without_a_ledger_pays_nothing_a_collective(launched):
    costs = [out[2] for out in launched]
    assert costs[0] == costs[1] and costs[0].per_collective == 0.0


def test_bad_input_is_refused_in_one_line(model):
    with pytest.raises(ValueError, match="no optimizer layout"):
        stepped_tensors("deepspeed-zero2", model, 2)
    with pytest.raises(ValueError, match="dtensor_tensor_seconds"):
        Machine(flops=1, alpha=0, beta=1, adam_seconds=0, hiding=0,
                dtensor_tensor_seconds=-1)
    with pytest.raises(ValueError, match="strategy work, loop and ledger seconds >= 0"):
        Machine(flops=1, alpha=0, beta=1, adam_seconds=0, hiding=0,
                strategy_work={"ddp": -1e-6})
    with pytest.raises(ValueError, match="in-step costs"):
        Machine(flops=1, alpha=0, beta=1, adam_seconds=0, hiding=0,
                in_step={"all_reduce": InStepCost(fixed=-1e-3, per_byte=0.0)})


def test_pytorch_s_fsdp2_waits_each_collective_where_it_calls_it_on_gloo(launched):
    """FSDP2 calls its all-gathers and reduce-scatters with async_op=False: on gloo each
    call returns when its collective is done (it returns no Work to wait later), so the
    time model's gloo schedule for it waits every one, its backward prefetch included."""
    for out in launched:
        calls = out[1]["torch-fsdp2"]
        kinds = {name.split("_single")[0].split("_into")[0].removesuffix("_tensor")
                 for name, _ in calls}
        assert kinds == {"all_gather", "reduce_scatter"}, calls
        assert not any(work for _, work in calls), calls
    places = CARDS["torch-fsdp2"].schedule_on(gloo=True)
    assert places["all_gather"] == (("forward", "waited"), ("backward", "waited"))
    assert places["reduce_scatter"] == ("backward", "waited")
