"""Each grader passes its lab's worked solution and rejects a known-wrong answer, in one
launch per exercise: `pytest labs/graders -k ring` (or ddp, zero1, fsdp_unit, checkpoint, rows).

The solutions are read from the labs' solution cells (graders/solutions.py), so what is
graded here is what a reader reveals."""

from __future__ import annotations

import pytest

from graders import checkpoint, ddp, fsdp_unit, ring, rows, solutions, wrong, zero1
from graders.common import PASS, grade_on_ranks

EXERCISES = {
    # name: (grader, world, the lab, what its solution cell defines, the known-wrong answer,
    #        what the rejection must say)
    "ring": (ring, 3, "02-build-a-ring.ipynb", ("ring_reduce_scatter", "ring_all_gather"),
             wrong.RING, "ring_reduce_scatter, float32 length 1: element 0 (bytes 0-3)"),
    "ddp": (ddp, 2, "04-ddp-from-the-inside.ipynb", ("MyBucketedDDP",), wrong.DDP,
            "step 0, gradient of 0.weight: element 0 (bytes 0-3)"),
    "zero1": (zero1, 2, "05-stage-by-stage.ipynb", ("MyZero1",), wrong.ZERO1,
              "step 0: step() made 6 all-reduce calls"),
    "fsdp_unit": (fsdp_unit, 2, "06-fsdp2-beside-pytorch.ipynb",
                  ("reshard", "unshard", "reduce_scatter_grad"), wrong.FSDP_UNIT,
                  "rank 1, reshard(0.weight): returned shape (2, 6)"),
    "checkpoint": (checkpoint, 2, "07-crash-and-resume.ipynb",
                   ("save_sharded", "load_sharded"), wrong.CHECKPOINT,
                   "rank 1, tensor 'weight' loaded: element 0 (bytes 0-3)"),
    "rows": (rows, 2, "10-pretrained-into-shards.ipynb", ("read_my_rows",), wrong.ROWS,
             "rank 0, embed.weight: returned shape (2, 4), fully_shard's shard has (3, 4)"),
}


@pytest.mark.parametrize("name", list(EXERCISES))
def test_grader_passes_the_solution_and_rejects_a_wrong_answer(name, tmp_path):
    grader, world, lab, names, wrong_answer, rejection = EXERCISES[name]
    solution = solutions.load(lab, *names)
    candidates = [solution if len(names) > 1 else solution[0], wrong_answer]
    args = (str(tmp_path),) if grader in (checkpoint, rows) else ()
    (passed, _), (rejected, _) = grade_on_ranks(grader.check, world, candidates, *args)
    assert passed == PASS, f"the solution of {lab} fails its grader: {passed}"
    assert rejected != PASS, f"the {name} grader passes a wrong answer"
    assert rejection in rejected and "\n" not in rejected, rejected
