"""Run one function of the package on N ranks and collect what each rank returns.

A notebook cannot host a multi-process job by itself: the ranks must be separate
processes, started with the *spawn* method (fork would copy the kernel's threads and
sockets), and spawned processes can only run a function they can import. So the workers
live in `shardlab`, and `launch` starts them:

    >>> from shardlab.launch import launch
    >>> from shardlab.demo import whoami
    >>> launch(whoami, world=4)          # one value per rank, in rank order

What `launch` promises, because a stuck or half-dead job is the worst thing a lab can do:

* the rendezvous is a `TCPStore` that *this* process opens on 127.0.0.1 with a port the
  kernel picks (port 0), so two launches at once never fight over a port;
* a rank that raises ends the launch: the other ranks are stopped and the caller gets one
  `RankFailed` that names the rank and carries its traceback;
* a rank that hangs is stopped by the timeout, which names the ranks still running;
* Ctrl-C stops every rank; a rank whose parent dies is killed by the kernel (PDEATHSIG);
* whatever happens, no process of the launch outlives the call;
* what the ranks print is shown after they finish, grouped by rank, in rank order, so a
  notebook's stored output is the same on every run.

Under `torchrun` there is nothing to spawn: `launch` runs the function in this process
with the environment's rank and world size, and returns every rank's value (gathered).
"""

from __future__ import annotations

import ctypes
import datetime
import importlib
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = 300.0
BACKENDS = ("auto", "gloo", "nccl")


class LaunchError(RuntimeError):
    """A launch that could not start, or whose ranks did not all finish."""


class RankFailed(LaunchError):
    """One rank raised; `rank` names it and `rank_traceback` is its traceback."""

    def __init__(self, rank: int, rank_traceback: str):
        self.rank = rank
        self.rank_traceback = rank_traceback
        super().__init__(f"rank {rank} failed; the other ranks were stopped.\n"
                         f"--- traceback of rank {rank} ---\n{rank_traceback}")


class LaunchTimeout(LaunchError):
    """The timeout passed while some ranks were still running."""

    def __init__(self, timeout: float, unfinished: list[int]):
        self.unfinished = unfinished
        super().__init__(f"timed out after {timeout:g} s; ranks {unfinished} had not finished "
                         f"and were stopped. Raise `timeout=` if the job is just slow, or look "
                         f"for a collective that only some ranks call.")


# ----------------------------------------------------------------------------- checks


