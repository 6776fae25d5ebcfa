"""The course on Colab, from files the course itself publishes: the install cell, and the
files it installs from.

Colab opens a notebook uploaded to it, and the notebook's first cell installs `shardlab`.
It installs it from `shardlab-course.zip` (the package's wheel and the `labs/` folder, where
the graders live): the one the reader uploaded beside the notebook, else the one the book's
site serves at `course/shardlab-course.zip`. The site's address is the one setting,
`_config.yml`'s `html.baseurl` (empty while the book is not published: then the cell asks
for the zip). Nothing is installed from a repository or an index entry of someone else's
naming: the zip is built with the book (`_ext/course_package.py` calls `build_course_files`
into the site), and its wheel's own dependencies (torch, numpy, ...) come from the package
index as for any `pip install`.

    cell_source(site, extras, labs)   the install cell: self-contained, since shardlab is
                                      not installed when it runs; it prints one line
                                      saying what it installed from, or what to do
    build_course_files(folder)        the wheel and shardlab-course.zip, into `folder`
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
INSTALL_COMMENT = "# On Colab, install the course package; anywhere else this cell does nothing."
ZIP_NAME = "shardlab-course.zip"
SITE_FOLDER = "course"  # where the site serves the zip: <site>/course/shardlab-course.zip
UNPACKED = "/content/shardlab-course"  # where Colab's cell unpacks it

# The cell's function, as it runs on Colab: shardlab is not installed yet, so it stands
# alone (standard library only). `pip`: the pip command's first words (tests install into
# a folder of their own, or not at all).
INSTALL_FUNCTION = '''\
def install_course(site, extras=(), others=(), where="/content", pip=("install", "-q")):
    """Install shardlab from shardlab-course.zip: the one uploaded to `where`, else the
    one the course's site serves; return one line saying which, or what to do."""
    import importlib, pathlib, subprocess, urllib.request, zipfile
    where = pathlib.Path(where)
    upload, folder = where / "shardlab-course.zip", where / "shardlab-course"
    if upload.is_file():
        archive, source = upload, f"the uploaded {upload}"
    elif site:
        archive, source = where / "shardlab-course-download.zip", site
        url = f"{site.rstrip('/')}/course/shardlab-course.zip"
        try:
            urllib.request.urlretrieve(url, archive)
        except (OSError, ValueError) as exc:
            return (f"shardlab is not installed: {url} could not be read ({exc}); download "
                    f"shardlab-course.zip from the course's site, upload it to {where} "
                    f"(the Files pane), and run this cell again")
    else:
        return (f"shardlab is not installed: no {upload.name} in {where} and no course "
                f"site set; download shardlab-course.zip from the course's site, upload it "
                f"to {where} (the Files pane), and run this cell again")
    with zipfile.ZipFile(archive) as unpacked:
        unpacked.extractall(folder)
    [wheel] = folder.glob("shardlab-*.whl")
    package = f"{wheel}[{','.join(extras)}]" if extras else str(wheel)
    subprocess.run([sys.executable, "-m", "pip", *pip, package, *others], check=True)
    importlib.invalidate_caches()
    return f"installed shardlab {wheel.name.split('-')[1]} from {source}"
'''


def course_site() -> str:
    """The address the book is published at (`_config.yml`: `html.baseurl`), or ""."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    return str((config.get("html") or {}).get("baseurl") or "").rstrip("/")


def cell_source(site: str, extras: tuple[str, ...] = (), others: tuple[str, ...] = (),
                labs: bool = False) -> str:
    """The install cell of a notebook: shardlab with the `extras` of it the notebook needs
    (Colab has torch and transformers, not DeepSpeed), the `others` packages it needs
    (chapters: myst-nb, whose `glue` they call), and with `labs` the unpacked labs folder
    on the path (`from graders import ...`, in the ranks too)."""
    call = f"install_course({site!r}"
    if extras:
        call += f", extras={tuple(extras)!r}"
    if others:
        call += f", others={tuple(others)!r}"
    lines = [INSTALL_COMMENT, "import importlib.util, sys", "", INSTALL_FUNCTION.rstrip(), "",
             'if "google.colab" in sys.modules and importlib.util.find_spec("shardlab") is None:',
             f"    print({call}))"]
    if labs:
        lines += ['if "google.colab" in sys.modules:',
                  f'    sys.path.insert(0, "{UNPACKED}/labs")  # the graders, ranks too']
    return "\n".join(lines)


def build_wheel(out: Path) -> Path:
    """The package's wheel, built from a copy of what it is made of (the build writes
    its own folders beside the sources), with the build tools of this environment."""
    with tempfile.TemporaryDirectory(prefix="shardlab-wheel-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, tree / name)
        shutil.copytree(ROOT / "code", tree / "code",
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(Path(tmp) / "dist"), str(tree)],
                       check=True)
        [wheel] = (Path(tmp) / "dist").glob("shardlab-*.whl")
        out.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(wheel, out / wheel.name))


def build_course_files(out: Path) -> tuple[Path, Path]:
    """Into `out`: the wheel, and shardlab-course.zip holding it and `labs/` (the
    notebooks and their graders)."""
    out = Path(out)
    wheel = build_wheel(out)
    archive = out / ZIP_NAME
    skip = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache"}
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(wheel, wheel.name)
        for path in sorted((ROOT / "labs").rglob("*")):
            if path.is_file() and not skip & set(path.relative_to(ROOT).parts):
                z.write(path, str(path.relative_to(ROOT)))
    return wheel, archive


if __name__ == "__main__":
    for made in build_course_files(Path(sys.argv[1] if len(sys.argv) > 1 else "course")):
        print(made)
