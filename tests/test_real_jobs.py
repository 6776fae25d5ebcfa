"""Training as real jobs train: gradient clipping by the global norm, the loss averaged
over the global count of tokens of batches of variable lengths, and an optimizer built
before `fully_shard` refused.

Every strategy of the registry trains many steps with clipping active (the clip norm is
far below the gradients' norm, and the test checks that each step clipped) on padded
rows of different lengths, and matches one process over the whole batch; the naive loss
mean and the local-norm clipping are shown to differ. One launch per world size runs
every case.
"""

from dataclasses import replace

import pytest
import torch

import real_jobs_workers as w
from shardlab import deepspeed_ref
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.models import get_batch, global_token_count
from shardlab.train import run, train_many, train_worker

CLIP = 0.05  # the gradients' norm is 2-4 on these steps: every step clips
BASE = TrainConfig(model="gpt-tiny", steps=4, seq_len=16, clip_norm=CLIP,
                   variable_lengths=True, keep_params=True, measure_memory=False)
OURS_SHARDED = ("zero1", "zero2", "zero3", "fsdp2")
REFERENCE_OF = {"ddp": "torch-ddp", "zero1": "torch-zero1", "fsdp2": "torch-fsdp2",
                "zero2": "torch-fsdp2", "zero3": "torch-fsdp2", "hsdp": "torch-hsdp"}
DEEPSPEED_OF = {"zero1": "deepspeed-zero1", "zero2": "deepspeed-zero2",
                "zero3": "deepspeed-zero3"}
HAS_DEEPSPEED = deepspeed_ref.deepspeed_missing() is None
# HSDP with shard groups of one rank: every rank a replica, whose copies the norm must
# count once (the norm is summed over the shard group only)
HSDP = {"shard_group": 1}
WORLDS = {  # world: (global batch, micro-batches, strategies)
    2: (8, 2, ["ddp", "ddp-naive", "torch-ddp", "zero1", "zero2", "torch-zero1", "zero3",
               "fsdp2", "torch-fsdp2", "hsdp", "torch-hsdp"]
        + (["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"] if HAS_DEEPSPEED
           else [])),
    3: (6, 1, ["ddp", "zero1", "zero2", "zero3", "fsdp2", "torch-fsdp2"]),
}
# the naive loss mean, the local norm and bf16-mixed (the norm over fp32 masters), by world
NAIVE = {2: ("ddp", "zero2"), 3: ("fsdp2",)}
LOCAL_NORM = {2: ("ddp", "zero2", "fsdp2"), 3: ("zero3",)}
MIXED = {2: ("zero1", "zero3"), 3: ()}
RECOMPUTE = {2: ("zero3", "fsdp2"), 3: ()}  # each block checkpointed, then sharded
# each block checkpointed around two smaller units (attention, MLP): outside the unit
SMALL_UNITS = {"wrap": "class:CausalSelfAttention,MLP"}
RECOMPUTE_OUTSIDE = {2: ("fsdp2", "torch-fsdp2"), 3: ()}


def cases(world: int) -> list[TrainConfig]:
    batch, accum, strategies = WORLDS[world]
    base = replace(BASE, world=world, batch_size=batch, grad_accum=accum)
    return ([replace(base, strategy=s, options=HSDP if "hsdp" in s else {})
             for s in strategies]
            + [replace(base, strategy=s, loss_mean="per-batch") for s in NAIVE[world]]
            + [replace(base, strategy=s, clip_local_norm=True) for s in LOCAL_NORM[world]]
            + [replace(base, strategy=s, precision="bf16-mixed") for s in MIXED[world]]
            + [replace(base, strategy=s, recompute=True) for s in RECOMPUTE[world]]
            + [replace(base, strategy=s, recompute=True, options=SMALL_UNITS)
               for s in RECOMPUTE_OUTSIDE[world]])


def key(c: TrainConfig) -> tuple:
    return (c.strategy, c.loss_mean, c.clip_local_norm, c.precision) + (
        ("recompute",) if c.recompute else ()) + (
        ("outside",) if c.options.get("wrap") else ())


@pytest.fixture(scope="module")
def results():
    """{world: ({case key: rank 0's report}, {precision: the single-process report})}."""
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same order of reductions
    try:
        for world, (batch, _, _) in WORLDS.items():
            single = {p: train_worker(replace(BASE, batch_size=batch, precision=p))
                      for p in ("fp32", "bf16-mixed") if p == "fp32" or MIXED[world]}
            reports = launch(train_many, world, cases(world), timeout=300)[0]
            out[world] = ({key(c): r for c, r in zip(cases(world), reports)}, single)
    finally:
        torch.set_num_threads(threads)
    return out


