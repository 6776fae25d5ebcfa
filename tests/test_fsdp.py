"""FSDP2 (`shardlab.fsdp.fully_shard`, per-parameter dim-0 shards) beside PyTorch's
`fully_shard`: the same losses and parameters bit for bit under every option, parity with
a single process, bytes held and moved against the formulas, the helpers, the refusals.

Ours and PyTorch's run the same arithmetic in the same order (the same bf16 casts, one
reduce-scatter per unit summing the same buffers, the division by N after it), so they
are compared for exact equality. Against the single process the tolerances of
`test_zero3.py` apply, for the reasons given there.
"""

import pytest

import sharded_workers as w
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.memory import model_states

STEPS = 10
# One launch runs many cases; on a 2-core machine shared with other jobs it can take
# minutes, so the module's launches (run by the first test) get more than pytest's 300 s.
LAUNCH_TIMEOUT = 900
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT * 3)


def pairs(variants):
    """Each variant as ours, then as PyTorch's compared with ours (`same_as`)."""
    cases = []
    for v in variants:
        cases.append(dict(strategy="fsdp2", **v))
        cases.append(dict(strategy="torch-fsdp2", same_as=len(cases) - 1, **v))
    return cases


OPTION_VARIANTS = [{}, {"options": {"reshard_after_forward": False}},
                   {"options": {"prefetch": True}}, {"options": {"offload": True}},
                   {"grad_accum": 2}, {"precision": "bf16-mixed"}]
TOYS = [dict(strategy="fsdp2", model="toy-frozen"), dict(strategy="fsdp2", model="toy-tied"),
        dict(strategy="fsdp2", model="toy-unused", optimizer="sgd-momentum"),
        dict(strategy="fsdp2", model="toy-buffers")]
SIZES = [dict(strategy="fsdp2"), dict(strategy="fsdp2", options={"reshard_after_forward": False}),
         dict(strategy="fsdp2", precision="bf16-mixed")]
ERRORS = ["fsdp-twice", "fsdp-child-after-parent", "fsdp-tied-weight-split-across-units",
          "fsdp-differs-across-ranks"]


