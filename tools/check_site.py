"""Open every page of the built site in headless Chromium and report what a reader meets.

    python tools/check_site.py _build/html      # exit 1, listing each problem, if any

For each page: JavaScript errors (the console's SEVERE entries), images that do not load,
error outputs of executed cells, TeX left untypeset once MathJax is done (`$$`, `\\begin{`,
`\\frac`, ... in the visible text, outside code), and launch links to a notebook that does
not exist in the repository. Chromium runs headless, with no network, from Debian's
`chromium` and `chromium-driver` packages.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAW_TEX = re.compile(r"\$\$|\\begin\{|\\end\{|\\frac|\\sum_|\\mathrm\{|\\text\{|\\Psi\b")
SKIP = {"genindex.html", "search.html"}

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
    colab: [...document.querySelectorAll("a[href*='colab.research.google.com']")]
               .map(a => a.href),
  });
};
const start = Date.now();
let reported = false;
const once = () => { if (!reported) { reported = true; report(); } };
const poll = () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(once, once);
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
    for url in found["colab"]:
        path = url.split("/blob/", 1)[1].split("/", 1)[1] if "/blob/" in url else ""
        if not path.endswith(".ipynb") or not (repo / path).is_file():
            problems.append(f"launch link to a notebook that is not in the repository: {url}")
    return problems


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
