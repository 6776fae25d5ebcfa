"""The chapters as notebooks Colab can open, each with the course's install cell.

Colab opens `.ipynb` files, and the chapters are MyST Markdown (`chapters/*.md`), which it
cannot open. This writes `notebooks/chapters/<name>.ipynb` from each chapter of `_toc.yml`
with jupytext, without outputs, and puts under the title the cell that installs the course
on Colab (and does nothing anywhere else): `tools/colab_install.py` writes it, installing
from the site `_config.yml` names (`html.baseurl`) or from a zip the reader uploads. The
site serves each notebook beside its chapter's page (`_ext/colab_links.py`).

    python tools/colab_notebooks.py           # write the notebooks
    python tools/colab_notebooks.py --check   # exit 1 if one is missing or out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jupytext
import nbformat
import yaml

from colab_install import INSTALL_COMMENT, cell_source, course_site  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "notebooks"


def package_extras(code: str) -> tuple[str, ...]:
    """The extras of shardlab a notebook's code needs on Colab, which has torch and
    transformers but not DeepSpeed."""
    return ("deepspeed",) if "deepspeed" in code else ()


def install_source(code: str) -> str:
    """A chapter's install cell: shardlab with the extras its `code` needs, and myst-nb
    (chapters `glue` their numbers)."""
    return cell_source(course_site(), package_extras(code), ("myst-nb",))


def toc_files(prefix: str) -> list[Path]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [c["file"] for part in toc["parts"] for c in part["chapters"]]
    return [ROOT / f for f in files if f.startswith(prefix)]


def chapter_notebook(source: Path) -> nbformat.NotebookNode:
    notebook = jupytext.read(source.with_suffix(".md"), fmt="md:myst")
    notebook.metadata.pop("jupytext", None)
    title = next((i for i, c in enumerate(notebook.cells) if c.cell_type == "markdown"), -1)
    code = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    cell = nbformat.v4.new_code_cell(install_source(code))
    cell.id = "install-on-colab"
    notebook.cells.insert(title + 1, cell)
    for i, c in enumerate(notebook.cells):
        c.id = c.get("id") if c is cell else f"cell-{i}"
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    return notebook


def target(source: Path) -> Path:
    return OUT / source.relative_to(ROOT).with_suffix(".ipynb")


def render(source: Path) -> str:
    return nbformat.writes(chapter_notebook(source)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail if a notebook is missing or differs from its chapter")
    args = parser.parse_args(argv)
    stale = []
    for source in toc_files("chapters/"):
        path, text = target(source), render(source)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.relative_to(ROOT))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date with their chapters: {[str(p) for p in stale]}; run "
              f"python tools/colab_notebooks.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
