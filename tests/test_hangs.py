"""Hangs caused on purpose (`shardlab.hangs`) and what the flight recorder says of them
(`shardlab.comm.flight`, `shardlab.comm.hang_diagnosis`).

Every fault and its fix run in one launch of three ranks (three, so that a rank that
disagrees is outnumbered and can be named), each on a group whose collectives time out
after 2 s. Nothing is timed: a hang that did not end would fail the launch's own timeout.
"""

import multiprocessing
import os
import tempfile
from pathlib import Path

import pytest

from shardlab.cli import main
from shardlab.comm import FlightDump, FlightEntry, diagnose, ring_traffic
from shardlab.config import TrainConfig
from shardlab.hang_runs import ended_by_timeout, run_hangs
from shardlab.hangs import FAULTS
from shardlab.launch import OWNER, RUN_DIR_PREFIX, RankFailed, launch
from shardlab.train import run

from hang_workers import train_with_and_without_recorder

TIMEOUT = 2.0

# fault -> (cause, the ranks named, seq, the collective there)
EXPECTED = {
    # rank 0 stops after step 2's reduce (seq 5); ranks 1, 2 wait in step 3's all-gather
    "rank0_decides": ("behind", [0], 6, "all_gather"),
    # rank 0 has a 4th batch (seq 3), ranks 1 and 2 had three
    "uneven_eval": ("behind", [1, 2], 3, "all_reduce"),
    # rank 2 skips step 1's all-reduce (seq 1): its step-2 all-reduce pairs with it
    "skipped_sample": ("step", [2], 1, "all_reduce"),
    # one training step of three ZeRO-3 units: 3 + 3 all-gathers, 3 reduce-scatters
    # (seq 0-8); then rank 0 samples while ranks 1, 2 train
    "rank0_generate": ("path", [0], 9, "all_gather"),
    "opposite_order": ("order", [0], 0, "all_reduce"),
    "size_mismatch": ("size", [2], 0, "all_reduce"),
}


@pytest.fixture(scope="module")
def runs():
    return run_hangs(world=3, fixed="both", torch_flight=True,
                     collective_timeout=TIMEOUT)


def test_every_fault_is_tested():
    assert set(EXPECTED) == set(FAULTS)


@pytest.mark.parametrize("fault", list(EXPECTED))
def test_the_recorder_names_the_rank_and_the_collective(runs, fault):
    cause, ranks, seq, op = EXPECTED[fault]
    found = runs[fault].diagnosis
    assert (found.cause, found.ranks, found.seq) == (cause, ranks, seq), found.text
    at_seq = [e for e in found.sides.values() if e is not None and e.seq == seq]
    assert at_seq and at_seq[0].op == op, found.text
    assert f"seq {seq}" in found.text and op in found.text


def test_the_recorder_tells_generate_from_the_training_step(runs):
    sides = runs["rank0_generate"].diagnosis.sides
    assert "sample" in sides[0].issuer and "train_step" not in sides[0].issuer
    assert all("train_step" in sides[r].issuer for r in (1, 2))
    assert "unshard[root]" in sides[0].issuer  # the unit that issued the all-gather


def test_mismatches_show_both_sizes_and_the_order(runs):
    size = runs["size_mismatch"].diagnosis.sides
    assert [size[r].numel for r in range(3)] == [4, 4, 5]
    order = runs["opposite_order"].diagnosis
    assert [order.sides[r].op for r in range(3)] == ["all_reduce", "all_gather", "all_gather"]


@pytest.mark.parametrize("fault", list(EXPECTED))
def test_each_hang_ends_at_its_collective_timeout(runs, fault):
    # the collective timeout of the fault's group ended it, on at least one rank (not the
    # launcher's timeout, which would have failed the whole launch)
    assert runs[fault].timed_out, runs[fault].ended


@pytest.mark.parametrize("fault", list(EXPECTED))
def test_each_fix_runs_through(runs, fault):
    fixed = runs[f"{fault}:fixed"]
    assert fixed.ended == {0: "returned", 1: "returned", 2: "returned"}
    assert fixed.diagnosis.cause == "none", fixed.diagnosis.text


def test_pytorch_flight_recorder_records_gloo_collectives(runs):
    # torch's own recorder (TORCH_FR_BUFFER_SIZE) on gloo: the same counts per rank
    entries = runs["uneven_eval"].torch_flight
    assert [len(entries[r]) for r in range(3)] == [4, 3, 3]
    assert all(name == "gloo:all_reduce" for r in range(3) for name, *_ in entries[r])


def test_nothing_is_left_behind(runs):
    assert multiprocessing.active_children() == []
    mine = [p for p in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*")
            if (p / OWNER).exists() and (p / OWNER).read_text() == str(os.getpid())]
    assert mine == []


def test_both_of_gloos_timeout_messages_count_as_a_timeout_and_a_lost_peer_does_not():
    assert ended_by_timeout("RuntimeError: [pair.cc:534] Timed out waiting 2000ms for recv "
                            "operation to complete")
    assert ended_by_timeout("RuntimeError: Application timeout caused pair closure")
    assert not ended_by_timeout("RuntimeError: [pair.cc:553] Connection closed by peer "
                                "[127.0.0.1]:1234")
    assert not ended_by_timeout("returned")


