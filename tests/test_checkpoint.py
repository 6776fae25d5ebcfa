"""Sharded checkpoints: save, resume on the same or another world size, refuse, export.

Two launches hold every distributed case. World 4: each strategy trains 3 steps and
saves. World 2: each strategy trains 6 steps uninterrupted, 3 steps + save, resume for 3
more, and resumes the world-4 checkpoint for 3 more. Global batches are the same at
every world size (`get_batch` splits one global batch among the ranks).

Tolerances. Same world size: the resumed run must be bit-identical (losses and every
parameter), because a checkpoint restores every number that the next step reads (the
parameters, Adam's m, v and step, fp32 master copies, the RNG state) and the same ranks
then run the same operations in the same order. Other world size: the checkpoint
itself is read exactly (the file has no padding, only each parameter's elements), but the
first 3 steps ran on 4 ranks, whose gradient is the same sum as on 2 ranks taken in
another order: a few float32 ulps, which Adam's division by sqrt(v) passes on to each
update. This is the fp32 parity bound of the ZeRO tests: losses within 1e-5,
parameters within 1e-4 (a tenth of one Adam step at lr 1e-3).
"""

import shutil
from dataclasses import replace

import pytest
import torch

from shardlab import checkpoint
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.train import train_many, train_worker

STRATEGIES = ["zero1", "zero2", "torch-zero1", "zero3", "fsdp2", "torch-fsdp2"]
# bf16-mixed: fp32 masters apart from the parameters (torch-zero1: only on the rank that
# steps the parameter, which alone writes it)
MASTER_WEIGHTS = ["zero1", "torch-zero1", "zero3"]
K = 3  # steps before the save; the whole run is 2K
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4


