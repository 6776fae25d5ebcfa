"""A function written in a notebook cell launches on N ranks: a real kernel runs the cells.

The ranks cannot import a cell, so the function travels by value (shardlab.launch.carry).
One kernel: a launch on 4 ranks, as a reader's exercise does, and one that fails on rank 1,
which must come back as that rank's traceback. When the kernel is shut down, nothing of it
remains in its temporary folder (the fork server's socket folder went with the server)."""

import os
import shutil
import tempfile
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

CELL = """
import torch
import torch.distributed as dist
from shardlab.launch import launch

SCALE = 10          # a global of the notebook, carried with the function

def my_worker(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank() * SCALE + offset, t.item()

print(launch(my_worker, 4, 1))
"""

FAILING = """
from shardlab.launch import RankFailed

def breaks_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()

try:
    launch(breaks_on_rank_1, 2, timeout=60)
except RankFailed as failed:
    print("rank", failed.rank, "|", failed.rank_traceback.strip().splitlines()[-1])
"""


@pytest.mark.timeout(240)
def test_a_function_defined_in_a_notebook_cell_launches_on_4_ranks_or_names_its_failing_rank(
        tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL),
                                         nbformat.v4.new_code_cell(FAILING)])
    # the kernel's temporary files, none of which must remain (a short path: the fork
    # server's socket goes under it, and a socket's path is limited to 107 bytes)
    kernel_tmp = Path(tempfile.mkdtemp(prefix="sl-"))
    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "TMPDIR")}
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU, like the labs under nbval
    os.environ["TMPDIR"] = str(kernel_tmp)
    try:
        NotebookClient(nb, timeout=200, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    printed = ["".join(o.get("text", "") for o in cell.outputs) for cell in nb.cells]
    assert printed[0].strip() == "[(1, 6.0), (11, 6.0), (21, 6.0), (31, 6.0)]", printed
    assert printed[1].strip() == "rank 1 | ValueError: rank one is broken", printed
    # the kernel is gone; its fork server follows it and removes the folder of its socket
    deadline = time.monotonic() + 10
    while list(kernel_tmp.glob("pymp-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = list(kernel_tmp.glob("pymp-*"))
    shutil.rmtree(kernel_tmp, ignore_errors=True)
    assert left == []
