"""Publish the course's package with the book: its wheel and shardlab-course.zip (the wheel
and the labs) under the site's `course/`, which the notebooks' install cell reads on Colab
(`tools/colab_install.py` builds them and writes that cell)."""

from __future__ import annotations

import sys
from pathlib import Path


def _publish(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    tools = Path(app.srcdir) / "tools"
    sys.path.insert(0, str(tools))
    try:
        from colab_install import SITE_FOLDER, build_course_files
    finally:
        sys.path.remove(str(tools))
    build_course_files(Path(app.outdir) / SITE_FOLDER)


def setup(app):
    app.connect("build-finished", _publish)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
