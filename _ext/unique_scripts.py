"""Each script once per page.

Under Jupyter Book 1, sphinx-thebe and sphinx-togglebutton register their inline
configuration scripts twice, so every page declared `const THEBE_JS_URL` twice and threw
"Identifier 'THEBE_JS_URL' has already been declared". This keeps the first of identical
scripts (same file and attributes, or same inline body) when a page is written.
"""

from __future__ import annotations


def _key(script) -> tuple:
    # An inline script comes with filename None from one extension and "" from the other:
    # the same script either way.
    attributes = tuple(sorted((k, str(v)) for k, v in getattr(script, "attributes", {}).items()))
    return (getattr(script, "filename", None) or "", attributes)


def _drop_repeated_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        key = _key(script)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app):
    app.connect("html-page-context", _drop_repeated_scripts, priority=1000)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
