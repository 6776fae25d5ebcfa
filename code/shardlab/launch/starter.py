"""How the ranks are started: forked from a clean fork server that has imported torch once.

A rank started with the *spawn* method is a fresh interpreter that imports torch and the
package before it can run anything: about 2 to 3 seconds of CPU per rank, so a 4-rank launch
on a 2-core laptop spends 6 seconds or more just importing, every time. A *fork* of the
launching process would be instant but would copy its threads and sockets (a notebook
kernel's, torch's thread pools), which is not safe.

The fork server is the middle way multiprocessing offers: a clean process, started once per
launching process, that imports torch and the package (and nothing else: it runs no torch
operation, so it has no thread pool to copy) and then forks a rank on demand in
milliseconds. It ends by itself when the launching process ends.

Its environment is the launching process's at the moment it started. A launch made after
the environment changed (a variable set for one run: `TORCH_DISTRIBUTED_DEBUG`,
`CUDA_VISIBLE_DEVICES`, ...) is spawned instead, so every rank always sees the environment
of the launch that started it. The working directory and `sys.path` are the launch's too:
`launch` hands them to each rank, which applies them before it loads its function.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import BaseContext

# What the fork server imports once: the launching script (as a spawned child would, so
# that a function defined in it can be found), torch, and the package's training loop.
PRELOAD = ["__main__", "torch", "torch.distributed", "shardlab.train"]
# Set by pytest around every test: not part of what a rank should see.
VOLATILE = {"PYTEST_CURRENT_TEST"}

_server_environment: dict[str, str] | None = None


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in VOLATILE}


def rank_context() -> BaseContext:
    """The multiprocessing context that starts this launch's ranks."""
    global _server_environment
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")  # Windows
    now = _environment()
    if _server_environment is None:
        # the fork server starts with the first rank of this launch, from this environment
        _server_environment = now
    elif now != _server_environment:
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context
