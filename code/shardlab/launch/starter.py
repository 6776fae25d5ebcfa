"""How the ranks are started: forked from a clean fork server that has imported torch once.

A rank started with the *spawn* method is a fresh interpreter that imports torch and the
package before it can run anything: about 2 to 3 seconds of CPU per rank, so a 4-rank launch
on a 2-core laptop spends 6 seconds or more just importing, every time. A *fork* of the
launching process would be instant but would copy its threads and sockets (a notebook
kernel's, torch's thread pools), which is not safe.

The fork server is the middle way multiprocessing offers: a clean process, started once per
launching process, that imports torch and the package (and nothing else: it runs no torch
operation, so it has no thread pool to copy) and then forks a rank on demand in
milliseconds. It ends by itself when the launching process ends, and then removes the
folder multiprocessing made for its socket (`in_forkserver`); if the launching process is
killed during a launch, the launch's reaper ends it at once and removes the folder
(`socket_folder` tells it where), rather than when the server has finished its imports.

Its environment is the launching process's at the moment it started, and some variables
are read when torch is imported. So a launch made after the environment changed (a
variable set for one run: `TORCH_DISTRIBUTED_DEBUG`, `CUDA_VISIBLE_DEVICES`, ...) first
replaces the server with one started from the new environment: every rank sees the
environment of the launch that started it, and a variable that stays changed costs one
restart, not a spawned launch ever after. While another launch's ranks still run on the
old server (two launches from two threads), the new launch is spawned instead. The working
directory and `sys.path` are the launch's too: `launch` hands them to each rank, which
applies them before it loads its function.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from multiprocessing.context import BaseContext
from typing import Iterator

# What the fork server imports once: how it ends, the launching script (as a spawned child
# would, so that a function defined in it can be found; multiprocessing imports it first),
# torch, and the package's training loop.
PRELOAD = ["shardlab.launch.in_forkserver", "__main__", "torch", "torch.distributed",
           "shardlab.train"]
# Set by pytest around every test: not part of what a rank should see.
VOLATILE = {"PYTEST_CURRENT_TEST"}

_server_environment: dict[str, str] | None = None
_live_launches = 0  # launches whose ranks were forked by the running server
_lock = threading.Lock()


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in VOLATILE}


def _stop_server() -> bool:
    """Stop this process's fork server, so that the next rank starts a new one; False
    where this Python offers no way to. (`_stop` is the method multiprocessing's own tests
    use; it waits for the server to exit.) A SIGTERM first: a server that ends by its
    pipe removes the folder of its socket (`in_forkserver`), where the next one goes."""
    from multiprocessing import forkserver
    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is None:
        return False
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    stop()
    return True


@contextlib.contextmanager
def rank_context() -> Iterator[BaseContext]:
    """The multiprocessing context that starts this launch's ranks, held while they run."""
    global _server_environment, _live_launches
    if "forkserver" not in multiprocessing.get_all_start_methods():
        yield multiprocessing.get_context("spawn")  # Windows
        return
    now = _environment()
    with _lock:
        if _server_environment is not None and now != _server_environment \
                and not _live_launches and _stop_server():
            _server_environment = None
        forked = _server_environment is None or now == _server_environment
        if forked:
            # the fork server starts with the first rank of this launch, from this environment
            _server_environment = now
            _live_launches += 1
    if not forked:
        yield multiprocessing.get_context("spawn")
        return
    try:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        yield context
    finally:
        with _lock:
            _live_launches -= 1


def socket_folder(context: BaseContext) -> str | None:
    """The folder multiprocessing keeps the fork server's socket in (this process's
    `pymp-*`, made now if it is not yet), for the reaper to remove if this process is
    killed; None for a context that spawns."""
    if context.get_start_method() != "forkserver":
        return None
    from multiprocessing import util
    return util.get_temp_dir()
