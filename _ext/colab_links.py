"""Each chapter's notebook, offered for download beside the page, for Colab.

Colab opens a notebook from GitHub, Drive or an upload; the course publishes no notebook
on a GitHub repository of its own, so a page offers its notebook to download and upload
(the labs are notebooks already: the theme's download button gives them). A chapter's
source is MyST Markdown, which Colab cannot open: `tools/colab_notebooks.py` writes each
as `notebooks/chapters/<name>.ipynb`, which the site serves beside the page
(`html_extra_path`), and this adds it to the page's download buttons.
"""

from __future__ import annotations

from pathlib import Path


def _offer_the_notebook(app, pagename, templatename, context, doctree):
    if not pagename.startswith("chapters/"):
        return
    notebook = Path(app.srcdir) / "notebooks" / f"{pagename}.ipynb"
    if not notebook.is_file():
        return
    for group in context.get("header_buttons", []):
        if group.get("label") == "download-buttons":
            # the theme's own .ipynb (the executed chapter) gives way to the one for Colab
            buttons = [b for b in group.get("buttons", [])
                       if b.get("label") != "download-notebook-button"]
            buttons.insert(0, {
                "type": "link", "url": f"{Path(pagename).name}.ipynb",
                "text": ".ipynb", "tooltip": "Download the notebook (in Colab: File, "
                                             "Upload notebook)",
                "icon": "fas fa-code", "label": "download-notebook-button"})
            group["buttons"] = buttons


def setup(app):
    app.connect("html-page-context", _offer_the_notebook, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
