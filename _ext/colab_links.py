"""Point each chapter's Colab button at its notebook.

sphinx-book-theme builds a page's Colab link from its source file, and a chapter's source
is MyST Markdown, which Colab cannot open. `tools/colab_notebooks.py` writes each chapter
as `notebooks/chapters/<name>.ipynb`; this rewrites the link to that notebook, after the
theme has built its buttons.
"""

from __future__ import annotations

from pathlib import Path


def _point_colab_at_notebooks(app, pagename, templatename, context, doctree):
    if not pagename.startswith("chapters/"):
        return
    notebook = f"notebooks/{pagename}.ipynb"
    if not (Path(app.srcdir) / notebook).is_file():
        return
    for group in context.get("header_buttons", []):
        for button in group.get("buttons", []):
            url = button.get("url", "")
            if "colab.research.google.com" in url:
                button["url"] = url.rsplit("/blob/", 1)[0] + "/blob/" + \
                    url.rsplit("/blob/", 1)[1].split("/", 1)[0] + f"/{notebook}"


def setup(app):
    app.connect("html-page-context", _point_colab_at_notebooks, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
