"""The labs are checked by nbval against their stored outputs, strictly: a stored number
that the code no longer prints fails the test run (not `--nbval-lax`)."""

import subprocess
import sys

import nbformat


def notebook_printing(stored: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(6 * 7)", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{stored}\n")]
    nb.cells = [cell]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    return nb


def run_nbval(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env",
                           "-p", "no:cacheprovider", "-q", str(path)],
                          capture_output=True, text=True, timeout=300)


def test_a_changed_stored_number_fails_nbval(tmp_path):
    good, bad = tmp_path / "good.ipynb", tmp_path / "bad.ipynb"
    nbformat.write(notebook_printing("42"), good)
    nbformat.write(notebook_printing("43"), bad)
    assert run_nbval(good).returncode == 0
    failed = run_nbval(bad)
    assert failed.returncode == 1 and "Cell outputs differ" in failed.stdout
