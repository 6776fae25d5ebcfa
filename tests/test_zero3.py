"""ZeRO-3 (`shardlab.sharded`, flat padded shard per unit): parity with a single process,
bytes held against `shardlab.memory`'s stage-3 formula, bytes moved against 3Ψ / 2Ψ,
the peak against its bound, and the refusals.

One launch per world size runs every case (each launch costs seconds of start-up).

Tolerances, and why they are not zero: the single process sums the gradient over the
whole batch at once, the ranks sum their halves and then each other's, so fp32 rounding
differs (relative 1e-7). Losses stay within 1e-5 of each other over 10 steps. AdamW
divides each gradient element by its own running RMS, so an element whose gradient is
only rounding noise (cancellation) moves by up to ~lr per step in either run whatever the
noise: the parameters are compared to 1% of that worst case, `0.01 * lr * steps`, and with
SGD + momentum (no normalization) to 1e-6. bf16 ("bf16-mixed", bf16 gradients summed in a
different order) is compared with a bf16 single process: losses within 1e-2, parameters
within the Adam bound `2 * lr * steps`.
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

ZERO3 = [
    dict(strategy="zero3"),
    dict(strategy="zero3", options={"reshard_after_forward": False}),
    dict(strategy="zero3", options={"prefetch": True}),
    dict(strategy="zero3", grad_accum=2),
    dict(strategy="zero3", model="toy-frozen"),
    dict(strategy="zero3", model="toy-tied"),
    dict(strategy="zero3", model="toy-unused", optimizer="sgd-momentum"),
    dict(strategy="zero3", optimizer="sgd-momentum", options={"wrap": "model"}),
    dict(strategy="zero3", precision="bf16-mixed"),
]
SIZES = [dict(strategy="zero3"), dict(strategy="zero3", options={"reshard_after_forward": False}),
         dict(strategy="zero3", precision="bf16-mixed")]
ERRORS = ["zero3-wrap-class-not-in-model", "zero3-differs-across-ranks"]


@pytest.fixture(scope="module")
def results():
    gloo = {"backend": "gloo", "timeout": LAUNCH_TIMEOUT}
    through_the_loop = [TrainConfig(strategy="zero3", world=3, batch_size=12,
                                    precision="bf16-mixed", steps=4)]
    return {
        3: launch(w.suite, 3, parity=ZERO3, sizes=SIZES, errors=ERRORS, steps=STEPS,
                  train=through_the_loop, **gloo),
        2: launch(w.suite, 2, parity=ZERO3[:3] + ZERO3[-1:], steps=STEPS, **gloo),
        4: launch(w.suite, 4, parity=ZERO3[:1], sizes=SIZES[:1], steps=STEPS, **gloo),
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero3_trains_like_a_single_process(results, world):
    ranks = results[world]
    for rank_result in ranks:
        assert len(rank_result["parity"]) > 0
        for r in rank_result["parity"]:
            w.check_parity(r, STEPS)
    # every rank reports the same global-batch losses
    first = [r["losses"] for r in ranks[0]["parity"]]
    assert all([r["losses"] for r in other["parity"]] == first for other in ranks)


@pytest.mark.parametrize("world", [3, 4])
def test_zero3_moves_3psi_with_resharding_and_2psi_without(results, world):
    for rank_result in results[world]:
        for r in rank_result["bytes"]:
            reshard = r["case"].get("options", {}).get("reshard_after_forward", True)
            # Ψ here is the padded Ψ: a rank sends and receives whole padded shards.
            gather = r["padded_psi"] * r["param_bytes"]
            scatter = r["padded_psi"] * r["reduce_bytes"]
            for step in r["per_step"]:
                assert step == {"all_gather": (2 if reshard else 1) * gather,
                                "reduce_scatter": scatter}, r["case"]


def test_padding_is_counted_when_world_does_not_divide(results):
    r = results[3][0]["bytes"][0]
    assert r["padded_psi"] > r["psi"]  # 3 does not divide gpt-tiny's units
    assert r["padded_psi"] - r["psi"] < 3 * 4  # at most N-1 elements per unit (4 units)


@pytest.mark.parametrize("world", [3, 4])
def test_zero3_holds_the_stage3_bytes(results, world):
    for rank_result in results[world]:
        for r in rank_result["bytes"]:
            precision = r["case"].get("precision", "fp32")
            predicted = model_states(r["padded_psi"], world, 3, precision, "adamw")
            # AdamW also keeps a 4-byte step counter per parameter it steps (one flat
            # shard per unit): the formula's K counts only m and v (and the master copy).
            counters = 4 * r["n_opt_params"]
            held = r["held"]
            assert held["params"] == predicted.params, r["case"]
            assert held["grads"] == predicted.grads, r["case"]
            assert held["optimizer"] == predicted.optimizer + counters, r["case"]


@pytest.mark.parametrize("world", [3, 4])
def test_zero3_peak_tracks_the_largest_unit(results, world):
    for rank_result in results[world]:
        for r in rank_result["bytes"]:
            if not r["case"].get("options", {}).get("reshard_after_forward", True):
                continue  # without resharding every unit stays gathered: ZeRO-2's peak
            persistent = sum(r["held"].values())
            unit = r["largest_unit"] * r["param_bytes"]
            made_by_the_step = r["peak_by"]["activations"] + r["peak_by"]["temporaries"]
            assert r["peak"] <= persistent + 2 * unit + made_by_the_step, r
            # ... and far from holding the whole model gathered, params and gradients
            full = r["padded_psi"] * (r["param_bytes"] + r["reduce_bytes"])
            assert r["peak"] - persistent - made_by_the_step < full


def test_zero3_refuses_bad_input(results):
    errors = results[3][0]["errors"]
    assert "no module of class ['GPT2Block']" in errors["zero3-wrap-class-not-in-model"]
    assert "differs across ranks" in errors["zero3-differs-across-ranks"]


def test_zero3_refuses_unknown_options():
    from shardlab.precision import get_precision
    from shardlab.zero3 import wrap_zero3

    with pytest.raises(ValueError, match="prefetch"):
        wrap_zero3(None, get_precision("fp32"), w.OPTIMIZERS["adamw"], {"prefech": True})



def test_the_training_loop_reports_zero3_bytes(results):
    """Through `shardlab.train`: the report's bytes held and moved on 3 ranks (padding)."""
    padded = results[3][0]["bytes"][0]["padded_psi"]
    for rank_result in results[3]:
        report = rank_result["train"][0]
        predicted = model_states(padded, 3, 3, "bf16-mixed", "adamw")
        assert report.state_bytes["params"] == predicted.params
        assert report.state_bytes["grads"] == predicted.grads
        for step in (1, 2):
            moved = sum(r.logical_bytes for r in report.ledger if r.step == step)
            assert moved == 3 * padded * 2  # bf16 all-gathers and reduce-scatters