def base(strategy: str, world: int, **kw) -> TrainConfig:
    return TrainConfig(strategy=strategy, world=world, steps=2 * K, seq_len=16,
                       measure_memory=False, record_ledger=False, keep_params=True, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    on4 = [replace(base(s, 4), steps=K, save_every=K, checkpoint_dir=str(root / "w4" / s),
                   export_path=str(root / f"{s}.pt") if s == "zero3" else None)
           for s in STRATEGIES]
    launch(train_many, 4, on4)
    for s in STRATEGIES:  # saves cut short: a folder never renamed, one never marked
        shutil.copytree(root / "w4" / s / "step-000003", root / "w4" / s / "step-000009.tmp")
        shutil.copytree(root / "w4" / s / "step-000003", root / "w4" / s / "step-000006")
        (root / "w4" / s / "step-000006" / checkpoint.MARKER).unlink()
    on2, names = [], []
    cases = [(s, "fp32") for s in STRATEGIES] + [(s, "bf16-mixed") for s in MASTER_WEIGHTS]
    for s, precision in cases:
        cfg = base(s, 2, precision=precision)
        here = str(root / "w2" / f"{s}-{precision}")
        on2 += [cfg, replace(cfg, steps=K, save_every=K, checkpoint_dir=here),
                replace(cfg, resume=True, checkpoint_dir=here)]
        names += [(s, precision, "full"), (s, precision, "saved"), (s, precision, "resumed")]
        if precision == "fp32":
            on2.append(replace(cfg, resume=True, checkpoint_dir=str(root / "w4" / s)))
            names.append((s, precision, "from4"))
    reports = launch(train_many, 2, on2)[0]
    return {"root": root, **dict(zip(names, reports))}


def assert_params_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("strategy,precision",
                         [(s, "fp32") for s in STRATEGIES]
                         + [(s, "bf16-mixed") for s in MASTER_WEIGHTS])
def test_resume_on_the_same_world_size_is_exact(runs, strategy, precision):
    full, saved, resumed = (runs[(strategy, precision, what)]
                            for what in ("full", "saved", "resumed"))
    assert resumed.first_step == K and len(resumed.losses) == K
    assert saved.losses + resumed.losses == full.losses
    assert_params_equal(full.params, resumed.params)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_on_another_world_size_matches(runs, strategy):
    full, from4 = runs[(strategy, "fp32", "full")], runs[(strategy, "fp32", "from4")]
    # 3, not 6 or 9: the unmarked folder and the one never renamed were passed over
    assert from4.first_step == K
    assert from4.losses == pytest.approx(full.losses[K:], abs=LOSS_TOL)
    for name, p in full.params.items():
        assert torch.allclose(from4.params[name], p, atol=PARAM_TOL, rtol=0), name


def test_an_interrupted_save_is_never_taken_and_is_cleaned_on_resume(runs):
    """The world-2 run resumed from this folder: the never-renamed save is gone, the
    never-marked one is left (it is not shardlab's to judge) but never taken."""
    folder = runs["root"] / "w4" / "zero1"
    assert sorted(f.name for f in folder.iterdir()) == ["step-000003", "step-000006"]
    assert checkpoint.latest(folder).name == "step-000003"
    assert checkpoint.info(checkpoint.latest(folder)) == {
        "step": 3, "world": 4, "strategy": "zero1", "model": "gpt-tiny", "model_config": None,
        "precision": "fp32", "optimizer": "adamw", "samples_seen": 3 * 8,
        "data": {"batch_size": 8, "seq_len": 16, "seed": 0, "variable_lengths": False}}
    with pytest.raises(ValueError, match="not a complete shardlab checkpoint"):
        train_worker(TrainConfig(steps=1, resume=str(folder / "step-000006")))


def test_the_exported_state_dict_loads_into_the_plain_model(runs):
    """Saved by ZeRO-3 on 4 ranks after 3 steps; the run that resumed from the same
    checkpoint on 2 ranks computed step 3's loss with the sharded model."""
    state = torch.load(runs["root"] / "zero3.pt", weights_only=True)
    model = build_model("gpt-tiny")
    model.load_state_dict(state)  # strict: every name, the tied head included
    x, y = get_batch(K, 0, 1, 8, 16)
    with torch.no_grad():
        loss = loss_fn(model(x), y).item()
    assert loss == pytest.approx(runs[("zero3", "fp32", "from4")].losses[0], abs=LOSS_TOL)


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(tmp_path):
    config = TrainConfig(steps=1, save_every=1, checkpoint_dir=str(tmp_path), seq_len=16,
                         measure_memory=False, record_ledger=False)
    train_worker(config)  # one process: "single", saved without a process group
    other = replace(config, model="gpt-small", save_every=0, resume=True, steps=2)
    with pytest.raises(ValueError, match=r"does not match the model: 'tok_emb.weight' has "
                                         r"shape \(256, 64\) in the checkpoint and "
                                         r"\(256, 256\) in the model") as refused:
        train_worker(other)
    message = str(refused.value)  # the first few mismatches, then how many more
    assert message.count(" in the checkpoint and ") == 3 and " more; resume with" in message


def test_resuming_needs_a_complete_checkpoint_and_saving_a_folder(tmp_path):
    with pytest.raises(ValueError, match="no complete checkpoint"):
        train_worker(TrainConfig(steps=1, resume=True, checkpoint_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="need checkpoint_dir"):
        TrainConfig(save_every=2).validate()
    with pytest.raises(ValueError, match="save_every must be a whole number"):
        TrainConfig(save_every=-1, checkpoint_dir=str(tmp_path)).validate()


def test_the_command_line_resumes_on_another_world_size(runs, capsys):
    from shardlab.cli import main
    folder = runs["root"] / "w4" / "zero2"
    assert main(["--strategy", "zero2", "--resume-world", "2", "--steps", str(2 * K),
                 "--seq-len", "16", "--checkpoint-dir", str(folder), "--no-progress",
                 "--no-memory", "--no-ledger"]) == 0
    out = capsys.readouterr().out
    assert f"resumed at step {K}" in out and "zero2 on 2 rank(s)" in out
    assert main(["--strategy", "zero2", "--world", "4", "--resume-world", "2"]) == 2
