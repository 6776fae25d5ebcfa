"""DeepSpeed's ZeRO stages 1-3 (`deepspeed-zero1/2/3`) through the course's loop: they train
like one process, hold the bytes DeepSpeed's own rules predict, move what its schedule
moves, refuse what they cannot run, and print nothing but the run's own output.

Two launches (2 and 4 gloo ranks) run every case: each rank trains the case with
`train.train_worker`, then trains the single-process reference itself. Tolerances are
those of `test_zero.py`, for the reasons given there: fp32 losses within 1e-5 and
parameters within 1e-4 after 10 steps; bf16-mixed parameters within 2 bf16 ulps of the
largest parameter and losses within one bf16 ulp. The bytes are compared exactly: every
byte is a term of `deepspeed_ref.predicted_state_bytes`.

Where DeepSpeed is not installed the launches are skipped, saying how to install it; the
refusal a user then gets is tested without it.
"""

import contextlib
import importlib.util
import io
from dataclasses import replace

import pytest

import deepspeed_workers as w
from shardlab import deepspeed_ref, memory
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.models import build_model
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.strategy import get_strategy

STEPS = 10
FP32_LOSS_TOL, FP32_PARAM_TOL = 1e-5, 1e-4
LAUNCH_TIMEOUT = 900  # one launch runs every case; a shared 2-core machine is slow
needs_deepspeed = pytest.mark.skipif(
    deepspeed_ref.deepspeed_missing() is not None,
    reason=f"{deepspeed_ref.deepspeed_missing()} to run DeepSpeed's stages")
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT * 2)

BASE = TrainConfig(steps=STEPS, batch_size=8, seq_len=16)
# d_model 30: parameters of 30 and 90 elements, and a total that no 2N divides: padding
ODD = {"d_model": 30, "n_head": 3}
SHARD_ALL = {"stage3_param_persistence_threshold": 0}
# gpt-tiny's embeddings, qkv and MLP matrices (>= 12,288 elements) sharded, the rest whole
SHARD_SOME = {"stage3_param_persistence_threshold": 5000}


def stage_cases(**fields) -> list[TrainConfig]:
    return [replace(BASE, strategy=f"deepspeed-zero{s}", **fields) for s in (1, 2, 3)]


def cases_for(world: int) -> list[TrainConfig]:
    sgd = dict(optimizer="sgd-momentum", lr=0.05)
    cases = stage_cases()
    cases += [replace(BASE, strategy="deepspeed-zero3", options=SHARD_ALL),
              replace(BASE, strategy="deepspeed-zero3", options=SHARD_SOME)]
    cases += stage_cases(model_config=ODD)
    cases += stage_cases(precision="bf16-mixed")
    if world == 2:
        # SGD catches a gradient scaled by N or by the micro-batch count (Adam hides it)
        cases += stage_cases(grad_accum=2, **sgd)
        cases += [replace(BASE, strategy="deepspeed-zero3", grad_accum=2,
                          options=SHARD_ALL, **sgd)]
        cases += stage_cases(model="toy-frozen", **sgd)
        cases += stage_cases(model="toy-tied")
        # the default all-reduce is DeepSpeed's choice, not gloo's: switched off, the
        # same stages send each rank its slices with dist.reduce
        cases += stage_cases(options={"use_multi_rank_bucket_allreduce": False})[:2]
        cases += [replace(BASE, strategy="deepspeed-zero2",
                          options={"overlap_comm": True, "reduce_bucket_size": 4096}),
                  replace(BASE, strategy="deepspeed-zero3",
                          options={**SHARD_ALL, "reduce_bucket_size": 1 << 20,
                                   "stage3_prefetch_bucket_size": 0,
                                   "stage3_max_reuse_distance": 0})]
    return cases


REFUSED = [
    ("deepspeed-zero1", "fp32", {"bucket_numel": 4096}),                 # the course's name
    ("deepspeed-zero1", "fp32", {"overlap_comm": True}),                 # not a stage-1 key
    ("deepspeed-zero2", "fp32", {"reduce_bucket_size": "big"}),
    ("deepspeed-zero2", "fp32", {"reduce_bucket_size": 0}),
    ("deepspeed-zero3", "fp32", {"contiguous_gradients": 1}),
    ("deepspeed-zero3", "fp32", {"offload_param": True}),                # on the CPU
    ("deepspeed-zero2", "fp32", {"offload_optimizer": True}),
    ("deepspeed-zero3", "bf16", {}),
]


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    world = request.param
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        results = launch(w.suite, world, cases_for(world), REFUSED,
                         backend="gloo", timeout=LAUNCH_TIMEOUT)
    return world, results, out.getvalue() + err.getvalue()


