"""FSDP2's knobs, rebuilt in the course's `fully_shard`, each beside PyTorch's with the same
knob: the same losses and full parameters bit for bit at every step, the same collectives
in the ledger (op, group, elements, dtype, link, bytes), the bytes of an optimizer step
and what a rank holds between micro-batches equal to the formulas (`comm`, `memory`), the
integer `reshard_after_forward`'s backward all-gathers inside the node, FSDP2's default
backward prefetch in PyTorch's order, and bad input refused in one line.

One launch per world size (2 and 4 ranks) runs every case (`knob_workers.knob_cases`); an
integer `reshard_after_forward` needs a divisor of the world between 1 and N, so it runs
on 4 ranks only. Measured on an idle 2-core machine: about 50 s for the module.
"""

from __future__ import annotations

from collections import Counter

import pytest

import knob_workers as kw
from shardlab import comm
from shardlab.config import TrainConfig
from shardlab.fsdp.strategies import RECIPES
from shardlab.launch import launch
from shardlab.memory import held_between_micro_batches
from shardlab.train import run
from shardlab.workers import run_all

STEPS = 3        # the last one also tracks memory
STEADY = 2       # DDP rebuilds its buckets at step 1 (two small broadcasts)
LAUNCH_TIMEOUT = 900
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT * 2)

M = 2  # micro-batches of the accumulation cases
ACCUMULATION = {  # way -> (options, its knobs for the formulas)
    "FSDP2, gradient sync off": {},
    "FSDP2, gradient sync on": {"accumulate": "sync"},
    "FSDP2, no reshard after backward": {"reshard_after_backward": False},
    "ZeRO-1 with fully_shard": RECIPES["zero1"],
    "ZeRO-2 with fully_shard": RECIPES["zero2"],
}


def pairs(variants: list[dict]) -> list[dict]:
    """Each variant as ours, then as PyTorch's compared with ours (`same_as`)."""
    cases = []
    for v in variants:
        strategy = v.pop("strategy", "fsdp2")
        cases.append(dict(strategy=strategy, keep=True, **v))
        cases.append(dict(strategy=f"torch-{strategy}", same_as=len(cases) - 1, **v))
    return cases


