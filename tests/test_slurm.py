"""The README's Slurm script (tools/slurm/train.sbatch) run by a real Slurm.

The test starts a one-node cluster (`slurm_cluster`), submits the script with two tasks
on that node in place of one on each of two nodes (command-line options override its
`#SBATCH` lines), and reads what the job printed: each task is one torchrun agent, and
the two agents train as nodes 0 and 1. Skipped, saying why, where Slurm is not installed
or the test is not root; CI installs Slurm and runs it as root.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import one_node_slurm, why_not
from test_multinode import running_in

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "tools" / "slurm" / "train.sbatch"

@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_the_readme_slurm_script_trains_on_two_nodes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report, output = tmp_path / "report.json", tmp_path / "job.out"
    with one_node_slurm(tmp_path / "slurm") as env:
        env.update(PORT=str(port), NPROC_PER_NODE="1", OMP_NUM_THREADS="1",
                   PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"],
                   PYTHONPATH=str(ROOT / "code"))
        done = subprocess.run(
            ["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", f"--output={output}",
             str(SCRIPT), "--strategy", "zero3", "--steps", "3", "--no-progress",
             "--json", str(report)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        printed = output.read_text() if output.exists() else ""
        assert done.returncode == 0, done.stderr + printed[-3000:]
    assert running_in(tmp_path) == []  # the job's processes ended with it
    host = socket.gethostname()
    assert "zero3 on 2 rank(s)" in printed
    assert f"rank 0: node 0 ({host}), local rank 0 of 1" in printed
    assert f"rank 1: node 1 ({host}), local rank 0 of 1" in printed
    ranks = json.loads(report.read_text())["ranks"]
    assert [(r["node"], r["local_rank"]) for r in ranks] == [(0, 0), (1, 0)]
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 3


def test_the_readme_shows_the_script_that_runs():
    readme = (ROOT / "README.md").read_text()
    assert f"```bash\n{SCRIPT.read_text()}```" in readme
