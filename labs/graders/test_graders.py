"""Each grader passes its lab's worked solution, rejects every typical mistake of its catalogue
(`graders/wrong.py`) with that mistake's own hint, and rejects the wrong answers its rules
catch, in one launch per exercise: `pytest labs/graders -k ring` (or ddp, zero1, fsdp_unit,
checkpoint, rows, units, muon_owner).

The solutions are read from the labs' solution cells (graders/solutions.py), so what is
graded here is what a reader reveals."""

from __future__ import annotations

import pytest

from graders import (checkpoint, ddp, fsdp_unit, muon_owner, ring, rows, solutions, units,
                     wrong, zero1)
from graders.common import PASS, grade_on_ranks

EXERCISES = {
    # name: (grader, world, the lab, what its solution cell defines, its catalogue of
    #        mistakes, {a wrong answer its rules catch: what the rejection must say},
    #        what the first mistake's rejection must say before its hint)
    "ring": (ring, 3, "02-build-a-ring.ipynb", ("ring_reduce_scatter", "ring_all_gather"),
             wrong.RING, {}, "ring_reduce_scatter, float32 length 16: element 0 (bytes 0-3)"),
    "ddp": (ddp, 2, "04-ddp-from-the-inside.ipynb", ("MyBucketedDDP",), wrong.DDP, {},
            "step 0, gradient of 0.weight: element 0 (bytes 0-3)"),
    "zero1": (zero1, 2, "05-stage-by-stage.ipynb", ("MyZero1",), wrong.ZERO1,
              {wrong.NotSharded: "AdamW step 0: step() made 6 all-reduce calls"},
              "AdamW step 0, parameter 0.weight after step(): element 0 (bytes 0-3)"),
    "fsdp_unit": (fsdp_unit, 2, "06-fsdp2-beside-pytorch.ipynb",
                  ("reshard", "unshard", "reduce_scatter_grad"), wrong.FSDP_UNIT, {},
                  "rank 1, reshard(0.weight): returned shape (2, 6)"),
    # saved on 2 ranks, loaded on 3 (two launches: checkpoint.verdicts)
    "checkpoint": (checkpoint, 3, "07-crash-and-resume.ipynb",
                   ("save_sharded", "load_sharded"), wrong.CHECKPOINT, {},
                   "rank 0, tensor 'weight' loaded: returned shape (4, 4), DCP's load has "
                   "(3, 4)"),
    "rows": (rows, 2, "10-pretrained-into-shards.ipynb", ("read_my_rows",), wrong.ROWS, {},
             "rank 0, embed.weight: returned shape (2, 4), fully_shard's shard has (3, 4)"),
    "units": (units, 2, "09-your-own-model.ipynb", ("my_units",), wrong.UNITS, {},
              "hf-gpt2: unit 0 has"),
    "muon_owner": (muon_owner, 3, "12-muon-owner.ipynb", ("owner_step",), wrong.MUON_OWNER,
                   {wrong.owner_step_gather: "rows layout (6, 4): this rank ran Newton-Schulz "
                                             "1x; the owner (rank 1) runs it, once",
                    wrong.owner_step_broadcast: "bytes, the owner design sends"},
                   "rank 0, rows layout (6, 4): element 0 (bytes 0-1)"),
}


@pytest.mark.parametrize("name", list(EXERCISES))
def test_grader_passes_the_solution_and_names_each_mistake(name, tmp_path):
    grader, world, lab, names, mistakes, by_rule, first_rejection = EXERCISES[name]
    solution = solutions.load(lab, *names)
    candidates = [solution if len(names) > 1 else solution[0],
                  *(m.answer for m in mistakes), *by_rule]
    if grader is checkpoint:     # saves on 2 ranks, then loads on 3: two launches
        verdicts = checkpoint.verdicts(candidates, str(tmp_path))
    else:
        args = (str(tmp_path),) if grader is rows else ()
        verdicts = [v for v, _ in grade_on_ranks(grader.check, world, candidates, *args)]
    assert verdicts[0] == PASS, f"the solution of {lab} fails its grader: {verdicts[0]}"
    hints = [m.hint.format(world=world) for m in mistakes]
    for mistake, hint, verdict in zip(mistakes, hints, verdicts[1:]):
        assert verdict != PASS, f"the {name} grader passes {mistake.answer}"
        assert "\n" not in verdict, verdict
        assert verdict.endswith(f"; {hint}"), (hint, verdict)      # its own hint, and
        assert sum(h in verdict for h in hints) == 1, verdict       # no other's
    assert first_rejection in verdicts[1], verdicts[1]
    for (answer, rejection), verdict in zip(by_rule.items(), verdicts[1 + len(mistakes):]):
        assert rejection in verdict and "\n" not in verdict, (answer, verdict)
        assert not any(h in verdict for h in hints), verdict


