"""Each grader passes its lab's worked solution, rejects every typical mistake of its catalogue
(`graders/wrong.py`) with that mistake's own hint, and rejects the wrong answers its rules
catch, in one launch per exercise: `pytest labs/graders -k ring` (or ddp, zero1, fsdp_unit,
checkpoint, rows, units, accumulation).

The solutions are read from the labs' solution cells (graders/solutions.py), so what is
graded here is what a reader reveals."""

from __future__ import annotations

import pytest

from graders import (accumulation, checkpoint, ddp, fsdp_unit, ring, rows, solutions, units,
                     wrong, zero1)
from graders.common import PASS, grade_on_ranks

EXERCISES = {
    # name: (grader, world, the lab, what its solution cell defines, its catalogue of
    #        mistakes, {a wrong answer its rules catch: what the rejection must say},
    #        what the first mistake's rejection must say before its hint)
    "ring": (ring, 3, "02-build-a-ring.ipynb", ("ring_reduce_scatter", "ring_all_gather"),
             wrong.RING, {}, "ring_reduce_scatter, float32 length 1: element 0 (bytes 0-3)"),
    "ddp": (ddp, 2, "04-ddp-from-the-inside.ipynb", ("MyBucketedDDP",), wrong.DDP, {},
            "step 0, gradient of 0.weight: element 0 (bytes 0-3)"),
    "zero1": (zero1, 2, "05-stage-by-stage.ipynb", ("MyZero1",), wrong.ZERO1,
              {wrong.NotSharded: "AdamW step 0: step() made 6 all-reduce calls"},
              "AdamW step 0, parameter 0.weight after step(): element 0 (bytes 0-3)"),
    "fsdp_unit": (fsdp_unit, 2, "06-fsdp2-beside-pytorch.ipynb",
                  ("reshard", "unshard", "reduce_scatter_grad"), wrong.FSDP_UNIT, {},
                  "rank 1, reshard(0.weight): returned shape (2, 6)"),
    "checkpoint": (checkpoint, 2, "07-crash-and-resume.ipynb",
                   ("save_sharded", "load_sharded"), wrong.CHECKPOINT, {},
                   "rank 1, tensor 'weight' loaded: element 0 (bytes 0-3)"),
    "rows": (rows, 2, "10-pretrained-into-shards.ipynb", ("read_my_rows",), wrong.ROWS, {},
             "rank 0, embed.weight: returned shape (2, 4), fully_shard's shard has (3, 4)"),
    "units": (units, 2, "09-your-own-model.ipynb", ("my_units",), wrong.UNITS, {},
              "hf-gpt2: unit 0 has"),
    "accumulation": (accumulation, 2, "13-accumulation.ipynb", ("zero1_step",),
                     wrong.ACCUMULATION, {}, "rank 0, step 0: 3 all-gathers and 0 reduce-scatters"),
}


@pytest.mark.parametrize("name", list(EXERCISES))
def test_grader_passes_the_solution_and_names_each_mistake(name, tmp_path):
    grader, world, lab, names, mistakes, by_rule, first_rejection = EXERCISES[name]
    solution = solutions.load(lab, *names)
    candidates = [solution if len(names) > 1 else solution[0],
                  *(m.answer for m in mistakes), *by_rule]
    args = (str(tmp_path),) if grader in (checkpoint, rows) else ()
    verdicts = [verdict for verdict, _ in grade_on_ranks(grader.check, world, candidates, *args)]
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
