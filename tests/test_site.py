"""The site as a reader meets it, and Colab: notebooks for the chapters, an install cell
that installs the course from what the course publishes (never from a repository), and a
browser check that can fail.

The check of the whole built site runs in `.ci/run` after the book is built
(`python tools/check_site.py _build/html`); here the same checker is shown to catch each
problem on pages broken on purpose.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import colab_install  # noqa: E402
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


def test_every_chapter_notebook_installs_the_course_from_the_one_site_setting():
    """With the extras its code needs on Colab (DeepSpeed is not preinstalled there)."""
    site = colab_install.course_site()
    cells = {name: cell for name, cell in install_cells().items()
             if name.startswith("notebooks/")}
    assert len(cells) >= 11
    for name, (source, rest) in cells.items():
        extras = colab_notebooks.package_extras(rest)
        assert source == colab_install.cell_source(site, extras, ("myst-nb",)), name
    assert any("extras=('deepspeed',)" in source for source, _ in cells.values())


def test_every_lab_installs_the_course_and_its_graders_from_the_one_site_setting():
    """The chapters' cell, with the unpacked labs folder on the path (the graders) and no
    myst-nb (the labs glue nothing); DeepSpeed where the lab runs it (lab 5)."""
    site = colab_install.course_site()
    cells = {name: cell for name, cell in install_cells().items() if name.startswith("labs/")}
    assert len(cells) >= 11
    for name, (source, rest) in cells.items():
        extras = colab_notebooks.package_extras(rest)
        assert source == colab_install.cell_source(site, extras, labs=True), name
    assert colab_notebooks.package_extras(cells["labs/05-stage-by-stage.ipynb"][1]) == \
        ("deepspeed",)


# What no file of the course may install from, or send a reader to: a repository (git+,
# a clone, a Colab or Binder launch into GitHub), or the package index's `shardlab`, a name
# the course does not hold. The course publishes its package and notebooks itself
# (`tools/colab_install.py`).
FOREIGN = re.compile(r"git\+https?://|git clone|colab\.research\.google\.com/github/|"
                     r"mybinder\.org/v2/gh/|github\.com/shardlab|"
                     r"pip install (?:-\S+ )*['\"]?shardlab\b")


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = [ROOT / line for line in listed.stdout.splitlines()]
    return [f for f in files if f.suffix in (".py", ".md", ".yml", ".yaml", ".ipynb", ".txt",
                                             ".toml", ".cfg", ".sh", ".sbatch", "")
            and f.is_file() and f.name != "test_site.py"]


def test_no_file_installs_from_or_launches_into_a_repository():
    found = [str(f.relative_to(ROOT)) for f in tracked_text_files()
             if not f.relative_to(ROOT).parts[0] == "labs" and FOREIGN.search(f.read_text())]
    assert found == []


def test_no_lab_installs_from_a_repository():
    found = [str(f.relative_to(ROOT)) for f in sorted((ROOT / "labs").glob("*.ipynb"))
             if FOREIGN.search(f.read_text())]
    assert found == []


def test_the_install_cell_installs_from_an_upload_else_the_site_and_says_which(tmp_path):
    """A local folder stands for the published site (file://). The cell does nothing off
    Colab; its function takes the uploaded zip first, then the site's, and says in one
    line which, or what to do when neither is there; the wheel it installs imports."""
    site = tmp_path / "site"
    wheel, archive = colab_install.build_course_files(site / colab_install.SITE_FOLDER)
    with zipfile.ZipFile(archive) as z:
        names = z.namelist()
    assert wheel.name in names and "labs/graders/ring.py" in names
    assert not any("__pycache__" in n or ".ipynb_checkpoints" in n for n in names)
    source = colab_install.cell_source(site.as_uri(), ("deepspeed",), ("myst-nb",), labs=True)
    namespace: dict = {}
    exec(compile(source, "install cell", "exec"), namespace)  # not Colab: installs nothing
    install = namespace["install_course"]
    # neither an upload nor a site: one line saying what to do, nothing installed
    content = tmp_path / "content"
    content.mkdir()
    line = install("", where=content)
    assert line == (f"shardlab is not installed: no shardlab-course.zip in {content} and "
                    f"no course site set; download shardlab-course.zip from the course's "
                    f"site, upload it to {content} (the Files pane), and run this cell again")
    line = install((tmp_path / "nowhere").as_uri(), where=content)
    assert line.startswith("shardlab is not installed: file://") and "\n" not in line
    # the site: read, unpacked, pip asked for the wheel (a dry run: nothing installed)
    line = install(site.as_uri(), where=content, pip=("install", "-q", "--no-deps",
                                                      "--dry-run"))
    assert line == f"installed shardlab 0.1.0 from {site.as_uri()}"
    assert (content / "shardlab-course" / "labs" / "graders" / "ring.py").is_file()
    # an upload comes first, and its wheel installs and imports
    shutil.copy2(archive, content / "shardlab-course.zip")
    target = tmp_path / "installed"
    line = install("https://example.invalid", where=content,
                   pip=("install", "-q", "--no-deps", "--target", str(target)))
    assert line == f"installed shardlab 0.1.0 from the uploaded {content / 'shardlab-course.zip'}"
    imported = subprocess.run([sys.executable, "-c", "import shardlab.vocabulary as v, sys; "
                               "print(v.__file__)"], capture_output=True, text=True,
                              env={"PYTHONPATH": str(target), "PATH": ""})
    assert imported.stdout.startswith(str(target)), imported.stderr


def test_the_chapters_temporary_folders_go_with_their_kernel(tmp_path):
    """The chapters' scratch folders (checkpoints, traces: about 143 MB a build) are
    `TemporaryDirectory`s, removed when the kernel ends; run as the chapters make them, in
    a process that then exits, they leave nothing."""
    made = []
    for chapter in sorted((ROOT / "chapters").glob("*.md")):
        text = chapter.read_text()
        assert "mkdtemp(" not in text, chapter.name
        made += re.findall(r"^(\w+ = tempfile\.TemporaryDirectory\([^)]*\))(?: *#.*)?$", text,
                           flags=re.M)
    assert len(made) >= 4, made
    script = "import tempfile\n" + "\n".join(
        f"{line}\nprint({line.split(' =')[0]}.name)" for line in made)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={"TMPDIR": str(tmp_path), "PATH": ""}, check=True)
    folders = done.stdout.split()
    assert len(folders) == len(made) and all(f.startswith(str(tmp_path)) for f in folders)
    assert list(tmp_path.iterdir()) == []


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
    "launch-into-a-repository.html": "<html><body><a href='https://colab.research.google."
                                     "com/github/someone/else/blob/main/x.ipynb'>Colab</a>"
                                     "</body></html>",
    "missing-notebook.html": "<html><body><a href='nowhere.ipynb'>.ipynb</a></body></html>",
    "escaped-underscore.html": "<html><body><p>reshard\\_after\\_forward</p></body></html>",
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
    assert any("launch link into a repository" in p
               for p in found["launch-into-a-repository.html"])
    assert any("notebook the site does not hold" in p and "nowhere.ipynb" in p
               for p in found["missing-notebook.html"])
    assert any("escaped underscore shown" in p for p in found["escaped-underscore.html"])
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
@pytest.mark.parametrize("chapter", CHAPTERS_IN_TOC)
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
