"""Two nodes on one machine: two torchrun agents (`--nnodes=2`, `--node-rank` 0 and 1,
static rendezvous on 127.0.0.1), two ranks each, running `python -m shardlab train`.

What holds across nodes: the losses equal the launcher's on 4 ranks, step for step, for
DDP, ZeRO-2, ZeRO-3 and FSDP2; every rank reports its node and local rank; a node killed
mid-run ends the other one, which names the dead node; a node count that disagrees with
torchrun's and a rendezvous nobody answers are refused in one line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.train import train_many

HERE = Path(__file__).parent
STRATEGIES = ("ddp", "zero2", "zero3", "fsdp2")
COMMON = ["--model", "gpt-tiny", "--steps", "3", "--no-memory"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(node: int, port: int, *command: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
            f"--node-rank={node}", "--nproc-per-node=2", "--master-addr=127.0.0.1",
            f"--master-port={port}", *command]


def environment() -> dict:
    code = str(HERE.parent / "code")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": code + (os.pathsep + path if path else "")}


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running_in(folder: Path) -> list[int]:
    """Processes whose working directory is `folder`: the agents and ranks of a test."""
    found = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if Path(os.readlink(cwd)) == folder:
                found.append(int(cwd.parent.name))
        except OSError:
            continue
    return found


def kill_node(agent: subprocess.Popen) -> None:
    """What a node's death does to its processes: the agent and every rank, SIGKILL."""
    for pid in [agent.pid, *descendants(agent.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Nodes:
    """Two agents started at once; whatever happens, none of their processes outlives
    the test."""

    def __init__(self, *command: str, cwd: Path):
        port = free_port()
        self.agents = [subprocess.Popen(torchrun(node, port, *command), cwd=cwd,
                                        env=environment(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
                       for node in (0, 1)]
        self.out = [bytearray(), bytearray()]
        self.err = [bytearray(), bytearray()]
        self.readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                        for agent, out, err in zip(self.agents, self.out, self.err)
                        for stream, into in ((agent.stdout, out), (agent.stderr, err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, into: bytearray) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            into.extend(chunk)

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            try:
                agent.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [agent.poll() for agent in self.agents]

    def text(self, node: int) -> str:
        return (self.out[node] + self.err[node]).decode(errors="replace")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for agent in self.agents:
            kill_node(agent)
            agent.wait()
        for reader in self.readers:
            reader.join(5)


def test_two_nodes_train_as_four_ranks_do(tmp_path):
    reports = [tmp_path / f"{s}.json" for s in STRATEGIES]
    runs = []
    for strategy, report in zip(STRATEGIES, reports):
        runs += ["--next"] * bool(runs) + ["--strategy", strategy, *COMMON,
                                           "--no-progress", "--nodes", "2",
                                           "--json", str(report)]
    # then a run that asks for 3 nodes: refused on every rank, said once on each node
    runs += ["--next", "--strategy", "ddp", *COMMON, "--nodes", "3"]
    with Nodes(str(HERE / "two_node_runs.py"), *runs, cwd=tmp_path) as nodes:
        # the reference meanwhile: the launcher's 4 ranks on this machine, one launch
        expected = launch(train_many, 4, [TrainConfig(strategy=s, world=4, model="gpt-tiny",
                                                      steps=3, measure_memory=False)
                                          for s in STRATEGIES])[0]
        codes = nodes.wait(240)
    for node in (0, 1):
        said = [l for l in nodes.text(node).splitlines() if l.startswith("error: ")]
        assert said == ["error: 3 node(s) asked, but torchrun's rendezvous has 2 "
                        "(GROUP_WORLD_SIZE=2, its --nnodes): give 2 node(s), or start "
                        "torchrun with --nnodes=3"], nodes.text(node)[-3000:]
    assert codes == [1, 1]  # torchrun's exit when a rank failed
    assert running_in(tmp_path) == []
    host = socket.gethostname()
    for strategy, report, reference in zip(STRATEGIES, reports, expected):
        ranks = json.loads(report.read_text())["ranks"]
        assert [r["losses"] for r in ranks] == [reference.losses] * 4, strategy
        assert [(r["rank"], r["node"], r["local_rank"], r["local_world"], r["host"])
                for r in ranks] == [(0, 0, 0, 2, host), (1, 0, 1, 2, host),
                                    (2, 1, 0, 2, host), (3, 1, 1, 2, host)], strategy
    # rank 0 (node 0) prints each run's table and where every rank ran; node 1 prints none
    printed = nodes.text(0)
    assert printed.count("on 4 rank(s)") == len(STRATEGIES)
    assert printed.count(f"rank 3: node 1 ({host}), local rank 1 of 2") == len(STRATEGIES)
    assert "on 4 rank(s)" not in nodes.text(1)


def test_a_node_killed_mid_run_ends_the_other_which_names_it(tmp_path):
    # rank 0 sleeps before every forward, so the run lasts long enough to be cut after
    # its first step; rank 0's progress bar (node 0's stderr) says when a step is done
    steps = 40
    with Nodes("-m", "shardlab", "train", "--strategy", "ddp", "--model", "gpt-tiny",
               "--steps", str(steps), "--no-memory", "--slow-rank", "0",
               "--slow-seconds", "0.5", cwd=tmp_path) as nodes:
        deadline = time.monotonic() + 180
        while not re.search(rf"\b[1-9]\d*/{steps}\b", nodes.err[0].decode(errors="replace")):
            assert time.monotonic() < deadline and nodes.agents[0].poll() is None, \
                nodes.text(0)[-3000:]
            time.sleep(0.1)
        killed = time.monotonic()
        kill_node(nodes.agents[1])
        codes = nodes.wait(60)
        ended = time.monotonic() - killed
        survivor = nodes.text(0)
        assert codes[0] not in (None, 0), survivor[-3000:]
    # one line from node 0 (its local rank 0) names node 1, its host and its ranks
    lines = [l for l in survivor.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(
        f"error: node 1 ({socket.gethostname()}: every rank of 2, 3) stopped answering"), \
        survivor[-3000:]
    assert ended < 60
    assert running_in(tmp_path) == []  # no agent or rank of either node is left


TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


@pytest.mark.parametrize("flags, said", [
    (["--world", "4"], "world 4 asked, but torchrun started 2 ranks (WORLD_SIZE=2"),
    (["--nodes", "2"], "2 node(s) asked, but torchrun's rendezvous has 1 (GROUP_WORLD_SIZE=1"),
])
def test_numbers_that_disagree_with_torchruns_are_refused_in_one_line(
        flags, said, monkeypatch, capsys):
    # torchrun's environment for the 2 ranks of one node, its store standing in for the
    # agent's: the refusal comes before any process group is made, said by the first
    # rank of the node to reach it
    import torch.distributed as dist
    from shardlab.cli import main
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for key, value in {**TORCHRUN_ENV, "MASTER_PORT": str(store.port)}.items():
        monkeypatch.setenv(key, value)
    argv = ["--strategy", "ddp", "--steps", "1", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: " + said), err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(argv) == 2
    assert capsys.readouterr().err == ""  # said once on the node
    assert not dist.is_initialized()


def test_nodes_without_torchrun_are_refused(capsys):
    from shardlab.cli import main
    assert main(["--strategy", "ddp", "--world", "2", "--nodes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --nodes 2 needs one torchrun agent per node"), err


def test_a_rendezvous_nobody_answers_is_named_after_the_timeout(capsys):
    from shardlab.__main__ import main
    port = free_port()  # closed: nobody listens there
    assert main(["rendezvous", f"127.0.0.1:{port}", "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"error: nobody answers at 127.0.0.1:{port} after 1 s (Connection refused)"), err
    with socket.socket() as listening:  # once node 0's agent listens, it returns at once
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert main(["rendezvous", f"127.0.0.1:{listening.getsockname()[1]}"]) == 0
    assert main(["rendezvous", "nowhere"]) == 2
    assert "must be HOST:PORT" in capsys.readouterr().err
