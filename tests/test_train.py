"""The training loop, its report, its refusals and its command line (launcher and
torchrun)."""

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from shardlab import comm, memory
from shardlab.cli import main
from shardlab.config import TrainConfig
from shardlab.models import build_model
from shardlab.train import run, train_worker


@pytest.fixture(autouse=True)
def _one_thread_everywhere(one_thread):
    """Every test of this file compares with references run in this process."""


@pytest.mark.parametrize("change,message", [
    ({"strategy": "dpp"}, "unknown strategy 'dpp'"),
    ({"precision": "fp8"}, "unknown precision 'fp8'"),
    ({"model": "gpt-huge"}, "unknown model 'gpt-huge'"),
    ({"model": "gpt2"}, r"unknown model 'gpt2' \(did you mean hf-gpt2\?\)"),
    # a published size is built whole by every rank first: refused where it cannot fit
    ({"model": "gpt3-175b", "world": 1}, r"1 rank\(s\) building it in fp32 need 698.4 GB"),
    ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
    ({"strategy": "ddp", "world": 3}, "multiple of 3"),
    ({"strategy": "ddp", "world": 2, "grad_accum": 3}, "multiple of 6"),
    ({"steps": 0}, "steps must be a whole number >= 1"),
    ({"lr": float("nan")}, "lr must be a finite number > 0, got nan"),
    ({"lr": -1.0}, "lr must be a finite number > 0, got -1.0"),
    ({"lr": float("inf")}, "lr must be a finite number > 0"),
    ({"seq_len": 100000}, r"seq_len 100000 is longer than model 'gpt-tiny' takes \(64 "),
    ({"model": "hf-llama", "seq_len": 65}, r"longer than model 'hf-llama' takes \(64 "),
    ({"model": "toy-tied", "seq_len": 10**6}, "longer than the training corpus"),
    ({"seed": -1}, "seed must be a whole number >= 0"),
    ({"crash_at_step": -2}, "crash_at_step must be a step"),
    ({"slow_rank": 3, "slow_seconds": 0.1}, "slow_rank must be a rank of the run"),
    ({"slow_rank": 0, "slow_seconds": float("inf")}, "slow_seconds must be a finite"),
    ({"memory_limit": 0}, "memory_limit must be a whole number of bytes"),
])
def test_bad_configs_are_refused_before_any_process_starts(change, message):
    with pytest.raises(ValueError, match=message):
        run(replace(TrainConfig(), **change), timeout=1)  # 1 s: far too short to launch


def test_unknown_options_are_refused_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"'ddp' got unknown option\(s\) \['bucket'\] "
                                         r"\(did you mean bucket_mb\?\).*bucket_mb"):
        run(TrainConfig(strategy="ddp", world=1, options={"bucket": 4}))


def test_single_reports_losses_memory_and_parameters():
    config = TrainConfig(steps=10, keep_params=True, world=4)  # single runs on 1 process
    [report] = run(config)
    assert (report.rank, report.world, report.strategy) == (0, 1, "single")
    assert len(report.losses) == len(report.step_times) == 10
    assert report.losses[-1] < report.losses[0] - 0.3  # it learns
    psi = sum(p.numel() for p in build_model("gpt-tiny").parameters())
    assert report.psi == psi
    predicted = memory.model_states(psi, 1, 0, "fp32", "adamw")
    counters = 4 * sum(1 for _ in build_model("gpt-tiny").parameters())  # AdamW's steps
    assert report.state_bytes["params"] == predicted.params
    assert report.state_bytes["grads"] == predicted.grads
    assert report.state_bytes["optimizer"] == predicted.optimizer + counters
    assert report.peak["total"] >= predicted.params + predicted.optimizer
    assert report.ledger == []  # one process, no collectives
    # the same run in this process gives the same losses and parameters, bit for bit
    # (one thread, like a launched rank: the thread count changes the summation order)
    here = train_worker(replace(config, world=1, measure_memory=False))
    assert here.losses == report.losses
    assert all(torch.equal(here.params[k], report.params[k]) for k in here.params)


def test_gradient_accumulation_matches_the_whole_batch_at_once():
    base = TrainConfig(steps=10, keep_params=True, measure_memory=False, record_ledger=False)
    whole = train_worker(base)
    accumulated = train_worker(replace(base, grad_accum=4))
    # 4 means of 2 rows, each divided by 4, instead of one mean of 8 rows: fp32 rounding
    # only, which Adam's normalized update can lift to ~1e-5 on near-zero gradients
    assert max(abs(a - b) for a, b in zip(whole.losses, accumulated.losses)) < 1e-5
    assert max((whole.params[k] - accumulated.params[k]).abs().max().item()
               for k in whole.params) < 1e-4


