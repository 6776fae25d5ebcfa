"""Open every page of the built site in headless Chromium and report what a reader meets.

    python tools/check_site.py _build/html      # exit 1, listing each problem, if any

For each page: JavaScript errors (the console's SEVERE entries), images that do not load,
error outputs of executed cells, TeX left untypeset once MathJax is done (`$$`, `\\begin{`,
`\\frac`, ... in the visible text, outside code), an escaped underscore shown as `\\_` (in
the text, or inside an equation's `\\text{}`/`\\texttt{}`, where MathJax prints it as it
is), launch links into a repository (the course publishes its notebooks and package on its own
site: `tools/colab_install.py`), download links to a notebook the site does not hold, and folded asides
or answers that render open (a `details` element open, or a dropdown admonition whose body
shows): a reader predicts before seeing an answer, and reference material stays out of the
way until asked for. And what the page looks like at 1280 px: a display equation
wider than the text column (once `_static/fit-math.js` has set it as small as it may), and
a figure shown so much smaller than it was drawn that its smallest text (8 points, the
smallest the course's figures use) is under 10 px on the screen; the figure's resolution
is read from its PNG. Chromium runs headless, with no network, from Debian's `chromium`
and `chromium-driver` packages.
"""

from __future__ import annotations

import argparse
import base64
import re
import struct
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
RAW_TEX = re.compile(r"\$\$|\\begin\{|\\end\{|\\frac|\\sum_|\\mathrm\{|\\text\{|\\Psi\b")
SKIP = {"genindex.html", "search.html"}
ESCAPED_UNDERSCORE = re.compile(r"\\_")
# MathJax reads \_ in math as an underscore, but prints it as it is in text mode
TEXT_UNDERSCORE = re.compile(r"\\text(?:tt|rm|sf|it|bf)?\{[^}]*\\_")
# A launch link opens a notebook from a repository (Colab's from GitHub, Binder's): the
# course names no repository it does not own, and offers its notebooks for download
REPOSITORY_LINK = re.compile(r"colab\.research\.google\.com/github/|mybinder\.org/v2/gh/")
# A figure's smallest text: matplotlib's points, the course's smallest size, and the least
# it may be on the screen.
SMALLEST_PT = 8
MIN_TEXT_PX = 10

# Waits for MathJax (when the page has it) to finish typesetting, then reports.
INSPECT = r"""
const done = arguments[arguments.length - 1];
const report = () => {
  if (!document.body) { setTimeout(report, 100); return; }  // still being parsed
  const body = document.body.cloneNode(true);
  body.querySelectorAll("pre, code, script, style, mjx-container, .highlight, textarea")
      .forEach(e => e.remove());
  done({
    text: body.textContent,
    brokenImages: [...document.images].filter(i => !i.complete || i.naturalWidth === 0)
                                      .map(i => i.getAttribute("src")),
    errorOutputs: document.querySelectorAll(".output.traceback, .output.error").length,
    links: [...document.querySelectorAll("a[href]")].map(a => a.href),
    // each equation's TeX source, as MathJax read it
    tex: (() => { try { return MathJax.startup.document.getMathItemsWithin(document.body)
                                 .map(m => m.math); } catch (_) { return []; } })(),
    // display equations still wider than their box (hidden ones have no width)
    wideMath: [...document.querySelectorAll('mjx-container[display="true"]')]
        .filter(e => e.clientWidth && e.scrollWidth > e.clientWidth + 1)
        .map(e => {
          let tex = "";
          try { tex = MathJax.startup.document.getMathItemsWithin(e)[0].math; } catch (_) {}
          return {width: e.scrollWidth, column: e.clientWidth,
                  tex: tex || e.textContent};
        }),
    // folded asides and answers: a <details> (sphinx-design's dropdown, myst-nb's hidden
    // cells) must start closed; a dropdown admonition (sphinx-togglebutton) must hide its
    // body once its script has run
    openAsides: [
        ...[...document.querySelectorAll("details")].filter(d => d.open)
            .map(d => (d.querySelector("summary") || d).textContent),
        ...[...document.querySelectorAll(".admonition.dropdown")]
            .filter(a => [...a.children].some(c => !c.classList.contains("admonition-title")
                                                   && c.getClientRects().length > 0))
            .map(a => (a.querySelector(".admonition-title") || a).textContent),
    ].map(t => t.trim().slice(0, 60)),
    figures: [...document.images]
        .filter(i => i.complete && i.naturalWidth && i.getBoundingClientRect().width)
        .map(i => ({src: i.getAttribute("src"), natural: i.naturalWidth,
                    shown: i.getBoundingClientRect().width})),
  });
};
const start = Date.now();
let reported = false;
const once = () => { if (!reported) { reported = true; report(); } };
const poll = () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    // after fit-math.js, which waits on the same promise, has set the equations' sizes
    MathJax.startup.promise.then(() => setTimeout(once, 50), once);
    setTimeout(once, 15000);  // a typesetting that never ends is reported as it stands
  } else if (!window.MathJax || Date.now() - start > 10000) {
    once();
  } else {
    setTimeout(poll, 100);  // MathJax's script is deferred: wait for it to load
  }
};
poll();
"""


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-dev-shm-usage",
                 "--window-size=1280,1000", "--allow-file-access-from-files"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.set_script_timeout(30)
    return driver


