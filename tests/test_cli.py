"""`python -m shardlab train`: bad input refused before anything runs, in one line, exit 2
(a misspelt argument before torch is imported, naming the nearest choice); a run stopped
by Ctrl-C or SIGTERM ends in one line naming its step and last checkpoint; a run says
where its files went."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    (["--strategy", "zero1", "--world", "2", "--option", "bucket=3"],
     "unknown option(s) ['bucket'] (did you mean bucket_mb?)"),
    (["--strategy", "hsdp", "--world", "4"], "needs --option shard_group=S, the ranks that "
                                             "share the shards"),
    (["--strategy", "hsdp", "--world", "4"], "e.g. --option shard_group=2"),
    (["--model", "hf-gpt2", "--model-config", "n_layers=2"],
     "unknown GPT2Config field(s) ['n_layers'] (did you mean n_layer?)"),
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
    out = capsys.readouterr().out
    assert f"checkpoints: 1 in {tmp_path}, the newest {tmp_path / 'step-000002'} " \
           f"(continue with --resume)" in out
    line = refused(capsys, ["--resume", "--checkpoint-dir", str(tmp_path)])
    assert "nothing to train: the checkpoint step-000002 is at step 2; ask for --steps > 2" \
        in line
    # the folder that holds the checkpoints, given as one: answered with what it holds
    line = refused(capsys, ["--resume", str(tmp_path), "--steps", "4"])
    assert line == (f"error: {tmp_path} holds checkpoints (step-000002) and is not one "
                    f"itself: resume from the newest that verifies with --resume and "
                    f"--checkpoint-dir {tmp_path}, or from one of them, e.g. --resume "
                    f"{tmp_path / 'step-000002'}")
    assert "--trust-checkpoint" not in line
    # resumed: from which folder, saved by how many ranks; the profiler's files named
    profile = tmp_path / "profile"
    assert main(FAST + ["--resume", str(tmp_path / "step-000002"), "--steps", "4",
                        "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert f"resumed at step 2 from {tmp_path / 'step-000002'}, saved by 1 rank(s)" in out
    assert f"profiler traces: {profile / 'rank0.json'} (open in ui.perfetto.dev)" in out
    assert "AG, RS, AR ms: time in flight of all-gathers" in out  # the legend


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for shown in ("--steps STEPS optimizer steps (default: 10)", "--strategy",
                  "default: single", "--model NAME", "(default: gpt-tiny)",
                  "--checkpoint-dir DIR where checkpoints go, one folder per step "
                  "(default: checkpoints)"):
        assert shown in help_text, shown


# Each misspelt command line, the nearest choice its one line names, and nothing else:
# no usage, no traceback, and torch never imported (it takes seconds).
TYPOS = [
    (["trian"], "unknown command 'trian' (did you mean train?)"),
    (["train", "--strategy", "zero-3"], "--strategy 'zero-3' is not one of its choices "
                                        "(did you mean zero3?)"),
    (["train", "--model", "gpt2"], "--model 'gpt2' is not a model name (did you mean "
                                   "hf-gpt2?)"),
    (["train", "--stpes", "5"], "unknown argument '--stpes' (did you mean --steps?)"),
    (["train", "--precision", "bf16mixed"], "(did you mean bf16-mixed?)"),
    (["memory", "--model", "llama2-7b", "--gpus", "8"], "(did you mean llama-2-7b?)"),
]

TYPO_SCRIPT = """
import contextlib, io, json, sys
from shardlab.__main__ import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        try:
            code = main(argv)
        except SystemExit as exited:
            code = exited.code
    out.append([code, err.getvalue()])
print(json.dumps({"said": out, "torch": "torch" in sys.modules}))
"""


def test_a_typo_is_answered_in_one_line_with_the_nearest_choice_before_torch():
    done = subprocess.run([sys.executable, "-c", TYPO_SCRIPT,
                           json.dumps([argv for argv, _ in TYPOS])],
                          capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(done.stdout)
    for (argv, expected), (code, said) in zip(TYPOS, result["said"]):
        lines = said.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "error: " in lines[0], (argv, said)
        assert expected in lines[0], (argv, lines[0])
    assert result["torch"] is False


def test_a_reader_who_stops_reading_gets_no_traceback():
    done = subprocess.run(f"{sys.executable} -m shardlab memory --model llama-2-7b "
                          f"--gpus 8 | head -1", shell=True, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.startswith("llama-2-7b: psi = 6,738,415,616") and done.stderr == ""


def test_ctrl_c_and_sigterm_end_in_one_line_with_the_step_and_the_last_checkpoint(tmp_path):
    """Both signals at once, each to its own run, after its second checkpoint."""
    runs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        folder = tmp_path / sig.name
        runs[sig] = (folder, subprocess.Popen(
            [sys.executable, "-m", "shardlab", "train", "--strategy", "ddp", "--world", "2",
             "--steps", "1000", "--save-every", "1", "--checkpoint-dir", str(folder),
             "--no-memory"] + FAST[:1] + ["--seq-len", "16"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=ctrl_c_as_at_a_terminal))
    try:
        _signal_after_two_checkpoints(runs)
    finally:
        for _, process in runs.values():
            if process.poll() is None:
                process.kill()


def ctrl_c_as_at_a_terminal():
    """Ctrl-C's default in the run, whatever pytest inherited: a background job of a
    non-interactive shell starts with SIGINT ignored, and Python then never raises
    KeyboardInterrupt (the run would train on, as it should under nohup)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_after_two_checkpoints(runs):
    waiting = dict(runs)
    deadline = time.monotonic() + 240
    while waiting and time.monotonic() < deadline:
        for sig, (folder, process) in list(waiting.items()):
            if (folder / "step-000002").is_dir() or process.poll() is not None:
                process.send_signal(sig)
                del waiting[sig]
        time.sleep(0.1)
    for sig, (folder, process) in runs.items():
        _, err = process.communicate(timeout=120)
        lines = err.strip().splitlines()
        code = 128 + sig
        assert process.returncode == code and len(lines) == 1, (sig, err)
        how = "interrupted" if sig == signal.SIGINT else "terminated"
        # (a save the signal cut short is left as step-N.tmp, removed by the resume)
        saved = sorted(f for f in folder.glob("step-*") if f.suffix != ".tmp")[-1]
        step = int(saved.name.split("-")[1])
        assert lines[0].startswith(f"{how} after step "), lines[0]
        assert int(lines[0].split()[3]) >= step  # the step reached, not before its save
        assert lines[0].endswith(f"last checkpoint {saved} (step {step}); resume with "
                                 f"--resume --checkpoint-dir {folder}"), lines[0]


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
