"""The README as a newcomer reads it: the first five minutes' commands (all but the
installs) and the own-model example, run as they are written (and lab 9's copy of it)."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FIVE_MINUTES = 300  # the section's promise: its commands run within it on 2 cores


def code_blocks(section: str, language: str) -> list[str]:
    """The `language` code blocks of the README's section titled `section`."""
    text = README.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def first_five_minutes() -> list[str]:
    [block] = code_blocks("The first five minutes", "bash")
    return [line.split("#", 1)[0].strip() for line in block.splitlines()
            if line.startswith(("python -m shardlab", "jupyter"))]


def test_the_first_five_minutes_run_as_written(tmp_path):
    """The training command as the README gives it; JupyterLab's command headless (its
    version: opening the lab itself needs a browser)."""
    train, lab = first_five_minutes()
    assert train == "python -m shardlab train --strategy zero3 --world 2 --steps 5"
    assert lab == "jupyter lab labs/01-collectives.ipynb"
    done = subprocess.run([sys.executable, *train.split()[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=FIVE_MINUTES)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "zero3 on 2 rank(s)" in done.stdout and "units: 3 units: 2 x Block" in done.stdout
    jupyter = shutil.which("jupyter-lab", path=str(Path(sys.executable).parent))
    if jupyter is None:
        pytest.skip("JupyterLab is not installed here (requirements.txt installs it)")
    version = subprocess.run([jupyter, "--version"], capture_output=True, text=True,
                             timeout=FIVE_MINUTES)
    assert version.returncode == 0 and int(version.stdout.split(".")[0]) >= 4


def own_model() -> str:
    """The README's "Your own model" example."""
    [block] = [b for b in code_blocks("Running the labs", "python") if "nn.Sequential" in b]
    return block


def test_lab_9_opens_with_the_own_model_example_as_the_readme_gives_it():
    """The same code, so that the two cannot drift apart; its output is not compared by
    nbval (losses to five decimals), the test below runs the README's copy."""
    cells = json.loads((ROOT / "labs" / "09-your-own-model.ipynb").read_text())["cells"]
    [cell] = [c for c in cells
              if c["cell_type"] == "code" and "nn.Sequential" in "".join(c["source"])]
    assert "".join(cell["source"]).rstrip("\n") == own_model().rstrip("\n")
    assert "nbval-ignore-output" in cell["metadata"].get("tags", [])


def test_the_own_model_example_trains_alike_under_every_strategy_it_names(tmp_path):
    block = own_model()
    script = tmp_path / "own_model.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    losses = {strategy: ast.literal_eval(values) for strategy, values in printed.items()}
    assert set(losses) == {"ddp", "zero3", "fsdp2"}
    for strategy in ("zero3", "fsdp2"):
        assert len(losses[strategy]) == 5
        assert max(abs(a - b) for a, b in zip(losses[strategy], losses["ddp"])) <= 2e-5
    # and "auto" made the units the README says it made
    from torch import nn
    from shardlab.wrap import describe
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 64))
    assert "nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64)" \
        in block
    said = re.search(r"says `(\d+ units: [^`]*)`", README)[1]
    assert describe(model, "auto").startswith(said)