def check_page(driver, page: Path, repo: Path = ROOT) -> list[str]:
    from selenium.common.exceptions import JavascriptException

    for attempt in range(2):  # a page caught mid-load on a busy machine gets a second look
        driver.get(page.resolve().as_uri())
        try:
            found = driver.execute_async_script(INSPECT)
            break
        except JavascriptException:
            if attempt:
                raise
    problems = []
    for entry in driver.get_log("browser"):
        if entry["level"] == "SEVERE":
            problems.append(f"JavaScript error: {entry['message'][:200]}")
    problems += [f"broken image: {src}" for src in found["brokenImages"]]
    if found["errorOutputs"]:
        problems.append(f"{found['errorOutputs']} error output(s)")
    for match in RAW_TEX.finditer(found["text"]):
        context = found["text"][max(0, match.start() - 30):match.end() + 30]
        problems.append(f"untypeset TeX: ...{' '.join(context.split())}...")
        break
    for eq in found["wideMath"]:
        problems.append(f"display equation wider than the column ({eq['width']} px in "
                        f"{eq['column']} px): {' '.join(eq['tex'].split())[:80]}")
    for figure in found["figures"]:
        dpi = png_dpi(image_bytes(page, figure["src"]))
        if dpi:
            px = SMALLEST_PT * dpi / 72 * figure["shown"] / figure["natural"]
            if px < MIN_TEXT_PX - 0.1:
                name = ("an embedded PNG" if figure["src"].startswith("data:")
                        else figure["src"].rsplit("/", 1)[-1])
                problems.append(
                    f"figure text too small: {name} drawn {figure['natural']} px "
                    f"wide at {dpi:.0f} dpi, shown {figure['shown']:.0f} px wide, so "
                    f"{SMALLEST_PT}-point text is {px:.1f} px (under {MIN_TEXT_PX})")
    for title in found["openAsides"]:
        problems.append(f"folded aside rendered open: {title}")
    for match in ESCAPED_UNDERSCORE.finditer(found["text"]):
        context = found["text"][max(0, match.start() - 30):match.end() + 30]
        problems.append(f"escaped underscore shown: ...{' '.join(context.split())}...")
        break
    for tex in found["tex"]:
        if TEXT_UNDERSCORE.search(tex):
            problems.append(f"escaped underscore shown in an equation's text: "
                            f"{' '.join(tex.split())[:80]}")
    for url in found["links"]:
        if REPOSITORY_LINK.search(url):
            problems.append(f"launch link into a repository: {url}")
        elif url.startswith("file:") and url.split("#")[0].endswith(".ipynb") \
                and not Path(unquote(url.split("#")[0][len("file://"):])).is_file():
            problems.append(f"link to a notebook the site does not hold: {url}")
    return problems


def image_bytes(page: Path, src: str) -> bytes:
    """An image's bytes, from a data: URL or a file beside the page (b"" for any other)."""
    if src.startswith("data:"):
        header, _, data = src.partition(",")
        return base64.b64decode(data) if header.endswith(";base64") else b""
    if "://" in src:
        return b""
    path = page.parent / unquote(src.split("#")[0].split("?")[0])
    return path.read_bytes() if path.is_file() else b""


def png_dpi(data: bytes) -> float | None:
    """The resolution a PNG records (its pHYs chunk, which matplotlib writes), or None."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"pHYs" and length == 9:
            x, _, unit = struct.unpack(">IIB", data[pos + 8:pos + 17])
            return x * 0.0254 if unit == 1 and x else None
        if kind in (b"IDAT", b"IEND"):
            return None
        pos += 12 + length
    return None


def check_site(site: Path, repo: Path = ROOT) -> dict[str, list[str]]:
    pages = sorted(p for p in site.rglob("*.html")
                   if p.name not in SKIP and "_static" not in p.parts
                   and "_sources" not in p.parts)
    driver = browser()
    try:
        return {str(p.relative_to(site)): problems for p in pages
                if (problems := check_page(driver, p, repo))}
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site, e.g. _build/html")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"error: {args.site} holds no built site (no index.html)", file=sys.stderr)
        return 2
    found = check_site(args.site)
    pages = len([p for p in args.site.rglob("*.html") if "_static" not in p.parts])
    for page, problems in found.items():
        for problem in problems:
            print(f"{page}: {problem}")
    print(f"pages: {pages - len(found)} passed, {len(found)} failed")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