def key(r) -> tuple:
    return (r["strategy"], r["model"], str(r["model_config"]), r["precision"],
            r["optimizer"], r["grad_accum"], str(r["options"]))


def stage(r) -> int:
    return int(r["strategy"][-1])


@needs_deepspeed
def test_the_ranks_print_nothing(run):
    """Importing and initializing DeepSpeed, and training, print nothing on any rank: no
    accelerator guess, no compiler, no deprecation warnings, no logs."""
    world, results, printed = run
    assert printed == "", printed


@needs_deepspeed
def test_every_rank_reports_the_same_losses(run):
    world, results, _ = run
    for case in range(len(results[0]["parity"])):
        assert len({tuple(r["parity"][case]["losses"]) for r in results}) == 1


@needs_deepspeed
def test_fp32_parity_with_single_process(run):
    world, results, _ = run
    fp32 = [r for r in results[0]["parity"] if r["precision"] == "fp32"]
    assert {stage(r) for r in fp32} == {1, 2, 3}
    for r in fp32:
        assert len(r["losses"]) == STEPS
        assert r["loss_diff"] <= FP32_LOSS_TOL, key(r)
        assert r["param_diff"] <= FP32_PARAM_TOL, key(r)
        assert r["losses"][-1] < r["losses"][0], key(r)


@needs_deepspeed
def test_bf16_mixed_parity_with_bf16_mixed_single_process(run):
    world, results, _ = run
    bf16 = [r for r in results[0]["parity"] if r["precision"] == "bf16-mixed"]
    assert {stage(r) for r in bf16} == {1, 2, 3}
    for r in bf16:
        assert r["param_diff"] <= 2 * 2**-7 * r["param_scale"], key(r)
        for loss, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(loss - ref) <= 2**-8 * abs(ref), key(r)


@needs_deepspeed
def test_state_bytes_per_rank_equal_deepspeeds_rules(run):
    """Every rank's params, grads, optimizer and buffers, to the byte."""
    world, results, _ = run
    checked = 0
    for rank_results in results:
        for r in rank_results["parity"]:
            predicted = deepspeed_ref.predicted_for(r["model"], stage(r), world,
                                                    r["precision"], r["optimizer"],
                                                    r["options"], r["model_config"])
            assert r["state_bytes"] == predicted, key(r)
            checked += 1
    assert checked == world * len(cases_for(world))


@needs_deepspeed
def test_deepspeed_holds_more_than_the_papers_formula(run):
    """The master copy in fp32 (optimizer 12Ψ/N, not 8Ψ/N) and stage 3's persistent small
    parameters (gpt-tiny has none above 1e5 elements: all of it whole on every rank)."""
    world, results, _ = run
    r = {key(x): x for x in results[0]["parity"]}
    for s in (1, 2, 3):
        got = r[key(dict(strategy=f"deepspeed-zero{s}", model="gpt-tiny", model_config=None,
                         precision="fp32", optimizer="adamw", grad_accum=1, options={}))]
        paper = memory.model_states(got["psi"], world, s, "fp32", "adamw")
        assert got["state_bytes"]["optimizer"] == 12 * got["psi"] // world + 4
        assert paper.optimizer == 8 * got["psi"] // world
        if s == 3:
            assert got["state_bytes"]["params"] == 4 * got["psi"] + 4 * got["psi"] // world