def test_train_step_is_the_four_lines_over_the_micro_batches():
    """One step over 3 micro-batches: the same parameters as the four lines written out,
    bit for bit; every micro-batch but the last under no_sync; the watch's points in
    order, the states counted before zero_grad frees the gradients."""
    import copy

    from shardlab.models import get_batch, loss_fn
    from shardlab.step import HeldAfterStep, train_step
    from shardlab.strategy import Wrapped

    model = build_model("gpt-tiny")
    by_hand = copy.deepcopy(model)
    batches = [get_batch(0, 0, 1, 6, 16, micro=m, micro_steps=3) for m in range(3)]
    synced = []

    @contextlib.contextmanager
    def no_sync():
        synced.append(False)
        yield

    class Seen(HeldAfterStep):
        def __init__(self, wrapped):
            super().__init__(wrapped)
            self.points = []

        def phase(self, what):
            self.points.append(what)
            return contextlib.nullcontext()

        def next_forward(self):
            self.points.append("next forward")

    wrapped = Wrapped(model, torch.optim.AdamW(model.parameters(), lr=1e-2), no_sync=no_sync)
    seen = Seen(wrapped)
    loss = train_step(wrapped, batches, lambda out, y: loss_fn(out, y) / 3, seen)
    optimizer, total = torch.optim.AdamW(by_hand.parameters(), lr=1e-2), 0.0
    for x, y in batches:
        micro_loss = loss_fn(by_hand(x), y) / 3
        micro_loss.backward()
        total += micro_loss.item()
    optimizer.step()
    optimizer.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), by_hand.parameters()))
    assert loss.item() == pytest.approx(total, rel=1e-6) and not loss.requires_grad
    assert synced == [False, False]  # the third, last micro-batch reduces the gradients
    assert seen.points == ["forward", "backward", "next forward"] * 2 + [
        "forward", "backward", "optimizer step"]
    assert seen.held["grads"] == seen.held["params"] > 0  # fp32: one gradient per weight
    assert all(p.grad is None for p in model.parameters())  # zero_grad came after


def test_bf16_mixed_holds_16_bytes_per_parameter():
    report = train_worker(TrainConfig(steps=2, precision="bf16-mixed"))
    predicted = memory.model_states(report.psi, 1, 0, "bf16-mixed", "adamw")
    counters = 4 * sum(1 for _ in build_model("gpt-tiny").parameters())
    assert report.state_bytes["params"] == predicted.params == 2 * report.psi
    assert report.state_bytes["grads"] == predicted.grads == 2 * report.psi
    assert report.state_bytes["optimizer"] - counters == predicted.optimizer == 12 * report.psi


def test_command_line_through_the_launcher(tmp_path, capsys):
    path = tmp_path / "report.json"
    assert main(["--strategy", "ddp", "--world", "2", "--steps", "3", "--no-progress",
                 "--option", "bucket_mb=0.1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ddp on 2 rank(s)" in out and "sent MiB/step" in out
    report = json.loads(path.read_text())
    assert report["config"]["options"] == {"bucket_mb": 0.1}
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 3
    # the all-reduce of fp32 gradients on a ring: 2 psi (N-1)/N elements of 4 bytes
    assert ranks[0]["collectives_per_step"]["sent_bytes"] == comm.volume_per_rank(
        "ddp", ranks[0]["psi"], 2, bytes_per_elem=4)
    assert main(["--strategy", "single", "--world", "2"]) == 2
    assert "runs on one process" in capsys.readouterr().err
    assert main(["--strategy", "ddp", "--world", "3"]) == 2
    assert "multiple of 3" in capsys.readouterr().err


def test_command_line_under_torchrun(tmp_path):
    path = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--standalone", "-m", "shardlab", "train", "--strategy", "torch-ddp",
         "--steps", "3", "--no-progress", "--json", str(path)],
        capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("torch-ddp on 2 rank(s)") == 1  # rank 0 prints, once
    ranks = json.loads(path.read_text())["ranks"]
    assert len(ranks) == 2 and ranks[0]["losses"] == ranks[1]["losses"]


def tensor_bytes_alive() -> int:
    """The bytes of every tensor storage Python can still reach, after a collection."""
    import gc

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a freed or storage-less wrapper
            continue
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def what_each_run_leaves_behind(names: list[str]) -> dict[str, int]:
    """Each strategy's run in these same ranks, one after another (as the GPU check, the
    labs and `train_many` run them): the bytes of tensors alive after it beyond before it.
    The first run loads what a process keeps on purpose (the corpus' tokens)."""
    from shardlab.cards import required_options

    def one(name):
        train_worker(TrainConfig(strategy=name, world=2, model="gpt-tiny", steps=2,
                                 batch_size=4, seq_len=16, precision="bf16-mixed",
                                 record_ledger=False, measure_memory=False,
                                 options=required_options(name, 2)))

    one("ddp")
    left = {}
    for name in names:
        before = tensor_bytes_alive()
        one(name)
        left[name] = tensor_bytes_alive() - before
    return left


def test_no_run_leaves_its_model_behind_in_the_process():
    """A parameter's hooks live in C++, out of the garbage collector's sight: a hook that
    held its strategy kept the model, its buffers and the strategy alive after the run,
    and on a GPU the next run's `max_memory_allocated` counted them (the GPU check's
    memory runs read up to 2 GiB high). gpt-tiny's bf16 parameters alone are 241 kB."""
    from shardlab.cards import CARDS, DEEPSPEED
    from shardlab.launch import launch

    names = [n for n, c in CARDS.items() if c.family != DEEPSPEED and n != "single"]
    left = launch(what_each_run_leaves_behind, 2, names, timeout=300)[0]
    assert {n: b for n, b in left.items() if b > 1024} == {}, left
