"""Workers for the launcher's tests: they must live in an importable module."""

import ctypes
import os
import signal
import time

import subprocess
import sys

import torch
import torch.distributed as dist

from shardlab.launch import rank_device


def rank_times_ten() -> int:
    t = torch.tensor([float(dist.get_rank())], device=rank_device())
    dist.all_reduce(t)  # proves the ranks really talk to each other
    return dist.get_rank() * 10 + int(t.item()) * 0



def starter_and_variable(name: str) -> tuple[int, str | None]:
    """The process that started this rank (a fork server, or the launching process when
    spawned), and what this rank sees of variable `name`."""
    return os.getppid(), os.environ.get(name)

def rank_and_sum_of_ranks() -> tuple[int, float]:
    return dist.get_rank() * 10, sum_of_ranks()


def sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def fail_on(rank: int) -> int:
    if dist.get_rank() == rank:
        raise ValueError(f"boom from rank {rank}")
    t = torch.ones(1)
    dist.all_reduce(t)  # the healthy ranks block here until they are stopped
    return dist.get_rank()


def chatty(lines: int) -> int:
    for i in range(lines):
        print(f"line {i} of rank {dist.get_rank()}")
    return os.getpid()


def hang_after_marking(marker_dir: str) -> int:
    """Write a marker (so a test knows the ranks are up), then hang."""
    open(os.path.join(marker_dir, f"up{dist.get_rank()}"), "w").close()
    time.sleep(3600)
    return dist.get_rank()


def start_a_child_then(action: str, pid_dir: str) -> int:
    """Start a long `sleep` (a child of this rank), note its pid, then raise or hang."""
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(pid_dir, f"child{dist.get_rank()}"), "w") as f:
        f.write(str(child.pid))
    if action == "raise":
        raise RuntimeError("this rank started a child, then failed")
    time.sleep(3600)
    return dist.get_rank()


class Scaled:
    """A callable object (not a function): its class is what a rank imports."""

    def __init__(self, factor: int):
        self.factor = factor

    def __call__(self, offset: int = 0) -> int:
        return dist.get_rank() * self.factor + offset

    def plus(self, offset: int) -> int:
        """A bound method: it travels as the object and the method's name."""
        return dist.get_rank() * self.factor + offset


def launch_descendants(root: int) -> list[int]:
    """Live processes descended from `root` (zombies excluded), leaving out multiprocessing's
    resource tracker and fork server, which one process shares across its launches (the
    ranks a fork server forked are counted)."""
    from pathlib import Path

    children: dict[int, list[tuple[int, bool]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if fields[0] == "Z":
            continue
        shared = b"resource_tracker" in cmdline or b"multiprocessing.forkserver" in cmdline
        children.setdefault(int(fields[1]), []).append((int(stat.parent.name), shared))
    found, frontier = [], [root]
    while frontier:
        for pid, shared in children.get(frontier.pop(), []):
            frontier.append(pid)
            if not shared:
                found.append(pid)
    return found


def end_silently_while_the_peer_fails(how: str) -> int:
    """Rank 1 loads every core, then ends without a word (killed by SIGKILL, crashed in
    native code by SIGSEGV, or `os._exit(3)`), and rank 0's next collective fails because
    of it, writing an error.
    Before it ends, rank 1 leaves a child holding its descriptors (its sockets closed, so
    that rank 0 sees them close): a spawned rank's end then reaches the launcher only when
    that child ends, after rank 0's error, which is what a busy machine does by chance. A
    rank forked by the fork server is reported by the server, in whatever order the
    load gives."""
    t = torch.ones(1)
    dist.all_reduce(t)  # both ranks are up
    if dist.get_rank() == 1:
        for _ in range(os.cpu_count() or 2):  # a busy machine, ended with this rank's group
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
        if os.fork() == 0:
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                        os.close(int(fd))  # the peer must see this rank's sockets close
                except OSError:
                    pass
            time.sleep(60)  # ended with this rank's process group by the launcher
            os._exit(0)
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            ctypes.string_at(0)  # reads address 0, as a crash inside a C++ library does
        os._exit(3)
    dist.all_reduce(t)  # fails: the peer is gone
    return 0


def one_all_reduce_more_on(rank: int) -> int:
    """Two all-reduces of 6 floats on every rank, and a third on `rank` alone: it waits in
    it until the launch's timeout."""
    t = torch.ones(6)
    for _ in range(3 if dist.get_rank() == rank else 2):
        dist.all_reduce(t)
    return dist.get_rank()