@needs_deepspeed
def test_collectives_per_step(run):
    """Stages 1 and 2 all-reduce the gradients and all-gather the padded flat buffer;
    stage 2 reduces every micro-batch, stage 1 once per step. The all-reduce is
    DeepSpeed's default on every backend, not a gloo fallback: its config's
    `use_multi_rank_bucket_allreduce` defaults to true (`deepspeed/runtime/zero/config.py`)
    and `average_tensor` (`deepspeed/runtime/zero/stage_1_and_2.py`) then all-reduces each
    bucket, with no test of the backend; set to false, the same run sends each rank the
    gradients of its partition with `dist.reduce` (Ψ in all, one copy of each element),
    where the paper's reduce-scatter would. Stage 3 reduce-scatters every parameter's padded
    gradient and, with DeepSpeed's reuse distance, all-gathers each sharded parameter once
    per micro-batch (what it gathers for forward stays until backward) and each
    persistent one once per step (after the step changed its partitions). Each step also
    all-reduces the gradient norm (one fp32 or fp64 number), which clipping would use.
    Once, when its first step ends, stage 3 checks that every rank recorded the same
    order of modules and parameters (broadcasts of int64 ids): set-up, not the schedule."""
    world, results, _ = run
    checked = 0
    for r in results[0]["parity"]:
        if r["precision"] != "fp32" or r["options"].get("stage3_max_reuse_distance") == 0:
            continue
        model = build_model(r["model"], 0, r["model_config"])
        sizes = [p.numel() for p in model.parameters() if p.requires_grad]
        psi = sum(sizes)
        padded = -(-psi // (2 * world)) * 2 * world
        per_param_padded = sum(-(-n // world) * world for n in sizes)
        # stage 3 gathers frozen parameters too, and re-gathers every persistent one
        threshold = r["options"].get("stage3_param_persistence_threshold", 100_000)
        every = [-(-p.numel() // world) * world for p in model.parameters()]
        sharded = sum(n for n, p in zip(every, model.parameters()) if p.numel() > threshold)
        gathered = sum(every) + (r["grad_accum"] - 1) * sharded
        for step in range(1, STEPS):
            totals: dict[tuple, int] = {}
            for op, dtype, nbytes, at in r["ledger"]:
                if at == step and (op, dtype) == ("broadcast", "torch.int64"):
                    assert stage(r) == 3 and step == 1, key(r)
                elif at == step:
                    totals[(op, dtype)] = totals.get((op, dtype), 0) + nbytes
            if stage(r) < 3 and r["options"].get("use_multi_rank_bucket_allreduce", True):
                micro = r["grad_accum"] if stage(r) == 2 else 1
                assert totals == {("all_reduce", "torch.float32"): 4 * psi * micro + 4,
                                  ("all_gather", "torch.float32"): 4 * padded}, key(r)
            elif stage(r) < 3:  # use_multi_rank_bucket_allreduce: false
                assert totals == {("reduce", "torch.float32"): 4 * psi,
                                  ("all_reduce", "torch.float32"): 4,  # the norm
                                  ("all_gather", "torch.float32"): 4 * padded}, key(r)
            else:
                assert totals == {("reduce_scatter", "torch.float32"):
                                  4 * per_param_padded * r["grad_accum"],
                                  ("all_gather", "torch.float32"): 4 * gathered,
                                  ("all_reduce", "torch.float64"): 8}, key(r)
        checked += 1
    assert checked >= 5
    assert world == 4 or sum(1 for r in results[0]["parity"] if r["options"].get(
        "use_multi_rank_bucket_allreduce") is False) == 2


@needs_deepspeed
def test_deepspeed_reduces_bf16_gradients_in_bf16_by_default(run):
    """Under bf16 DeepSpeed's stages 1 and 2 all-reduce the gradients in bf16: its
    `communication_data_type` defaults to None, which the engine reads as bf16 when bf16
    is on (`DeepSpeedEngine.communication_data_type`, `deepspeed/runtime/engine.py`), and
    its `grad_accum_dtype` defaults to the model's dtype (`get_data_types`). Besides the
    gradients, one fp32 number (the gradient norm) and one uint8 (the overflow flag,
    `has_overflow`'s ByteTensor) are all-reduced."""
    world, results, _ = run
    checked = 0
    for r in results[0]["parity"]:
        if r["precision"] != "bf16-mixed" or stage(r) == 3:
            continue
        psi = sum(p.numel() for p in build_model(r["model"], 0, r["model_config"]).parameters())
        for step in range(1, STEPS):
            reduced: dict[str, int] = {}
            for op, dtype, nbytes, at in r["ledger"]:
                if at == step and op == "all_reduce":
                    reduced[dtype] = reduced.get(dtype, 0) + nbytes
            assert reduced == {"torch.bfloat16": 2 * psi, "torch.float32": 4,
                               "torch.uint8": 1}, key(r)
        checked += 1
    assert checked == 2


@needs_deepspeed
def test_refusals(run):
    world, results, _ = run
    for rank_results in results:
        messages = rank_results["refusals"]
        assert len(messages) == len(REFUSED)
        for (strategy, precision, options), message in zip(REFUSED, messages):
            assert message != "accepted", (strategy, options)
            assert "\n" not in message
        assert "reduce_bucket_size" in messages[2] and "'big'" in messages[2]
        assert "at least 1" in messages[3]
        assert "true or false" in messages[4]
        assert "on the CPU already" in messages[5] and "on the CPU already" in messages[6]
        assert "bf16-mixed" in messages[7]
        assert "stage3_param_persistence_threshold" not in messages[1]  # stage 1's keys
        assert "allgather_bucket_size" in messages[0]


@needs_deepspeed
def test_checkpoints_are_refused_saying_who_writes_them(run):
    world, results, _ = run
    for rank_results in results:
        assert "save_checkpoint" in rank_results["checkpoint"]


def test_without_deepspeed_the_strategies_say_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else find_spec(name, *a))
    for strategy in ("deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"):
        with pytest.raises(ValueError, match=r"pip install 'deepspeed>=0\.19\.8'"):
            get_strategy(strategy)(build_model("gpt-tiny", 0), get_precision("fp32"),
                                   optimizer_spec("adamw", 1e-3), {})


def test_prediction_terms():
    """The rules, on numbers small enough to check by hand: stages 1-2 pad the flat buffer
    to a multiple of 2N; stage 3 pads each parameter to a multiple of N and keeps whole
    (padded) those of at most the threshold; the bucket is allocated whole."""
    model = build_model("toy-tied", 0)  # 5,168 trainable: 4096 + 512 + 32 + 512 + 16
    assert deepspeed_ref.predicted_state_bytes(model, 1, 3) == {
        "params": 4 * 5172, "grads": 0, "optimizer": 12 * 1724 + 4, "buffers": 0}
    partitions = 1366 + 171 + 11 + 171 + 6
    three = deepspeed_ref.predicted_state_bytes(
        model, 3, 3, options={"stage3_param_persistence_threshold": 512})
    # the whole persistent ones as gathered: 3 padded partitions each
    assert three == {"params": 4 * (partitions + 513 + 33 + 513 + 18),
                     "grads": 4 * (partitions + deepspeed_ref.BUCKET_NUMEL),
                     "optimizer": 12 * partitions + 4, "buffers": 0}
    mixed = deepspeed_ref.predicted_state_bytes(model, 2, 4, "bf16-mixed", "sgd")
    assert mixed == {"params": 2 * 5168, "grads": 0, "optimizer": 4 * 1292, "buffers": 0}
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        deepspeed_ref.predicted_state_bytes(model, 0, 2)
    with pytest.raises(ValueError, match="unknown option"):
        deepspeed_ref.predicted_state_bytes(model, 1, 2,
                                            options={"stage3_max_live_parameters": 1})


@needs_deepspeed
def test_estimator_is_deepspeeds_formula():
    """`deepspeed_estimate` is DeepSpeed's own estimator: 2Ψ + 18Ψ/N at stage 2 (bf16
    parameters; bf16 and fp32 gradients, fp32 master, Adam's two states per partitioned
    parameter), 4L + 18Ψ/N at stage 3 (L the largest module); the chapter sets it beside
    the planner. Its defaults come from DeepSpeed's config, not from the course's."""
    psi, largest, gpus = 7_000_000_000, 131_072_000, 8
    assert deepspeed_ref.deepspeed_estimate(2, psi, largest, gpus) == 2 * psi + 18 * psi // gpus
    assert deepspeed_ref.deepspeed_estimate(3, psi, largest, gpus) == 4 * largest + 18 * psi // gpus
    with pytest.raises(ValueError, match="stages 2 and 3"):
        deepspeed_ref.deepspeed_estimate(1, psi, largest, gpus)
    defaults = deepspeed_ref.zero_config_defaults()
    assert defaults["stage3_param_persistence_threshold"] == 10**5
    assert defaults["reduce_bucket_size"] == 5 * 10**8
    rows = deepspeed_ref.estimates_beside_planner("gpt-small", 4)
    assert [r["stage"] for r in rows] == [2, 3]
    assert rows[0]["deepspeed_estimate"] == 2 * rows[0]["psi"] + 18 * rows[0]["psi"] // 4