# Three rings as a reader writes them in a cell (compiled from text, they travel to the ranks
# by value, as a cell's functions do): every rank receives before it sends; a view that
# fails on line 23 when N does not divide the length; the last rank raising before it sends,
# while its peers wait for it, or after its rounds, while they compare; every rank receiving
# from the wrong neighbour.
WRONG_RINGS = """\
import math

import torch
import torch.distributed as dist


def ring_reduce_scatter(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunk = math.ceil(tensor.numel() / world)
    padded = torch.zeros(world * chunk, dtype=tensor.dtype)
    padded[: tensor.numel()] = tensor
    chunks = padded.view(world, chunk)
    incoming = torch.empty(chunk, dtype=tensor.dtype)
    for s in range(world - 1):
        dist.recv(incoming, (rank - 1) % world)       # before the send: every rank waits
        dist.isend(chunks[(rank - s - 1) % world], (rank + 1) % world).wait()
        chunks[(rank - s - 2) % world] += incoming
    return chunks[rank].clone()


def ring_reduce_scatter_by_view(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    return tensor.view(world, -1)[rank].clone()


def ring_reduce_scatter_last_rank_fails(tensor):
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError("a bug on the last rank only")
    return ring_reduce_scatter_sends_first(tensor)


def ring_reduce_scatter_sends_first(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunk = math.ceil(tensor.numel() / world)
    padded = torch.zeros(world * chunk, dtype=tensor.dtype)
    padded[: tensor.numel()] = tensor
    chunks = padded.view(world, chunk)
    incoming = torch.empty(chunk, dtype=tensor.dtype)
    for s in range(world - 1):
        sending = dist.isend(chunks[(rank - s - 1) % world], (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        sending.wait()
        chunks[(rank - s - 2) % world] += incoming
    return chunks[rank].clone()


def ring_reduce_scatter_last_rank_fails_at_the_end(tensor):
    done = ring_reduce_scatter_sends_first(tensor)
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError("a bug on the last rank only, after its rounds")
    return done


def ring_reduce_scatter_from_the_right(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    sending = dist.isend(tensor.clone(), (rank + 1) % world)
    incoming = torch.empty_like(tensor)
    dist.recv(incoming, (rank + 1) % world)           # the right sends to its own right
    sending.wait()
    return incoming
"""


def test_ring_grader_names_a_deadlock_in_seconds_and_the_line_of_an_exception():
    """One launch, 3 ranks, a patience of 2 s (the lab's is `RECV_PATIENCE`): the ring that
    receives first is told so instead of hanging until the launch's timeout; an exception
    names its line in the cell; a rank that raises while its peers wait for it is the one
    named, whether they wait for it or compare; a ring receiving from the wrong side is told
    that. Each candidate after a
    deadlock gets a fresh group and runs."""
    namespace: dict = {"__name__": "a_readers_cell"}
    exec(compile(WRONG_RINGS, "<cell>", "exec"), namespace)
    gather = wrong.ring_all_gather
    candidates = [(namespace[name], gather) for name in (
        "ring_reduce_scatter", "ring_reduce_scatter_by_view",
        "ring_reduce_scatter_last_rank_fails", "ring_reduce_scatter_last_rank_fails_at_the_end",
        "ring_reduce_scatter_from_the_right")]
    verdicts = [v for v, _ in grade_on_ranks(ring.check, 3, candidates, ring.LENGTHS,
                                             ring.DTYPES, 2.0, timeout=90)]
    assert verdicts == [
        "ring_reduce_scatter (float32 length 16): every rank is waiting in recv: did each "
        "send before it received?",
        "rank 0, ring_reduce_scatter (float32 length 16) raised RuntimeError: shape '[3, -1]' "
        "is invalid for input of size 16 (line 23 of your cell, in ring_reduce_scatter_by_view)",
        "rank 2, ring_reduce_scatter (float32 length 16) raised ValueError: a bug on the last "
        "rank only (line 28 of your cell, in ring_reduce_scatter_last_rank_fails)",
        "rank 2, ring_reduce_scatter (float32 length 16) raised ValueError: a bug on the last "
        "rank only, after its rounds (line 50 of your cell, in "
        "ring_reduce_scatter_last_rank_fails_at_the_end)",
        "ring_reduce_scatter (float32 length 16): every rank is waiting in recv (rank 0 from "
        "rank 1) while what was sent is not received: does each rank receive from the rank "
        "that sends to it?",
    ], verdicts
