"""The site as a reader meets it, and Colab: notebooks for the chapters, one repository URL,
and a browser check that can fail.

The check of the whole built site runs in `.ci/run` after the book is built
(`python tools/check_site.py _build/html`); here the same checker is shown to catch each
problem on pages broken on purpose.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import colab_notebooks  # noqa: E402


def test_every_chapter_has_an_up_to_date_notebook_for_colab():
    assert colab_notebooks.main(["--check"]) == 0


def install_cells() -> dict[str, tuple[str, str]]:
    """Each notebook's first code cell (its install cell) and the rest of its code."""
    notebooks = [*sorted((ROOT / "labs").glob("*.ipynb")),
                 *sorted((ROOT / "notebooks").rglob("*.ipynb"))]
    cells = {}
    for path in notebooks:
        cells_ = json.loads(path.read_text())["cells"]
        code = ["".join(c["source"]) for c in cells_ if c["cell_type"] == "code"]
        cells[str(path.relative_to(ROOT))] = (code[0] if code else "", "\n".join(code[1:]))
    return cells


def test_every_notebook_installs_the_course_from_the_one_repository_url():
    """With the extras its code needs on Colab (DeepSpeed is not preinstalled there)."""
    url = colab_notebooks.repository_url()
    cells = install_cells()
    assert len(cells) >= 13
    for name, (source, rest) in cells.items():
        assert source.startswith(colab_notebooks.INSTALL_COMMENT), name
        extras = colab_notebooks.package_extras(rest)
        package = f"shardlab[{','.join(extras)}]" if extras else "shardlab"
        assert f'"{package} @ git+{url}"' in source, name
        assert source.count("git+") == 1, name
    assert any("shardlab[deepspeed]" in source for source, _ in cells.values())


def test_every_lab_shows_its_title_before_the_install_cell():
    for path in sorted((ROOT / "labs").glob("*.ipynb")):
        first = json.loads(path.read_text())["cells"][0]
        assert first["cell_type"] == "markdown" and "".join(first["source"]).startswith("# "), \
            path.name


# ----------------------------------------------------------------------------- the browser

chromium = pytest.mark.skipif(
    shutil.which("chromium") is None or not Path("/usr/bin/chromedriver").exists(),
    reason="headless Chromium is not installed (Debian: apt-get install chromium "
           "chromium-driver); .ci/run installs it")

BROKEN = {
    "js-error.html": "<html><body><p>fine text</p><script>notDefinedAnywhere();</script>"
                     "</body></html>",
    "raw-tex.html": "<html><body><p>The model: $$M = \\frac{16\\Psi}{N}$$</p></body></html>",
    "broken-image.html": "<html><body><img src='missing.png'></body></html>",
    "error-output.html": "<html><body><div class='output traceback'>Traceback</div>"
                         "</body></html>",
    "missing-notebook.html": "<html><body><a href='https://colab.research.google.com/github/"
                             "shardlab/shardlab/blob/main/notebooks/nowhere.ipynb'>Colab</a>"
                             "</body></html>",
    "good.html": "<html><body><p>Code shows <code>$$x$$</code> as it is.</p>"
                 "<img src='sharp.png'><details class='sd-dropdown'><summary>Answer</summary>"
                 "<p>folded</p></details></body></html>",
    # an aside printed at full weight: a dropdown left open, an admonition that shows its body
    "open-aside.html": "<html><body><details class='sd-dropdown' open><summary>Aside: DeepSpeed"
                       "</summary><p>reference</p></details><div class='admonition dropdown'>"
                       "<p class='admonition-title'>Aside: HSDP</p><p>shown</p></div>"
                       "</body></html>",
    # what MathJax leaves for a display equation wider than the column
    "wide-equation.html": "<html><body><div class='math'><mjx-container display='true' "
                          "style='display:block;overflow-x:auto'><span style='display:"
                          "inline-block;width:3000px'>T = ...</span></mjx-container></div>"
                          "</body></html>",
    # a figure drawn 1200 px wide at 100 dpi and shown 600 px wide: 8 points is 5.6 px
    "small-figure.html": "<html><body><img src='wide.png' style='width:600px'></body></html>",
}


