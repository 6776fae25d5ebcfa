"""Process hygiene: no process of a launch outlives it, whatever happens to the launcher.

Stopping the ranks and whatever they started (`stop_ranks`), a reaper process that kills
them if the launching process is killed, even by SIGKILL, a watchdog in each rank that
ends it when its parent is gone (`die_with_parent`), SIGTERM unwound like Ctrl-C, and the
run folders of dead launches removed. The hard-won part of the launcher, kept apart so
that `launch` itself reads as start, wait, collect.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


RUN_DIR_PREFIX = "shardlab-launch-"
OWNER = "owner.pid"


@dataclass
class RankProcess:
    rank: int
    process: Any


def stop_ranks(ranks: list[RankProcess]) -> None:
    """End every rank, and every process a rank started (its process group)."""
    for r in ranks:
        if r.process.is_alive():
            r.process.terminate()
    for r in ranks:
        r.process.join(timeout=3)
        if r.process.is_alive():
            r.process.kill()
            r.process.join()
    for r in ranks:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(r.process.pid, signal.SIGKILL)


def end_group() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)  # this rank and everything it started


def die_with_parent(parent: int) -> None:
    """If the launching process dies (a killed notebook kernel, kill -9 of a script), this
    rank and every process it started end too, instead of lingering on ports and cores.

    The rank leads a process group of its own, so that one signal reaches whatever it
    started; a watchdog thread ends the group as soon as the launching process is gone, or
    the process that started this rank is (the launching process itself, or its fork
    server, which ends with it). The launching process may already be gone when this runs
    (it died while the rank was starting): then the rank ends at once."""
    os.setsid()
    starter = os.getppid()

    def orphaned() -> bool:
        return os.getppid() != starter or not pid_alive(parent)

    if orphaned():
        end_group()

    def watch() -> None:
        while True:
            time.sleep(0.2)
            if orphaned():
                end_group()

    threading.Thread(target=watch, name="shardlab-watch-parent", daemon=True).start()


# The reaper: a process without torch (it starts in milliseconds), started before any rank,
# that holds the read end of a pipe from the launching process. It is given the run folder
# as its argument and learns each rank's pid as the rank starts ("rank PID") and, before
# the fork server starts, the folder of its socket ("folder PATH"); if the pipe ends
# without "done" (the launching process was killed, even by SIGKILL), it kills every rank
# and the process group each rank leads, then the fork server (found as the process that
# holds the socket: its pid may never have reached the reaper), and removes the folders,
# which nobody else would remove until the next launch (and the socket's folder,
# multiprocessing's `pymp-*`, not even then). A rank's own watchdog (`die_with_parent`)
# only starts once the rank has imported torch and the launching script, and the server
# only watches its parent once it has imported them too: seconds on a busy machine
# (measured: a server left importing for 24 s on a loaded 2-core machine). The reaper
# covers those seconds.
_REAPER = """
import os, shutil, signal, sys

def kill(pid, group=False):
    for end in (os.kill, os.killpg) if group else (os.kill,):
        try:
            end(pid, signal.SIGKILL)
        except OSError:
            pass

def listening_in(folder):
    # the processes holding a unix socket bound in `folder` (Linux: /proc)
    try:
        with open("/proc/net/unix") as table:
            sockets = {f"socket:[{row.split()[6]}]" for row in table
                       if row.split()[7:8] and row.split()[7].startswith(folder + "/")}
    except (OSError, IndexError):
        return []
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")) if sockets else ():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in sockets for fd in fds):
                found.append(int(pid))
        except OSError:
            pass
    return found

ranks, folders, socket_folders = [], sys.argv[1:], []
for line in sys.stdin.buffer:
    if not line.endswith(b"\\n"):
        break  # cut short by the launching process's death: not an order
    kind, _, value = line.decode().strip().partition(" ")
    if kind == "done":
        sys.exit(0)
    if kind == "rank":
        ranks.append(int(value))
    elif kind == "folder":
        folders.append(value)
        socket_folders.append(value)
for pid in ranks:  # a rank leads a process group: whatever it started goes with it
    kill(pid, group=True)
for folder in socket_folders:
    for pid in listening_in(folder):
        kill(pid)
for folder in folders:  # the processes are gone: nothing writes there any more
    shutil.rmtree(folder, ignore_errors=True)
"""


# Folders of the launching process that a reaper removes with the run folder (the
# training loop's progress file, say): see `reaped_with_launches`.
_ALSO_REAPED: list[str] = []


@contextlib.contextmanager
def reaped_with_launches(folder: str | os.PathLike):
    """A folder of this process that the reaper of any launch started inside the block
    removes too, if this process is killed."""
    _ALSO_REAPED.append(os.fspath(folder))
    try:
        yield
    finally:
        _ALSO_REAPED.remove(os.fspath(folder))


def start_reaper(run_dir: str | os.PathLike | None = None) -> subprocess.Popen | None:
    """The reaper of a launch whose run folder is `run_dir`."""
    folders = ([os.fspath(run_dir)] if run_dir is not None else []) + _ALSO_REAPED
    try:  # its own session: a Ctrl-C meant for the launch does not reach it
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, *folders],
                                stdin=subprocess.PIPE, bufsize=0, start_new_session=True)
    except OSError:
        return None  # the ranks' watchdogs still end them


def tell_reaper(reaper: subprocess.Popen | None, line: str) -> None:
    """"rank PID", "folder PATH" (the fork server's socket's), or "done"."""
    if reaper is None:
        return
    with contextlib.suppress(OSError):  # a reaper that is gone has nothing left to do
        reaper.stdin.write(line.encode() + b"\n")


def dismiss_reaper(reaper: subprocess.Popen | None) -> None:
    if reaper is None:
        return
    tell_reaper(reaper, "done")
    with contextlib.suppress(OSError):
        reaper.stdin.close()
    try:
        reaper.wait(timeout=10)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a running process: a zombie (dead, not yet reaped by its own
    parent) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): a signal that reaches it is all we can know


def reclaim_run_dirs(tmp_root: str | None = None) -> list[Path]:
    """Remove the run folders of launches whose launching process is dead (killed before
    it could clean up): each folder names its owner in `owner.pid`."""
    removed = []
    for folder in Path(tmp_root or tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        try:
            owner = int((folder / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours to judge (or being created right now)
        if not pid_alive(owner):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@contextlib.contextmanager
def terminate_as_exit():
    """SIGTERM to the launching process (a job scheduler, `kill`) unwinds like Ctrl-C, so
    the ranks are stopped and the run folder removed; only SIGKILL leaves work to the
    reaper, the ranks' watchdogs and (if even the reaper was killed) the next launch's
    `reclaim_run_dirs`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