@pytest.fixture(scope="module")
def results():
    gloo = {"backend": "gloo", "timeout": LAUNCH_TIMEOUT}
    through_the_loop = [TrainConfig(strategy=s, world=2, steps=STEPS, keep_params=True)
                        for s in ("fsdp2", "torch-fsdp2")]
    return {
        2: launch(w.suite, 2, parity=pairs(OPTION_VARIANTS) + TOYS, sizes=SIZES,
                  errors=ERRORS, helpers=True, train=through_the_loop, steps=STEPS,
                  order=["torch-fsdp2", "fsdp2"], **gloo),
        4: launch(w.suite, 4, parity=pairs([{}, {"options": {"reshard_after_forward": False}},
                                             {"precision": "bf16-mixed"}]),
                  sizes=SIZES[:2], helpers=True, steps=STEPS, **gloo),
        # 3 ranks: no dim 0 of the GPT divides by 3, so every parameter is padded
        3: launch(w.suite, 3, parity=pairs([{}]), sizes=SIZES[:1], steps=STEPS, **gloo),
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_matches_pytorch_fully_shard_exactly(results, world):
    compared = [r for r in results[world][0]["parity"] if "same_as" in r["case"]]
    assert len(compared) >= 1
    for rank_result in results[world]:
        for r in rank_result["parity"]:
            if "same_as" in r["case"]:
                assert r["loss_diff_vs_same_as"] == 0.0, r["case"]
                assert r["param_diff_vs_same_as"] == 0.0, r["case"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_trains_like_a_single_process(results, world):
    for rank_result in results[world]:
        for r in rank_result["parity"]:
            w.check_parity(r, STEPS)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_moves_3psi_with_resharding_and_2psi_without(results, world):
    for rank_result in results[world]:
        for r in rank_result["bytes"]:
            reshard = r["case"].get("options", {}).get("reshard_after_forward", True)
            gather = r["padded_psi"] * r["param_bytes"]     # all-gathered in param_dtype
            scatter = r["padded_psi"] * r["reduce_bytes"]   # reduce-scattered in reduce_dtype
            for step in r["per_step"]:
                assert step == {"all_gather": (2 if reshard else 1) * gather,
                                "reduce_scatter": scatter}, r["case"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_holds_the_stage3_bytes(results, world):
    for rank_result in results[world]:
        for r in rank_result["bytes"]:
            precision = r["case"].get("precision", "fp32")
            predicted = model_states(r["padded_psi"], world, 3, precision, "adamw")
            counters = 4 * r["n_opt_params"]  # AdamW's step counter per sharded parameter
            held = r["held"]
            if precision == "fp32":
                assert (held["params"], held["grads"], held["optimizer"]) == (
                    predicted.params, predicted.grads, predicted.optimizer + counters)
            else:
                # FSDP2's mixed precision keeps fp32 shards (they are the master weights)
                # and fp32 gradients: the 16 bytes per parameter are 4 + 4 + 8 instead of
                # the formula's 2 + 2 + 12, the same total.
                assert held["params"] + held["grads"] + held["optimizer"] == (
                    predicted.total + counters)
                assert held["params"] == 4 * r["padded_psi"] // world


def test_padding_is_counted_when_world_does_not_divide(results):
    r = results[3][0]["bytes"][0]
    assert r["padded_psi"] > r["psi"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_peak_tracks_the_largest_unit(results, world):
    for rank_result in results[world]:
        for r in rank_result["bytes"]:
            if not r["case"].get("options", {}).get("reshard_after_forward", True):
                continue  # every unit stays gathered from forward to backward
            persistent = sum(r["held"].values())
            unit = r["largest_unit"] * r["param_bytes"]
            made_by_the_step = r["peak_by"]["activations"] + r["peak_by"]["temporaries"]
            assert r["peak"] <= persistent + 2 * unit + made_by_the_step, r["case"]


def test_fully_shard_keeps_names_and_pytorch_calling_convention(results):
    for world in (2, 4):
        for rank_result in results[world]:
            h = rank_result["helpers"]
            assert h["class"] == "FSDPGPT" and h["block_class"] == "FSDPBlock"
            assert h["state_dict_names_kept"] and h["shard_shapes_ok"]


def test_gather_and_load_full_parameters(results):
    for world in (2, 4):
        for rank_result in results[world]:
            h = rank_result["helpers"]
            assert h["rank0_only"], "rank 0 gets the full parameters, the others nothing"
            assert h["round_trip"] and h["same_output"]
            assert "does not match the model" in h["bad_state_dict"]


def test_fully_shard_refuses_misuse(results):
    errors = results[2][0]["errors"]
    assert "already applied" in errors["fsdp-twice"]
    assert "bottom-up" in errors["fsdp-child-after-parent"]
    assert "differs across ranks" in errors["fsdp-differs-across-ranks"]
    # sharding the tied weight again from the root would untie embedding and head
    assert "'lm_head.weight'" in errors["fsdp-tied-weight-split-across-units"]
    assert "fully_shard(Embedding), which already sharded it" in \
        errors["fsdp-tied-weight-split-across-units"]


def test_fsdp2_refuses_unknown_options():
    from shardlab.fsdp import wrap_fsdp2, wrap_torch_fsdp2
    from shardlab.precision import get_precision

    for wrap in (wrap_fsdp2, wrap_torch_fsdp2):
        with pytest.raises(ValueError, match="reshard_after_forward"):
            wrap(None, get_precision("fp32"), w.OPTIMIZERS["adamw"], {"reshard": False})


def test_the_training_loop_runs_fsdp2_like_pytorch(results):
    """Through `shardlab.train` (the registry, the loop, the report): the same losses and
    parameters as PyTorch's, and the ledger's 3Ψ per step."""
    for rank_result in results[2]:
        ours, theirs = rank_result["train"]
        assert ours.losses == theirs.losses
        assert set(ours.params) == set(theirs.params)
        assert all((ours.params[k] == theirs.params[k]).all() for k in ours.params)
        for step in range(1, STEPS - 1):
            moved = sum(r.logical_bytes for r in ours.ledger if r.step == step)
            assert moved == 3 * ours.psi * 4  # gpt-tiny needs no padding on 2 ranks


AG, RS = ("all_gather", ""), ("reduce_scatter", "")


def test_pytorch_fsdp2_prefetches_the_next_unit_in_backward_by_default(results):
    """PyTorch's `fully_shard` with its defaults (no `set_modules_to_*_prefetch`), one
    steady step of gpt-tiny (units: blocks.0, blocks.1, the root), against the course's
    `fsdp2` (prefetch off, its default). Forward is the same: each unit gathered as its
    forward starts, none ahead (FSDP2's forward overlap is its all-gather stream running
    while the CPU runs ahead: a GPU effect, nothing on a CPU). Backward differs: FSDP2
    launches each block's all-gather before that block's backward starts, while the unit
    after it in forward order runs its backward, and before that unit's reduce-scatter
    (`FSDPParamGroup._backward_prefetch`: the next in reverse post-forward order); the
    course's `fsdp2` gathers each block on demand, when its backward starts."""
    forward = [AG, ("forward", "root"), AG, ("forward", "blocks.0"), AG,
               ("forward", "blocks.1")]
    for rank_results in results[2]:
        theirs, ours = (rank_results["order"][s] for s in ("torch-fsdp2", "fsdp2"))
        assert theirs[:6] == ours[:6] == forward
        assert theirs[6:] == [AG,                              # the root, for its backward
                              AG,                              # blocks.1, prefetched
                              ("backward", "blocks.1"),
                              AG,                              # blocks.0, prefetched ...
                              RS,                              # ... before blocks.1's RS
                              ("backward", "blocks.0"),
                              RS, RS]
        assert ours[6:] == [AG, ("backward", "blocks.1"), AG, RS,
                            ("backward", "blocks.0"), AG, RS, RS]
