"""Resume on another number of ranks, exactly: saved at N = 64, resumed at 48, then at 1
(ranks that are threads, `shardlab.many_ranks`), and a real launch of 4 processes resumed
on 3. Every strategy of the course that writes checkpoints takes one of the two (see
CHAIN), on a model whose rows N does not divide (toy-tied: a 256 x 16 embedding tied to
the head, layers of 32 and 16 rows, Ψ = 5,168; at 48 and 64 ranks some ranks hold none of
a layer), against one process trained without a break:

* the checkpoint at each boundary (written at 64, at 48, at 1; at 4 and at 3) holds the
  parameters and the optimizer states of the uninterrupted run at that step;
* the losses of every segment are the uninterrupted run's;
* the data position: the ids of the samples the ranks read (`shardlab.models.sample_ids`,
  recorded where the loop reads its batches) are each sample once, 0 .. T·B - 1, and
  every row holds what the uninterrupted run read under that id;
* a resume that would read other samples (another batch size, sequence length or seed)
  is refused in one line; another number of ranks or of micro-batches is not.

Bounds: another world size reduces the gradients in another order (fp32, relative
1e-7), and AdamW divides by each element's own running RMS, so a state is compared to
2e-5 absolute (1% of what lr = 1e-3 moves a parameter in 2 steps, as the parity tests
bound it); the losses to 1e-5, Adam's step counters and the progress exactly.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import many_ranks_workers as w
from shardlab.launch import launch
from shardlab.many_ranks import run_on_threads, train_many_on_threads
from shardlab.config import TrainConfig
from shardlab.train import train_rank

STRATEGIES = ["ddp", "ddp-naive", "zero1", "zero2", "zero3", "fsdp2", "hsdp"]
# At 64 ranks each rank describes every rank's pieces to PyTorch's ShardedTensor, which
# checks them for overlap pair by pair where a piece is not a block of rows (ZeRO's flat
# buffers cut rows): O(N^2) a rank, and all 64 ranks share two cores here. So the chain
# runs one strategy of each layout, replicated (ddp), flat (zero3), dim-0 (fsdp2), and
# the others (ddp-naive, zero1 and zero2, hsdp's replicas) resume across real processes.
CHAIN = ["ddp", "zero3", "fsdp2"]
LAUNCHED = [s for s in STRATEGIES if s not in CHAIN]
# (world, steps trained to, save after): 64 saves at step 2, 48 resumes it and saves at
# 4, one rank resumes that and saves at 5
SEGMENTS = [(64, 2), (48, 4), (1, 5)]
BATCH = 192  # divides among 64, 48 and 1 ranks
STATE_TOL, LOSS_TOL = 2e-5, 1e-5


def config(strategy: str, world: int, steps: int, folder: Path, **kw) -> TrainConfig:
    options = {"shard_group": min(8, world)} if strategy == "hsdp" else {}
    data = {"batch_size": BATCH, "seq_len": 8, **kw}
    return TrainConfig(strategy=strategy, world=world, model="toy-tied", steps=steps,
                       options=options, measure_memory=False, record_ledger=False,
                       save_every=steps, checkpoint_dir=str(folder), **data)


def saved(folder: Path, tmp_path: Path) -> dict:
    """A checkpoint as one dict of full tensors (PyTorch's own converter)."""
    out = tmp_path / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


def check_same_state(ours: dict, truth: dict, where: str) -> None:
    keys = {k for k in truth if k.startswith(("model.", "optim.state.", "progress."))}
    assert keys <= set(ours), (where, sorted(keys - set(ours))[:3])
    for key in sorted(keys):
        a, b = ours[key], truth[key]
        if key.endswith(".step") or key.startswith("progress."):
            assert torch.equal(a, b), (where, key)
        else:
            assert a.shape == b.shape and (a - b).abs().max().item() <= STATE_TOL, (where, key)


def check_data_position(read: list, truth: list, steps: int) -> None:
    """Each sample 0 .. steps·B - 1 read once, each row the uninterrupted run's."""
    rows = {}
    for _, _, _, ids, x in truth:
        rows.update(zip(ids, x))
    ids = [i for _, _, _, batch, _ in read for i in batch]
    assert sorted(ids) == list(range(steps * BATCH)), "a sample skipped or read twice"
    for _, _, _, batch, x in read:
        for i, row in zip(batch, x):
            assert torch.equal(row, rows[i]), f"sample {i} is another row"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One process, five steps, a checkpoint after each, and the samples it read."""
    folder = tmp_path_factory.mktemp("single")
    with w.samples_recorded() as seen:
        report = train_rank(replace(config("single", 1, 5, folder), save_every=1))
    return folder, report, list(seen)


@pytest.mark.parametrize("strategy", CHAIN)
def test_saved_at_64_resumed_at_48_then_at_1(strategy, uninterrupted, tmp_path):
    truth_folder, truth, truth_read = uninterrupted
    read, losses, resume, first = [], [], False, 0
    for world, steps in SEGMENTS:
        folder = tmp_path / f"at-{world}"
        with w.samples_recorded() as seen:
            reports = run_on_threads(config(strategy, world, steps, folder, resume=resume))
        read += seen
        losses += reports[0].losses
        assert reports[0].first_step == first
        resume, first = str(folder / f"step-{steps:06d}"), steps
        check_same_state(saved(Path(resume), tmp_path),
                         saved(truth_folder / f"step-{steps:06d}", tmp_path),
                         f"{strategy} at {world} ranks, step {steps}")
    assert max(abs(a - b) for a, b in zip(losses, truth.losses)) <= LOSS_TOL
    assert len(losses) == len(truth.losses)
    check_data_position(read, truth_read, SEGMENTS[-1][1])


def test_a_resume_that_would_read_other_samples_is_refused(tmp_path):
    folder = tmp_path / "at-2"
    run_on_threads(config("fsdp2", 2, 1, folder))
    for field, value in (("batch_size", 96), ("seq_len", 16), ("seed", 1)):
        other = config("fsdp2", 4, 2, tmp_path / "again", resume=str(folder / "step-000001"),
                       **{field: value})
        with pytest.raises(ValueError, match=f"read 192 samples with {field}=.*; with "
                                             f"{field}={value} the run would go on with other "
                                             f"samples .* resume it with {field}="):
            run_on_threads(other)
        # ranks launched without `run` (a notebook's train_many) refuse it as they load
        with pytest.raises(ValueError, match=f"with {field}={value} the run would go on"):
            train_many_on_threads([other])
    # the number of ranks and of micro-batches may change
    run_on_threads(config("fsdp2", 4, 2, tmp_path / "ok", grad_accum=2,
                          resume=str(folder / "step-000001")))


def test_a_real_launch_of_4_resumed_on_3(tmp_path):
    """The strategies the chain leaves out, in one launch of 4 processes (2 steps, saved),
    then in one of 3 (resumed, to step 4); hsdp on 4 = 2 x 2, on 3 = 3 x 1."""
    batch = 12  # divides among 4 and 3 ranks: the uninterrupted run's first 4 steps
    first = [replace(config(s, 4, 2, tmp_path / s / "at-4"), batch_size=batch,
                     options={"shard_group": 2} if s == "hsdp" else {}) for s in LAUNCHED]
    then = [replace(c, world=3, steps=4, save_every=4, checkpoint_dir=str(tmp_path / s / "at-3"),
                    resume=str(tmp_path / s / "at-4" / "step-000002"),
                    options={"shard_group": 1} if s == "hsdp" else {})
            for s, c in zip(LAUNCHED, first)]
    with w.samples_recorded() as seen:
        reference = train_rank(replace(config("single", 1, 4, tmp_path / "single"),
                                       batch_size=batch))
    rows = {i: x for _, _, _, ids, xs in seen for i, x in zip(ids, xs)}
    four = launch(w.train_many_recording, 4, first, backend="gloo", timeout=600)
    three = launch(w.train_many_recording, 3, then, backend="gloo", timeout=600)
    for i, strategy in enumerate(LAUNCHED):
        losses = four[0][i][0].losses + three[0][i][0].losses
        assert three[0][i][0].first_step == 2, strategy
        assert max(abs(a - b) for a, b in zip(losses, reference.losses)) <= LOSS_TOL, strategy
        read = [entry for rank in four + three for entry in rank[i][1]]
        ids = sorted(j for _, _, _, batch_ids, _ in read for j in batch_ids)
        assert ids == list(range(4 * batch)), strategy
        assert all(torch.equal(x, rows[j]) for _, _, _, batch_ids, xs in read
                   for j, x in zip(batch_ids, xs)), strategy
        check_same_state(saved(tmp_path / strategy / "at-3" / "step-000004", tmp_path),
                         saved(tmp_path / "single" / "step-000004", tmp_path),
                         f"{strategy}, 4 processes then 3")