def max_param_diff(a, b) -> float:
    return max((a.params[k].float() - b.params[k].float()).abs().max().item()
               for k in b.params)


def test_the_reference_clips_every_step(results):
    for world, (_, single) in results.items():
        norms = single["fp32"].grad_norms
        assert len(norms) == BASE.steps and min(norms) > 10 * CLIP, norms


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_every_strategy_matches_one_process_with_clipping_and_padded_batches(results, world):
    reports, single = results[world]
    ref = single["fp32"]
    for strategy in WORLDS[world][2]:
        r = reports[(strategy, "tokens", False, "fp32")]
        assert len(r.grad_norms) == BASE.steps, strategy          # it clipped every step
        assert r.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5), strategy
        assert r.losses == pytest.approx(ref.losses, rel=1e-5, abs=1e-6), strategy
        assert max_param_diff(r, ref) < 1e-5, strategy


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_ours_match_pytorch_and_deepspeed(results, world):
    reports, _ = results[world]
    done = 0
    for ours, theirs in [*REFERENCE_OF.items(), *DEEPSPEED_OF.items()]:
        if (theirs, "tokens", False, "fp32") not in reports:
            continue
        a = reports[(ours, "tokens", False, "fp32")]
        b = reports[(theirs, "tokens", False, "fp32")]
        assert a.grad_norms == pytest.approx(b.grad_norms, rel=1e-5), (ours, theirs)
        assert a.losses == pytest.approx(b.losses, rel=1e-5, abs=1e-6), (ours, theirs)
        assert max_param_diff(a, b) < 1e-5, (ours, theirs)
        done += 1
    assert done >= (5 if world == 2 else 3)


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_the_norm_costs_one_scalar_all_reduce_when_gradients_are_sharded(results, world):
    reports, _ = results[world]
    for strategy in (*OURS_SHARDED, "ddp"):  # ours: the references' collectives are theirs
        r = reports[(strategy, "tokens", False, "fp32")]
        scalars = [rec for rec in r.ledger
                   if rec.op == "all_reduce" and rec.logical_bytes == 4]
        per_step = [sum(1 for rec in scalars if rec.step == s) for s in range(BASE.steps)]
        # a replicated gradient's norm is local: DDP clips without a collective
        assert per_step == [0 if strategy == "ddp" else 1] * BASE.steps, strategy


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_the_naive_loss_mean_differs(results, world):
    reports, single = results[world]
    ref = single["fp32"]
    for strategy in NAIVE[world]:
        r = reports[(strategy, "per-batch", False, "fp32")]
        # step 0 starts from the same weights: the loss itself is another number
        assert abs(r.losses[0] - ref.losses[0]) > 1e-3, strategy
        assert max_param_diff(r, ref) > 1e-4, strategy


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_clipping_by_local_norms_drifts_once_gradients_are_sharded(results, world):
    reports, single = results[world]
    ref = single["fp32"]
    for strategy in LOCAL_NORM[world]:
        r = reports[(strategy, "tokens", True, "fp32")]
        if strategy == "ddp":  # every rank holds the whole gradient: local is global
            assert max_param_diff(r, ref) < 1e-5
            continue
        assert r.grad_norms[0] < 0.9 * ref.grad_norms[0], strategy  # a shard's norm
        assert max_param_diff(r, ref) > 1e-4, strategy


@pytest.mark.parametrize("world", [w for w in sorted(WORLDS) if MIXED[w]])
def test_mixed_precision_clips_by_the_fp32_master_gradients(results, world):
    reports, single = results[world]
    ref = single["bf16-mixed"]
    for strategy in MIXED[world]:
        r = reports[(strategy, "tokens", False, "bf16-mixed")]
        assert r.grad_norms == pytest.approx(ref.grad_norms, rel=2e-2), strategy
        assert r.losses == pytest.approx(ref.losses, rel=1e-2), strategy


@pytest.mark.parametrize("world", [w for w in sorted(WORLDS) if RECOMPUTE[w]])
def test_recomputation_inside_the_unit_gathers_each_layer_twice(results, world):
    """torchtitan's order (checkpoint each block, then shard the checkpointed block): the
    recomputed forward runs on the parameters the unit's backward gathered, so a step
    gathers each unit twice per micro-batch (forward, backward), as without recomputation,
    and trains the same."""
    reports, single = results[world]
    _, accum, _ = WORLDS[world]
    units = 3  # gpt-tiny under the "auto" policy: 2 blocks and the root
    for strategy in RECOMPUTE[world]:
        plain = reports[(strategy, "tokens", False, "fp32")]
        recomputed = reports[(strategy, "tokens", False, "fp32", "recompute")]
        for r in (plain, recomputed):
            gathers = [rec for rec in r.ledger if rec.step == 1
                       and rec.op.startswith("all_gather")]
            assert len(gathers) == 2 * units * accum, strategy
        assert sorted(rec.logical_bytes for rec in plain.ledger if rec.step == 1) == \
            sorted(rec.logical_bytes for rec in recomputed.ledger if rec.step == 1)
        assert max_param_diff(recomputed, single["fp32"]) < 1e-5, strategy