def _entry(seq, op="all_reduce", numel=4, finished=True, step=0, issuer="f"):
    return FlightEntry(seq, seq, op, "0", numel, "float32", issuer, step, 0.0, finished)


def test_ranks_that_agree_are_not_a_hang_and_ranks_stuck_together_are_named():
    done = {r: FlightDump(r, 2, "returned", "", [_entry(0), _entry(1)]) for r in range(2)}
    assert diagnose(done).cause == "none"
    stuck = {r: FlightDump(r, 2, "running", "", [_entry(0), _entry(1, finished=False)])
             for r in range(2)}
    assert (diagnose(stuck).cause, diagnose(stuck).seq) == ("together", 1)


def test_with_two_ranks_a_mismatch_names_the_one_that_differs_from_rank_0():
    dumps = {0: FlightDump(0, 2, "running", "", [_entry(0, numel=4, finished=False)]),
             1: FlightDump(1, 2, "running", "", [_entry(0, numel=8, finished=False)])}
    found = diagnose(dumps)
    assert (found.cause, found.ranks) == ("size", [1])
    assert "4 float32" in found.text and "8 float32" in found.text


def test_a_healthy_run_reports_the_same_with_the_recorder_on():
    config = TrainConfig(strategy="zero3", world=2, steps=2, batch_size=4, seq_len=16,
                         model="gpt-tiny")
    plain, recorded = launch(train_with_and_without_recorder, 2, config)[0]
    assert recorded == plain


def test_a_failed_run_carries_the_diagnosis_to_the_cli(monkeypatch, capsys):
    config = TrainConfig(strategy="ddp", world=2, steps=2, batch_size=4, seq_len=16,
                         model="gpt-tiny", crash_at_step=1, crash_rank=1,
                         measure_memory=False)
    with pytest.raises(RankFailed) as failed:
        run(config)
    hang = failed.value.hang
    assert (hang.cause, hang.ranks) == ("behind", [1])
    assert "rank 1 crashed at step 1" in hang.text
    # the course's recorder, kept by the loop, says more than PyTorch's: its paragraph,
    # once; a rank that raised is not sent looking for a branch of its code
    assert str(failed.value).count("What the flight recorders say") == 1
    assert "Rank(s) [1] raised before calling it" in hang.text and "branch" not in hang.text
    assert "What the flight recorders say" in str(failed.value)

    def failing_run(*args, **kwargs):
        raise failed.value

    # the command line imports the loop when it runs (a parse does not import torch)
    monkeypatch.setattr("shardlab.train.run", failing_run)
    assert main(["--strategy", "ddp", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: RuntimeError: rank 1 crashed at step 1" in err
    assert "what the flight recorders say: Rank(s) [1] are behind" in err


KILLED = "was killed by signal SIGKILL (from outside, or by the kernel for lack of memory?)"


def test_a_rank_that_died_is_said_first_and_not_called_behind():
    """Rank 1 was killed inside a save's all-gather (step 3), its file as it was then;
    rank 0 went on and waits in the next collective: the death is said first, with where
    rank 1 was, and no advice meant for code that took another path."""
    before = [_entry(s, step=s // 2) for s in range(6)]
    dumps = {0: FlightDump(0, 2, "raised", "RuntimeError: Connection closed by peer",
                           before + [_entry(6, op="all_gather", step=3),
                                     _entry(7, finished=False, step=3)]),
             1: FlightDump(1, 2, "running", "",
                           before + [_entry(6, op="all_gather", step=3, finished=False)])}
    assert diagnose(dumps).cause == "behind"  # what the recorders alone would say
    found = diagnose(dumps, died={1: KILLED})
    assert (found.cause, found.ranks, found.seq) == ("died", [1], 6)
    assert found.text.startswith(f"Rank 1 {KILLED}, inside seq 6 of group '0': "
                                 f"all_gather of 4 float32 from f (step 3, never finished)")
    assert "rank 0 waited in seq 7 of group '0', all_reduce of 4 float32" in found.text
    assert "behind" not in found.text and "branch" not in found.text


def test_a_disagreement_comes_before_the_death_it_caused():
    """gloo aborts a rank on a size mismatch: the mismatch is the cause, said first."""
    dumps = {r: FlightDump(r, 2, "running", "", [_entry(0, numel=4 + r, finished=False)])
             for r in range(2)}
    found = diagnose(dumps, died={1: "crashed in native code (signal SIGABRT)"})
    assert (found.cause, found.ranks) == ("size", [1])
    assert found.text.endswith("Rank 1 then crashed in native code (signal SIGABRT).")


def test_a_dead_rank_without_a_recorder_is_still_named():
    """PyTorch's recorder goes with its rank: the others say where they waited."""
    dumps = {0: FlightDump(0, 2, "running", "", [_entry(0), _entry(1, finished=False)])}
    found = diagnose(dumps, died={1: KILLED}, world=2)
    assert (found.cause, found.ranks) == ("died", [1])
    assert "where it was is not known" in found.text and "wrote no" not in found.text


def test_a_reduce_is_counted_as_a_reduce_scatter_then_a_gather_to_the_root():
    traffic = [ring_traffic("reduce", 9, 3, 4, rank, src=0) for rank in range(3)]
    assert [t[:2] for t in traffic] == [(24, 48), (36, 24), (36, 24)]  # bytes sent, received
    assert sum(t[0] for t in traffic) == sum(t[1] for t in traffic)