def png(width: int, height: int, dpi: float) -> bytes:
    """A blank grey PNG that records its resolution, as matplotlib's do."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    rows = b"".join(b"\x00" + b"\xc0" * width for _ in range(height))
    per_metre = round(dpi / 0.0254)
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"pHYs", struct.pack(">IIB", per_metre, per_metre, 1))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


@chromium
def test_the_browser_check_fails_on_each_kind_of_broken_page(tmp_path):
    import check_site
    for name, html in BROKEN.items():
        (tmp_path / name).write_text(html)
    (tmp_path / "wide.png").write_bytes(png(1200, 300, 100))
    (tmp_path / "sharp.png").write_bytes(png(600, 300, 90))  # shown at its own size
    (tmp_path / "index.html").write_text("<html><body>index</body></html>")
    found = check_site.check_site(tmp_path)
    assert any("JavaScript error" in p and "notDefinedAnywhere" in p
               for p in found["js-error.html"])
    assert any("untypeset TeX" in p for p in found["raw-tex.html"])
    assert any("broken image: missing.png" in p for p in found["broken-image.html"])
    assert found["error-output.html"] == ["1 error output(s)"]
    assert any("notebooks/nowhere.ipynb" in p for p in found["missing-notebook.html"])
    assert any("display equation wider than the column (3000 px" in p
               for p in found["wide-equation.html"])
    assert any("figure text too small: wide.png" in p and "5.6 px" in p
               for p in found["small-figure.html"])
    assert found["open-aside.html"] == ["folded aside rendered open: Aside: DeepSpeed",
                                        "folded aside rendered open: Aside: HSDP"]
    assert "good.html" not in found and "index.html" not in found


def test_every_exercise_answer_in_the_labs_is_collapsed_with_its_output():
    """A reader predicts before seeing the answer: solution cells (and the worked
    predictions) are collapsed whole, input and output (`hide-cell`); in Jupyter and Colab
    too: tests/test_hidden_answers.py."""
    answers = 0
    for path in sorted((ROOT / "labs").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"]).lstrip()
            if cell["cell_type"] == "code" and source.startswith(
                    ("# @title Solution", "# Solution", "# Your prediction", "%%writefile")):
                answers += 1
                assert "hide-cell" in cell["metadata"].get("tags", []), (path.name, source[:60])
    assert answers >= 10


# ----------------------------------------------------------------- one chapter template

def toc_entries() -> list[str]:
    import yaml
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [c["file"] for part in toc["parts"] for c in part["chapters"]]


CHAPTERS_IN_TOC = [f for f in toc_entries() if f.startswith("chapters/")]
# chapters that still close their own way, until they are brought to the template
TEMPLATE_PENDING = {"chapters/06-checkpoints", "chapters/07-beyond-data-parallel",
                    "chapters/08-debugging", "chapters/09-step-time", "chapters/10-real-jobs",
                    "chapters/11-models-in-and-out"}


@pytest.mark.parametrize("chapter", [
    pytest.param(c, marks=pytest.mark.xfail(reason="not yet in the template", strict=False))
    if c in TEMPLATE_PENDING else c for c in CHAPTERS_IN_TOC])
def test_every_chapter_follows_the_template(chapter):
    """question, picture, (formulas and measurements), misconception, say it out loud,
    worked problems, and the lab that follows it in the table of contents."""
    import re
    text = (ROOT / f"{chapter}.md").read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[0] == "The question", headings[:2]
    assert headings[1].startswith("The picture"), headings[:2]
    closing = [h for h in headings if h.startswith(("The misconception", "Say it out loud",
                                                    "Worked problems"))]
    assert [h.split(":")[0].rstrip("s") for h in closing] == [
        "The misconception", "Say it out loud", "Worked problem"], closing
    assert headings.index(closing[-1]) >= len(headings) - 2, headings[-3:]
    entries = toc_entries()
    after = entries[entries.index(chapter) + 1:]
    labs = [e for e in after[:next((i for i, e in enumerate(after)
                                    if not e.startswith("labs/")), len(after))]]
    if labs:  # the chapter ends by sending the reader to the lab that follows it
        assert headings[-1].startswith("Now do lab"), headings[-1]
        last = text[text.rindex("## Now do lab"):]
        for lab in labs:
            assert f"{{doc}}`../{lab}`" in last, (chapter, lab)


def test_every_lab_follows_the_chapter_it_practises():
    """Each lab's introduction names a chapter by its title: that chapter comes before it
    in the table of contents, with only labs in between."""
    import re
    entries = toc_entries()
    titles = {}
    for entry in entries:
        if entry.startswith("chapters/"):
            first = (ROOT / f"{entry}.md").read_text().split("\n# ", 1)[1].split("\n", 1)[0]
            titles[first.strip()] = entry
    for i, entry in enumerate(entries):
        if not entry.startswith("labs/"):
            continue
        chapter = next(e for e in reversed(entries[:i]) if not e.startswith("labs/"))
        intro = "".join(json.loads((ROOT / f"{entry}.ipynb").read_text())["cells"][0]["source"])
        named = [titles[t] for t in re.findall(r"chapter \*([^*]+)\*", intro) if t in titles]
        if named:
            assert chapter in named, (entry, chapter, named)
