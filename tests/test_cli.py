"""`python -m shardlab train`: bad input refused before anything runs, in one line, exit 2."""

import pytest

from shardlab.cli import main

FAST = ["--no-progress", "--no-memory", "--no-ledger", "--seq-len", "16", "--steps", "2"]


def refused(capsys, argv) -> str:
    assert main(FAST + argv) == 2  # argv last: its --seq-len or --steps wins
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and out.strip() == ""  # nothing trained, nothing shown
    return lines[0]


@pytest.mark.parametrize("argv,message", [
    (["--world", "0"], "--world must be a whole number of ranks >= 1, got 0"),
    (["--strategy", "ddp", "--world", "-2"], "--world must be a whole number"),
    (["--resume-world", "0"], "--resume-world must be a whole number of ranks >= 1"),
    (["--world", "2", "--resume-world", "3"], "--resume-world and --world disagree"),
    (["--world", "2"], "strategy 'single' runs on one process"),
    (["--batch-size", "0"], "--batch-size must be a whole number >= 1"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
    (["--seq-len", "100000"], "--seq-len 100000 is longer than model 'gpt-tiny' takes (64 "
                              "positions); use --seq-len <= 64"),
    (["--seed", "-3"], "--seed must be a whole number >= 0"),
    (["--strategy", "ddp", "--world", "3"], "does not split evenly among 3 ranks"),
    (["--json", "/nonexistent-folder/report.json"], "does not exist; create it"),
    (["--save-every", "1", "--checkpoint-dir", "/proc/no/such"], "cannot be written"),
    (["--export", "/proc/no/model.pt"], "cannot be written"),
    (["--device", "cuda"], "device 'cuda' needs a GPU"),
    (["--strategy", "ddp", "--world", "2", "--backend", "nccl"], "nccl"),
    (["--strategy", "ddp", "--wrap", "class:Block"], "--wrap chooses the units of"),
    (["--strategy", "zero3", "--world", "2", "--wrap", "class:GPT2Block"],
     "no module of class ['GPT2Block']"),
    (["--model", "hf-gpt2", "--model-config", "nlayer=2"], "unknown GPT2Config field"),
    (["--strategy", "zero1", "--world", "2", "--option", "bucket=3"], "unknown option"),
    (["--resume"], "no complete checkpoint that verifies"),
    (["--init-from", "/nonexistent-folder"],
     "--init-from loads a Hugging Face folder into an hf-* model, not 'gpt-tiny'"),
    (["--model", "hf-llama", "--init-from", "/nonexistent-folder"],
     "no config.json at '/nonexistent-folder'"),
])
def test_bad_input_is_refused_in_one_line(capsys, tmp_path, argv, message):
    if "--resume" in argv:
        argv = argv + ["--checkpoint-dir", str(tmp_path)]
    assert message in refused(capsys, argv)


def test_resume_with_nothing_left_to_train_is_refused(capsys, tmp_path):
    assert main(["--save-every", "2", "--checkpoint-dir", str(tmp_path)] + FAST) == 0
    capsys.readouterr()
    line = refused(capsys, ["--resume", "--checkpoint-dir", str(tmp_path)])
    assert "nothing to train: the checkpoint step-000002 is at step 2; ask for --steps > 2" \
        in line


def test_resume_with_another_precision_is_refused(capsys, tmp_path):
    assert main(["--save-every", "2", "--checkpoint-dir", str(tmp_path)] + FAST) == 0
    capsys.readouterr()
    argv = ["--resume", "--checkpoint-dir", str(tmp_path), "--steps", "4"]
    for precision in ("bf16", "bf16-mixed"):
        line = refused(capsys, argv + ["--precision", precision])
        assert f"the checkpoint step-000002 was saved with precision 'fp32', not " \
               f"'{precision}': resume it with --precision fp32" in line
    line = refused(capsys, ["--resume", str(tmp_path / "step-000002"), "--steps", "4",
                            "--precision", "bf16"])
    assert "saved with precision 'fp32', not 'bf16'" in line
    line = refused(capsys, argv + ["--optimizer", "sgd"])
    assert "saved with optimizer 'adamw', not 'sgd': resume it with --optimizer adamw" in line


@pytest.mark.parametrize("flags", [["--save-every", "1"], ["--resume"],
                                   ["--export", "model.pt"]])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_checkpoints_are_refused_before_anything_runs(capsys, tmp_path, flags,
                                                                stage):
    flags = [str(tmp_path / f) if f.endswith(".pt") else f for f in flags]
    line = refused(capsys, ["--strategy", f"deepspeed-zero{stage}", "--world", "2",
                            "--checkpoint-dir", str(tmp_path)] + flags)
    field = {"--save-every": "--save-every", "--resume": "resume", "--export": "--export"}
    assert f"strategy 'deepspeed-zero{stage}' cannot {field[flags[0]]} with shardlab's " \
           f"checkpoints: DeepSpeed writes its own checkpoints" in line


def test_a_checkpoint_pytorch_wrote_needs_the_flag_the_command_line_has(capsys, tmp_path):
    """Without a shardlab marker, a checkpoint is refused in the launching process, and
    the command line names its own flag (not load's `trusted=True`)."""
    foreign = tmp_path / "from-pytorch"
    foreign.mkdir()
    (foreign / ".metadata").write_bytes(b"")
    line = refused(capsys, ["--resume", str(foreign)])
    assert f"{foreign} is not a complete shardlab checkpoint" in line
    assert line.endswith("ask for --trust-checkpoint") and "trusted=True" not in line
