"""The labs' stored outputs follow the course's rule (tools/stored_outputs.py), and nbval
checks them under it: strictly where the machine cannot change a value (an integer, a word),
to one unit of the last printed digit where it can (a float printed to at most five
significant digits).

The lint below is what catches, on any one machine, an output that would fail on another:
a loss printed to its last bits passes where it was stored and fails on a CPU whose
arithmetic rounds one step differently (lab 6 once printed 4.797589, read 4.797588 on an
AMD EPYC). Peaks that include kernels' temporaries are the other kind; no lint sees them,
so the labs print them in ignored cells, or their comparison with a prediction as True/False.
"""

import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import stored_outputs as rule  # noqa: E402

LABS = sorted((ROOT / "labs").glob("*.ipynb"))


def test_the_rule_compares_integers_exactly_and_floats_to_their_last_digit():
    assert rule.same_output("loss 4.7976\n", "loss 4.7975\n")       # a rounding either way
    assert not rule.same_output("loss 4.7976\n", "loss 4.7974\n")   # two units: a real change
    assert not rule.same_output("sent 723,456 B", "sent 723,457 B")  # bytes are exact
    assert not rule.same_output("42", "42.0")                         # an integer became a float
    assert not rule.same_output("rank 0 True", "rank 0 False")
    assert rule.same_output("   9.9999 ms", "  10.0000 ms")           # a column one digit wider
    assert not rule.same_output("fp32 1.0", "bf16 1.0")                # words are exact
    assert rule.too_precise("loss 4.797589, 5.5490, 1.5e-05, torch 2.13.0") == ["4.797589"]


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_no_compared_float_is_printed_beyond_the_rule(lab):
    bad = [(cell, rule.too_precise(text)) for cell, text in rule.compared_texts(lab)]
    bad = [(cell, floats) for cell, floats in bad if floats]
    assert not bad, (f"{lab.name}: cells print floats to more than {rule.MAX_SIGNIFICANT} "
                     f"significant digits, which another CPU or torch can change: {bad}. "
                     "Print fewer digits, or compare with the prediction and print True/False.")


def one_unit_off(token: str, units: int) -> str:
    """`token` changed by `units` in its last printed digit, printed the same way."""
    value = Decimal(token.replace(",", "")) + units * rule.last_digit_unit(token)
    mantissa = token.lower().partition("e")[0]
    decimals = len(mantissa.partition(".")[2])
    if "e" in token.lower():
        return f"{float(value):.{decimals}e}"
    return f"{value:.{decimals}f}"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_every_stored_float_survives_a_change_in_its_last_digit(lab):
    """What another machine's arithmetic does to a float printed under the rule: at most a
    rounding the other way. Every stored float so changed still matches; two units do not."""
    for cell, text in rule.compared_texts(lab):
        for token in rule.NUMBER.findall(text):
            if not rule.is_float(token):
                continue
            for units, matches in ((1, True), (-1, True), (2, False)):
                changed = text.replace(token, one_unit_off(token, units), 1)
                assert rule.same_output(text, changed) is matches, (lab.name, cell, token, units)


def notebook(source: str, stored: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(source, execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{stored}\n")]
    nb.cells = [cell]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    return nb


def run_nbval(*paths) -> subprocess.CompletedProcess:
    """nbval with the course's rule, as labs/conftest.py installs it for the labs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "stored_outputs", "--nbval",
                           "--nbval-current-env", "-p", "no:cacheprovider", "-q", "-rf",
                           *map(str, paths)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=paths[0].parent)


def test_nbval_under_the_rule(tmp_path):
    """One nbval session over notebooks whose stored output a reader's machine could print
    (passes) or could not (fails): a rounding the other way passes, a real change fails."""
    cases = {
        "rounding": ('print(f"{1 / 3:.4f}")', "0.3334", True),
        "changed_float": ('print(f"{1 / 3:.4f}")', "0.3336", False),
        "changed_integer": ("print(6 * 7)", "43", False),
        "no_gpu": ('import os; print(repr(os.environ.get("CUDA_VISIBLE_DEVICES")))', "''", True),
    }
    for name, (source, stored, _) in cases.items():
        nbformat.write(notebook(source, stored), tmp_path / f"{name}.ipynb")
    out = run_nbval(*(tmp_path / f"{name}.ipynb" for name in cases)).stdout
    for name, (_, _, passes) in cases.items():
        failed = f"FAILED {name}.ipynb::Cell 0" in out
        assert failed is not passes, (name, out[-3000:])
    assert "Cell outputs differ" in out