def cases_for(world: int) -> list[dict]:
    variants = [{"options": {"prefetch": "backward"}, "order": True},
                {"options": {"prefetch": 2}, "order": True}]
    variants += [{"options": dict(o), "grad_accum": M, "way": w}
                 for w, o in ACCUMULATION.items()]
    # HSDP: reduce-scatter every micro-batch, all-reduce once (S = N/2)
    variants.append({"strategy": "hsdp", "grad_accum": M, "way": "HSDP, all-reduce once",
                     "options": {"shard_group": world // 2, "accumulate": "no_all_reduce"}})
    if world == 4:  # an int R with 1 < R < N: ZeRO++'s hpZ
        variants.append({"options": {"reshard_after_forward": 2}})
    cases = pairs(variants)
    cases += [{"strategy": s, "grad_accum": M, "way": s} for s in ("ddp", "zero1", "zero2")]
    cases.append({"strategy": "torch-ddp", "grad_accum": M, "way": "torch-ddp"})
    return cases


@pytest.fixture(scope="module")
def results():
    out = {}
    for world in (2, 4):
        calls = [(kw.knob_cases, (cases_for(world), STEPS))]
        if world == 2:
            calls.append((kw.refusals, ()))
        out[world] = launch(run_all, world, calls, backend="gloo", timeout=LAUNCH_TIMEOUT)
    return out


def cases(results, world):
    """rank -> its case results."""
    return [r[0] for r in results[world]]


def steady_sent(result) -> int:
    return sum(r[-1] for r in result["ledgers"][STEADY])


@pytest.mark.parametrize("world", [2, 4])
def test_each_knob_trains_as_pytorchs_fully_shard_bit_for_bit(results, world):
    compared = 0
    for rank_results in cases(results, world):
        for r in rank_results:
            if "same_as" in r["case"]:
                assert r["loss_diff"] == 0.0, r["case"]
                assert r["param_diff"] == 0.0, r["case"]
                compared += 1
    assert compared == len(cases(results, world)) * (len(cases_for(world)) - 4) // 2


@pytest.mark.parametrize("world", [2, 4])
def test_each_knob_sends_what_pytorchs_sends(results, world):
    """Every step's collectives, as a multiset (explicit prefetch reorders them): the same
    ops, groups, elements, dtypes, links and bytes. (Over a group of one rank, HSDP with
    S = 1, PyTorch calls no collective and ours calls one that sends nothing: left out.)"""
    def moved(records):
        return Counter(r for r in records if r[1] > 1)

    for rank_results in cases(results, world):
        for r in rank_results:
            if "same_as" in r["case"]:
                ours = rank_results[r["case"]["same_as"]]
                for step, (a, b) in enumerate(zip(ours["ledgers"], r["ledgers"])):
                    assert moved(a) == moved(b), (r["case"], step)


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_of_an_optimizer_step_equal_the_formula(results, world):
    """M micro-batches, fp32: FSDP2's knobs by `comm.fsdp_accumulation_volume`, DDP's,
    ZeRO-1's and ZeRO-2's by `data_parallel_accumulation_volume`; the recipes send what the
    stages send."""
    for rank_results in cases(results, world):
        sent = {}
        for r in rank_results:
            case = r["case"]
            if "way" not in case:
                continue
            strategy, options = case["strategy"], case["options"] if "options" in case else {}
            if strategy in ("ddp", "torch-ddp", "zero1", "zero2"):
                predicted = comm.data_parallel_accumulation_volume(
                    strategy.removeprefix("torch-"), r["psi"], world, M, 4)
            else:
                knobs = {k: v for k, v in options.items() if k != "shard_group"}
                knobs.pop("reshard_after_forward", None)
                predicted = comm.fsdp_accumulation_volume(
                    r["psi"], world, M, 4, shard_group=options.get("shard_group"),
                    reshard_after_forward=options.get("reshard_after_forward", True), **knobs)
            assert steady_sent(r) == predicted, case
            sent[(strategy, case["way"])] = steady_sent(r)
        assert sent[("fsdp2", "ZeRO-1 with fully_shard")] == sent[("zero1", "zero1")]
        assert sent[("fsdp2", "ZeRO-2 with fully_shard")] == sent[("zero2", "zero2")]


@pytest.mark.parametrize("world", [2, 4])
def test_held_between_micro_batches_equals_the_formula(results, world):
    """The bytes held after a micro-batch's backward, before the next forward: the model
    states and what each way keeps across micro-batches (`memory.held_between_micro_batches`),
    plus AdamW's step counters (4 bytes per tensor it steps: 28 for gpt-tiny's parameters,
    1 for the course's flat ZeRO-1/2 shard)."""
    for rank_results in cases(results, world):
        for r in rank_results:
            case = r["case"]
            if "way" not in case:
                continue
            strategy, options = case["strategy"], case.get("options", {})
            way = strategy.removeprefix("torch-")
            if way in ("fsdp2", "hsdp"):
                way = "fsdp"
            knobs = {k: options[k] for k in ("reshard_after_backward", "accumulate")
                     if k in options}
            predicted = held_between_micro_batches(
                way, r["psi"], world, "fp32", shard_group=options.get("shard_group"),
                ddp_bucket_copy=strategy == "torch-ddp", **knobs)
            counters = 4 * (1 if way in ("zero1", "zero2") else 28)
            extra = r["between"] - predicted.total - counters
            reduces = options.get("accumulate") in ("sync", "no_all_reduce") \
                or strategy == "zero2"
            if reduces:
                # a micro-batch that reduce-scatters may leave its last input buffer alive
                # as the next forward starts (its gloo work lets go of it when gloo's thread
                # does; seen on a loaded machine, ours and PyTorch's alike): the formula's
                # bytes, or those plus at most one gradient's
                assert extra == 0 or 0 < extra <= 4 * r["psi"], (case, extra)
            else:
                assert extra == 0, case


def test_integer_reshard_gathers_backward_inside_the_node(results):
    """reshard_after_forward=2 on 4 ranks: each step, forward all-gathers each unit over
    all 4 ranks; backward all-gathers it among 2 ("intra-node", the groups the strategy
    labels: ranks {0, 1} and {2, 3}), from the halves kept after forward; the gradients
    are reduce-scattered over all 4. Ours and PyTorch's alike."""
    units = 3
    for rank_results in cases(results, 4):
        for r in rank_results:
            if r["case"].get("options", {}).get("reshard_after_forward") != 2:
                continue
            psi_bytes = 4 * r["psi"]
            for step in r["ledgers"]:
                inside = [rec for rec in step if rec[1] == 2]
                assert [rec[0] for rec in inside] == ["all_gather"] * units, r["case"]
                assert {rec[4] for rec in inside} == {"intra-node"}
                assert all(rec[1] == 4 and rec[4] == "unlabelled" for rec in step
                           if rec not in inside)
                by_op = Counter()
                for op, size, _, _, _, sent in step:
                    by_op[(op, size)] += sent
                assert by_op == {("all_gather", 4): psi_bytes * 3 // 4,
                                 ("all_gather", 2): psi_bytes // 2,
                                 ("reduce_scatter", 4): psi_bytes * 3 // 4}


AG, RS = ("all_gather", ""), ("reduce_scatter", "")


@pytest.mark.parametrize("world", [2, 4])
def test_the_default_and_explicit_prefetch_run_in_pytorchs_order(results, world):
    """`prefetch="backward"` is PyTorch's default: the root's backward starts by gathering
    the last block, each block's the block before (reverse post-forward order,
    `FSDPParamGroup._backward_prefetch`); explicit prefetch two ahead
    (`set_modules_to_*_prefetch`) with the root on the default. The same events in the
    same order as PyTorch's."""
    for rank_results in cases(results, world):
        orders = {(r["case"]["strategy"], str(r["case"]["options"])): r["order"]
                  for r in rank_results if r["case"].get("order")}
        default = "{'prefetch': 'backward'}"
        assert orders[("fsdp2", default)] == orders[("torch-fsdp2", default)]
        assert orders[("fsdp2", default)][6:9] == [AG, AG, ("backward", "blocks.1")]
        explicit = "{'prefetch': 2}"
        assert orders[("fsdp2", explicit)] == orders[("torch-fsdp2", explicit)]
        # forward: blocks.0 gathers blocks.1 before its forward runs
        assert orders[("fsdp2", explicit)][2:5] == [AG, AG, ("forward", "blocks.0")]


def test_a_knob_pytorch_refuses_is_refused_the_same_way(results):
    said = results[2][0][1]
    assert said["ours int"].startswith(said["torch int"]), said
    assert said["torch int"] == ("ValueError: If passing reshard_after_forward as an int, "
                                 "it should be a factor of 2, not 3")
    assert said["ours float"] == said["torch float"] != ""
    assert said["ours set int"] == said["torch set int"] == (
        "ValueError: reshard_after_forward should be a bool, got <class 'int'>")
    # torch 2.13 sets a flag a 1-D mesh never reads; ours says so instead of doing nothing
    assert said["torch all-reduce"] == ""
    assert "has no replicas" in said["ours all-reduce"]


@pytest.mark.parametrize("strategy, options, message", [
    ("fsdp2", {"reshard_after_forward": 3}, "If passing reshard_after_forward as an int, it "
     r"should be a factor of 4, not 3: use one of \[1, 2, 4\]"),
    ("torch-fsdp2", {"reshard_after_forward": 8}, "should be a factor of 4, not 8"),
    ("fsdp2", {"reshard_after_forward": "2"}, "should be a bool or an int"),
    ("hsdp", {"shard_group": 2, "reshard_after_forward": 4}, "should be a factor of 2, not 4"),
    ("torch-fsdp2", {"accumulate": "no_all_reduce"}, "this run has one replica"),
    ("hsdp", {"shard_group": 4, "accumulate": "no_all_reduce"}, "this run has one replica"),
    ("fsdp2", {"accumulate": "once"}, "accumulate must be one of"),
    ("fsdp2", {"prefetch": 0}, "prefetch must be False, 'backward'"),
    ("fsdp2", {"reshard_after_backward": "no"}, "reshard_after_backward must be True or False"),
])
def test_bad_knobs_are_refused_before_any_process_starts(strategy, options, message):
    with pytest.raises(ValueError, match=message):
        run(TrainConfig(strategy=strategy, world=4, options=options), timeout=1)


def test_the_collectives_of_a_step_by_knob():
    """The counts behind `fsdp_accumulation_volume`, M = 4 micro-batches."""
    count = comm.sharded_collectives_per_step
    assert count(4) == {"all_gather": 8, "reduce_scatter": 1, "all_reduce": 1}
    assert count(4, accumulate="sync") == {"all_gather": 8, "reduce_scatter": 4,
                                           "all_reduce": 4}
    assert count(4, reshard_after_backward=False)["all_gather"] == 5
    assert count(4, **RECIPES["zero1"]) == {"all_gather": 1, "reduce_scatter": 1,
                                            "all_reduce": 1}
    assert count(4, **RECIPES["zero2"])["reduce_scatter"] == 4
    assert count(4, accumulate="no_all_reduce") == {"all_gather": 8, "reduce_scatter": 4,
                                                    "all_reduce": 1}
    # HSDP over (4, 2), all-reduce once: 3 gathers and scatters... of Ψ/2 inside, once across
    assert comm.fsdp_accumulation_volume(1000, 4, 1, shard_group=2) == \
        sum(comm.hsdp_volume_per_link(1000, 4, 2).values())
    with pytest.raises(ValueError, match="accumulate must be"):
        count(2, accumulate="never")
