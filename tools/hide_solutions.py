"""Fold every answer of the labs where the reader works, not only in the built book.

A lab's answer cell (tagged `hide-cell`, or `solution` for a graded exercise's worked
solution) is hidden by the metadata each place honours:

    the book (Jupyter Book)         tags: ["hide-cell"]             folded, "Click to show"
    JupyterLab, Notebook 7          jupyter.source_hidden,          collapsed to "..." until
                                    jupyter.outputs_hidden          clicked
    Colab                           cellView: "form", and a first   the code hidden behind
                                    line "# @title Solution ..."    the title; double-click

Run `python tools/hide_solutions.py labs/*.ipynb` after adding an answer cell;
tests/test_hidden_answers.py fails while any answer is in plain view.
"""

from __future__ import annotations

import sys

import nbformat

TITLE = "# @title Solution (double-click to reveal)"


def is_answer(cell: dict) -> bool:
    tags = set(cell.get("metadata", {}).get("tags", []))
    return cell.get("cell_type") == "code" and bool(tags & {"hide-cell", "solution"})


def hide(cell: dict) -> None:
    meta = cell.setdefault("metadata", {})
    tags = meta.setdefault("tags", [])
    if "hide-cell" not in tags:
        tags.append("hide-cell")
    meta.setdefault("jupyter", {}).update(source_hidden=True, outputs_hidden=True)
    meta["cellView"] = "form"
    source = "".join(cell["source"])
    if not source.startswith("# @title"):
        source = f"{TITLE}\n{source}"
    cell["source"] = source.splitlines(keepends=True)


def main(paths: list[str]) -> None:
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            if is_answer(cell):
                hide(cell)
                cell["source"] = "".join(cell["source"])
        nbformat.write(notebook, path)


if __name__ == "__main__":
    main(sys.argv[1:])