def resolve_backend(backend: str, world: int) -> str:
    """Turn "auto" into "nccl" (one GPU per rank) or "gloo", and refuse what cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus >= world and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise LaunchError("backend 'nccl' is not available in this build of torch; "
                              "use backend='gloo' (CPU) or 'auto'")
        if gpus < world:
            raise LaunchError(f"backend 'nccl' needs one GPU per rank: world={world} but "
                              f"{gpus} CUDA device(s) are visible; use backend='gloo' or "
                              f"'auto', or a world size of at most {gpus}")
    if backend == "gloo" and not dist.is_gloo_available():
        raise LaunchError("backend 'gloo' is not available in this build of torch")
    return backend


def check_importable(fn: Callable) -> None:
    """Refuse a function that a spawned child could not import, before starting any."""
    if not callable(fn):
        raise TypeError(f"launch needs a function, got {type(fn).__name__}")
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    how_to_fix = ("Put the function in a module (the course's workers are in `shardlab`; "
                  "your own can go in a .py file beside the notebook) and import it.")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise LaunchError(f"{qualname!r} is a lambda or a nested function, which a child "
                          f"process cannot import. {how_to_fix}")
    if module_name == "__main__" and not getattr(sys.modules["__main__"], "__file__", None):
        raise LaunchError(f"{qualname!r} was defined in a notebook cell or an interactive "
                          f"session, which a child process cannot import. {how_to_fix}")
    if module_name not in (None, "__main__"):
        try:
            target: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as exc:
            raise LaunchError(f"cannot import {module_name}.{qualname} ({exc}). "
                              f"{how_to_fix}") from None


def _check_world(world: Any) -> int:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a whole number of ranks >= 1, got {world!r}")
    return world


# ----------------------------------------------------------------------------- torchrun


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def _run_in_this_process(fn, world, args, kwargs, backend):
    env_world = int(os.environ["WORLD_SIZE"])
    if world is not None and world != env_world:
        raise LaunchError(f"launched with world={world} under torchrun, whose WORLD_SIZE is "
                          f"{env_world}; pass world=None or the same number")
    backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", env_world)))
    created = not dist.is_initialized()
    if created:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, init_method="env://")
    try:
        result = fn(*args, **kwargs)
        gathered: list[Any] = [None] * env_world
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        if created:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- the child


def rank_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _die_with_parent() -> None:
    # If the notebook kernel is killed, its ranks must not linger holding ports and cores.
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except OSError:
            pass


def _child_main(rank: int, world: int, backend: str, port: int, fn: Callable, args: tuple,
                kwargs: dict, run_dir: str, threads: int, timeout: float) -> None:
    _die_with_parent()
    out_dir = Path(run_dir)
    # Redirect the file descriptors, not just sys.stdout, so that prints from C++ (gloo,
    # NCCL) are captured with the rank's own output instead of lost or interleaved.
    for fd, name in ((1, "out"), (2, "err")):
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        f = open(out_dir / f"rank{rank}.{name}", "wb", buffering=0)
        os.dup2(f.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, world + 1, False,
                              datetime.timedelta(seconds=timeout))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(*args, **kwargs)
        tmp = out_dir / f"rank{rank}.result.tmp"
        tmp.write_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        tmp.rename(out_dir / f"rank{rank}.result")
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        (out_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit handlers that could block on a dead peer
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is on disk. Leave without the interpreter's teardown: destructors of
    # backend threads still winding down can abort() a healthy rank at exit.
    os._exit(0)


# ----------------------------------------------------------------------------- the parent


@dataclass
class _Rank:
    rank: int
    process: Any


def _stop(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.process.is_alive():
            r.process.terminate()
    for r in ranks:
        r.process.join(timeout=3)
        if r.process.is_alive():
            r.process.kill()
            r.process.join()


def _print_outputs(run_dir: Path, world: int, prefix: bool) -> None:
    for rank in range(world):
        for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
            path = run_dir / f"rank{rank}.{name}"
            if not path.exists():
                continue
            text = path.read_text(errors="replace")
            for line in text.splitlines():
                stream.write(f"[rank {rank}] {line}\n" if prefix else f"{line}\n")
    sys.stdout.flush()
    sys.stderr.flush()


def launch(fn: Callable, world: int | None, *args: Any, backend: str = "auto",
           timeout: float = DEFAULT_TIMEOUT, threads: int = 1, prefix: bool = True,
           **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world` ranks; return the ranks' results in rank order.

    backend: "auto" (NCCL when there is a GPU per rank, gloo otherwise), "gloo" or "nccl".
    timeout: seconds for the whole launch; on expiry every rank is stopped.
    threads: intra-op threads per rank; 1 keeps N ranks from fighting over a few cores.
    prefix: prefix each printed line with its rank ("[rank 2] ...").
    """
    check_importable(fn)
    if under_torchrun():
        return _run_in_this_process(fn, world, args, kwargs, backend)
    world = _check_world(world)
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    backend = resolve_backend(backend, world)
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as exc:  # noqa: BLE001
        raise LaunchError(f"the function or its arguments cannot be sent to a child "
                          f"process: {exc}") from None

    ctx = get_context("spawn")
    # The parent owns the rendezvous; port 0 lets the OS choose a free port atomically.
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True,
                          datetime.timedelta(seconds=timeout), wait_for_workers=False)
    ranks: list[_Rank] = []
    with tempfile.TemporaryDirectory(prefix="shardlab-launch-") as tmp:
        run_dir = Path(tmp)
        try:
            for rank in range(world):
                p = ctx.Process(target=_child_main, name=f"shardlab-rank{rank}",
                                args=(rank, world, backend, store.port, fn, args, kwargs,
                                      tmp, threads, timeout), daemon=True)
                p.start()
                ranks.append(_Rank(rank, p))
            _wait_all(ranks, run_dir, timeout)
        finally:
            _stop(ranks)
            _print_outputs(run_dir, world, prefix)
            del store
        return [pickle.loads((run_dir / f"rank{r}.result").read_bytes()) for r in range(world)]


def _wait_all(ranks: list[_Rank], run_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = {r.process.sentinel: r for r in ranks}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LaunchTimeout(timeout, sorted(r.rank for r in pending.values()))
        for sentinel in wait(list(pending), timeout=min(remaining, 1.0)):
            r = pending.pop(sentinel)
            r.process.join()
            if r.process.exitcode == 0 and (run_dir / f"rank{r.rank}.result").exists():
                continue
            # When one rank raises, its peers soon fail too (their collectives lose a
            # peer); the first error written is the cause, the others are echoes.
            errors = sorted(run_dir.glob("rank*.error"), key=lambda p: p.stat().st_mtime_ns)
            if errors:
                first = errors[0]
                raise RankFailed(int(first.name[4:-6]), first.read_text())
            raise RankFailed(r.rank, f"the process exited with code {r.process.exitcode} "
                                     f"without a result (killed, or out of memory?)")
