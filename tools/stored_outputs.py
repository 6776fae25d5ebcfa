"""The rule for what a lab's stored output may show, and the comparison nbval uses for it.

A lab's outputs are stored on one machine and re-checked by nbval on every reader's: another
CPU, another BLAS, another thread count, another torch. What nbval compares must not depend
on the last bits of floating-point arithmetic, nor on when a kernel frees a temporary. So:

* **Integers are exact.** Bytes of model states, counts of collectives, bytes sent: the same
  on every machine, compared digit for digit.
* **A float is printed to at most `MAX_SIGNIFICANT` significant digits**, and two floats
  match when they differ by at most one unit in the last digit printed. Five digits keep
  a loss readable (5.5490) while arithmetic that differs in its last bits (measured: a loss
  of 4.797589 on one CPU is 4.797588 on another, a relative change of 2e-7) stays far below
  one unit (1e-4 relative at worst); the one unit absorbs a rounding that falls the other
  way.
* **Peaks that include kernels' temporaries are not printed as numbers** in a compared
  cell: they vary from run to run (lab 6's one-unit peak read 3955.3, 4020.9 and 4053.6 kB
  on one machine). Compare them with their prediction and print the verdict (True/False),
  or print them in a cell marked `# NBVAL_IGNORE_OUTPUT`, as timings are.

`same_output` is the comparison; `too_precise` is the lint that a test runs over every
stored output nbval compares; `install` puts the comparison into nbval (labs/conftest.py
calls it, and `-p stored_outputs` does for any notebook).
"""

from __future__ import annotations

import copy
import json
import os
import re
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Iterator

MAX_SIGNIFICANT = 5

# A number standing on its own: not part of a word ("fp32", "step-000004" keeps its text
# before the digits), nor of a version ("2.13.0"). Thousands may be grouped with commas.
NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")

# nbval's own markers for a cell whose output it does not compare (a cell marked to raise
# an exception is still compared, so it is not among them).
UNCOMPARED_COMMENTS = ("NBVAL_IGNORE_OUTPUT", "PYTEST_VALIDATE_IGNORE_OUTPUT", "NBVAL_SKIP")
UNCOMPARED_TAGS = {"nbval-ignore-output", "nbval-skip"}


def is_float(token: str) -> bool:
    return "." in token or "e" in token.lower()


def last_digit_unit(token: str) -> Decimal:
    """One unit in the last printed digit: 0.0001 for '5.5490', 10 for '1.23e3'."""
    mantissa, _, exponent = token.lower().replace(",", "").partition("e")
    decimals = len(mantissa.partition(".")[2])
    return Decimal(1).scaleb(-decimals + (int(exponent) if exponent else 0))


def significant_digits(token: str) -> int:
    mantissa = token.lower().replace(",", "").partition("e")[0].lstrip("-")
    digits = mantissa.replace(".", "").lstrip("0")
    return max(len(digits), 1)


def split_numbers(text: str) -> tuple[list[str], list[str]]:
    """The text between the numbers, without its spaces (a number one digit longer shifts a
    right-aligned column), and the numbers."""
    words = [re.sub(r"[ \t]+", "", part) for part in NUMBER.split(text)]
    return words, NUMBER.findall(text)


def same_number(stored: str, computed: str) -> bool:
    if is_float(stored) != is_float(computed):
        return False
    a, b = (Decimal(t.replace(",", "")) for t in (stored, computed))
    if not is_float(stored):
        return a == b
    return abs(a - b) <= max(last_digit_unit(stored), last_digit_unit(computed))


def same_output(stored: str, computed: str) -> bool:
    """nbval's comparison under the rule: the same text, the same integers, and floats
    within one unit of their last printed digit."""
    if stored == computed:
        return True
    stored_words, stored_numbers = split_numbers(stored)
    computed_words, computed_numbers = split_numbers(computed)
    return (stored_words == computed_words and len(stored_numbers) == len(computed_numbers)
            and all(map(same_number, stored_numbers, computed_numbers)))


def too_precise(text: str) -> list[str]:
    """The floats in `text` printed with more significant digits than the rule allows."""
    return [t for t in NUMBER.findall(text) if is_float(t) and significant_digits(t) > MAX_SIGNIFICANT]


def is_compared(cell: dict) -> bool:
    """Whether nbval (run with --nbval) compares this code cell's outputs."""
    source = "".join(cell.get("source", ""))
    tags = set(cell.get("metadata", {}).get("tags", []))
    return (cell.get("cell_type") == "code" and not tags & UNCOMPARED_TAGS
            and not any(f"# {marker}" in source for marker in UNCOMPARED_COMMENTS))


def output_texts(output: dict) -> Iterator[str]:
    """The text nbval compares in one output: a stream's text, a result's text/plain."""
    if output.get("output_type") == "stream":
        yield "".join(output.get("text", ""))
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/") and mime != "text/html":
            yield "".join(value) if isinstance(value, list) else value


def compared_texts(notebook: Path) -> Iterator[tuple[int, str]]:
    """(cell index, text) for every stored output that nbval compares."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    for index, cell in enumerate(cells):
        if is_compared(cell):
            for output in cell.get("outputs", []):
                for text in output_texts(output):
                    yield index, text


# --- nbval ---------------------------------------------------------------------------------

def _adopt_matching(tested: list, stored: list) -> list:
    """Each computed output whose text matches its stored one under the rule is given the
    stored text, so that nbval's own comparison (and its report of a real difference) runs
    unchanged on what is left. Outputs pair up in order, as nbval pairs them."""
    adopted = []
    for i, test in enumerate(tested):
        ref = stored[i] if i < len(stored) else {}
        same_kind = (test.get("output_type") == ref.get("output_type")
                     and test.get("name") == ref.get("name"))
        if not same_kind:
            adopted.append(test)
            continue
        test = copy.deepcopy(test)
        if isinstance(test.get("text"), str) and isinstance(ref.get("text"), str) \
                and same_output(ref["text"], test["text"]):
            test["text"] = ref["text"]
        for mime, value in test.get("data", {}).items():
            stored_value = ref.get("data", {}).get(mime)
            if mime.startswith("text/") and isinstance(value, str) \
                    and isinstance(stored_value, str) and same_output(stored_value, value):
                test["data"][mime] = stored_value
        adopted.append(test)
    return adopted


@contextmanager
def _no_gpu_for_the_kernel() -> Iterator[None]:
    """The labs' stored outputs are the CPU's (gloo): a kernel started under nbval sees no
    GPU, so `backend="auto"` places the ranks on the CPU on a GPU machine too. Only the
    kernel's environment changes; the tests in the same session keep the GPU."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def install() -> None:
    """Make nbval compare outputs under the rule, and start its kernels without a GPU."""
    from nbval import plugin

    if getattr(plugin.IPyNbCell.compare_outputs, "under_the_rule", False):
        return
    compare_as_text = plugin.IPyNbCell.compare_outputs
    start_kernel = plugin.IPyNbFile.setup

    def compare_outputs(self, test, ref, skip_compare=None):
        return compare_as_text(self, _adopt_matching(test, ref), ref, skip_compare)

    def setup(self):
        with _no_gpu_for_the_kernel():
            return start_kernel(self)

    compare_outputs.under_the_rule = True
    plugin.IPyNbCell.compare_outputs = compare_outputs
    plugin.IPyNbFile.setup = setup


def pytest_configure(config) -> None:  # as a plugin: `pytest -p stored_outputs --nbval ...`
    install()