@pytest.mark.parametrize("world", [w for w in sorted(WORLDS) if RECOMPUTE_OUTSIDE[w]])
def test_recomputation_outside_the_unit_gathers_again(results, world):
    """Each block checkpointed around two units (attention, then MLP): in backward, the
    MLP's gather comes first (its output's gradient arrives), then the block's forward is
    recomputed, which gathers the attention unit a second time in the step; our schedule
    frees it after that forward and gathers it a third time for its backward. PyTorch's
    FSDP2 keeps a unit gathered after a forward that runs inside backward: twice."""
    reports, single = results[world]
    _, accum, _ = WORLDS[world]
    blocks, units = 2, 5  # gpt-tiny: 2 x (attention, MLP) and the root
    attention_bytes = 4 * (64 * 3 * 64 + 3 * 64 + 64 * 64 + 64)
    for strategy, extra in (("fsdp2", blocks), ("torch-fsdp2", 0)):
        r = reports[(strategy, "tokens", False, "fp32", "recompute", "outside")]
        gathers = [rec for rec in r.ledger if rec.step == 1
                   and rec.op.startswith("all_gather")]
        assert len(gathers) == (2 * units + extra) * accum, strategy
        plain = reports[("fsdp2", "tokens", False, "fp32")]
        plain_bytes = sum(rec.logical_bytes for rec in plain.ledger if rec.step == 1
                          and rec.op.startswith("all_gather"))
        assert sum(rec.logical_bytes for rec in gathers) == \
            plain_bytes + extra * attention_bytes * accum, strategy
        assert max_param_diff(r, single["fp32"]) < 1e-5, strategy


def test_padded_batches_are_deterministic_and_cover_the_global_count():
    batch, seq = 8, 16
    for world, accum in ((1, 1), (2, 2), (4, 1)):
        rows = [get_batch(3, r, world, batch, seq, 0, m, accum, variable_lengths=True)
                for r in range(world) for m in range(accum)]
        counted = sum(int((y != -100).sum()) for _, y in rows)
        assert counted == global_token_count(3, batch, seq, 0, variable_lengths=True)
    x1, y1 = get_batch(3, 0, 1, batch, seq, variable_lengths=True)
    x2, y2 = get_batch(3, 0, 1, batch, seq, variable_lengths=True)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert (y1 == -100).any() and len(set((y1 != -100).sum(1).tolist())) > 1


@pytest.mark.parametrize("change,message", [
    ({"clip_norm": 0.0}, "clip_norm must be a finite number > 0"),
    ({"clip_norm": -1.0}, "clip_norm must be a finite number > 0"),
    ({"clip_norm": float("nan")}, r"clip_norm must be a finite number > 0 .*got nan"),
    ({"clip_norm": float("inf")}, r"clip_norm must be a finite number > 0 .*got inf"),
    ({"clip_norm": True}, "clip_norm must be a finite number > 0"),
    ({"loss_mean": "mean"}, "loss_mean must be one of"),
    ({"variable_lengths": "yes"}, "variable_lengths must be True or False"),
    ({"clip_local_norm": True}, "needs clip_norm"),
    ({"clip_norm": 1.0, "clip_local_norm": True, "strategy": "torch-fsdp2"},
     "clip_local_norm is a mistake rehearsed with the course's strategies"),
])
def test_bad_clip_and_loss_settings_are_refused_before_any_process_starts(change, message):
    with pytest.raises(ValueError, match=message):
        run(replace(TrainConfig(strategy="zero2", world=2), **change), timeout=1)


def test_the_command_line_refuses_a_bad_clip_norm(capsys):
    from shardlab.cli import main
    assert main(["--strategy", "zero2", "--world", "2", "--clip-norm", "nan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--clip-norm must be a finite number > 0" in err[0] and "got nan" in err[0]


def test_an_optimizer_built_before_fully_shard_is_refused_at_its_first_step():
    before, after = launch(w.optimizer_before_and_after_fully_shard, 2, timeout=120)[0]
    assert "was built before fully_shard" in before and "Build the optimizer after" in before
    assert "'blocks.0." in before or "'tok_emb" in before  # it names a parameter
    assert "\n" not in before
    assert after is None  # built after: it steps
