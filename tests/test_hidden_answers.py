"""No lab shows an answer's source in plain view: in the book, in JupyterLab or Notebook 7,
or in Colab (tools/hide_solutions.py says which metadata each honours). A graded exercise
reads: the question, the reader's cell, its grader, and only then the folded solution and
the grader run on it."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import hide_solutions  # noqa: E402

LABS = sorted((ROOT / "labs").glob("*.ipynb"))


def cells(lab: Path) -> list[dict]:
    return json.loads(lab.read_text())["cells"]


def tags(cell: dict) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_every_answer_is_folded_in_the_book_in_jupyter_and_in_colab(lab):
    for index, cell in enumerate(cells(lab)):
        source = "".join(cell.get("source", ""))
        looks_like_an_answer = source.lstrip().startswith(("# Solution", "# @title Solution"))
        if not (hide_solutions.is_answer(cell) or looks_like_an_answer):
            continue
        where = f"{lab.name}, cell {index}"
        meta = cell.get("metadata", {})
        assert "hide-cell" in tags(cell), f"{where}: not folded in the book (tag hide-cell)"
        assert meta.get("jupyter", {}).get("source_hidden") is True, \
            f"{where}: in plain view in JupyterLab (metadata.jupyter.source_hidden)"
        assert meta.get("jupyter", {}).get("outputs_hidden") is True, \
            f"{where}: its output shows the answer in JupyterLab (jupyter.outputs_hidden)"
        assert meta.get("cellView") == "form" and source.startswith("# @title"), \
            f"{where}: in plain view in Colab (cellView form and a '# @title' first line)"


GRADED_LABS = ["02-build-a-ring", "03-predict-then-measure", "04-ddp-from-the-inside", "05-stage-by-stage",
               "06-fsdp2-beside-pytorch", "07-crash-and-resume"]


@pytest.mark.parametrize("name", GRADED_LABS)
def test_a_graded_exercise_puts_its_solution_after_the_readers_cell_and_grader(name):
    found = cells(ROOT / "labs" / f"{name}.ipynb")
    kinds = [("exercise" if "exercise" in tags(c) else "solution" if "solution" in tags(c)
              else "grader" if "grader" in tags(c) else None) for c in found]
    order = [k for k in kinds if k]
    assert order and len(order) % 4 == 0, order
    for i in range(0, len(order), 4):
        assert order[i:i + 4] == ["exercise", "grader", "solution", "grader"], order
    for cell, kind in zip(found, kinds):
        if kind == "exercise":   # the reader's cell: in plain view, never an answer
            assert not cell.get("metadata", {}).get("jupyter", {}).get("source_hidden")
            assert "hide-cell" not in tags(cell)
        if kind == "grader":     # one line, no traceback, whatever the reader wrote
            assert not any(o.get("output_type") == "error" for o in cell.get("outputs", []))
            printed = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
            assert printed.startswith(("✓", "✗")) and printed.count("\n") <= 2, printed
