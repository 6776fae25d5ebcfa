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
* Ctrl-C stops every rank; if the launching process is killed (even by SIGKILL), a
  small reaper process it started first kills the ranks at once, and each rank's own
  watchdog ends it too once it is running;
* whatever happens, no process of the launch outlives the call;
* what the ranks print is shown after they finish, grouped by rank, in rank order, so a
  notebook's stored output is the same on every run.

Under `torchrun` there is nothing to spawn: `launch` runs the function in this process
with the environment's rank and world size, and returns every rank's value (gathered).
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import functools
import importlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
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


DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a launch run: the backend, the device type, and in words."""

    backend: str     # "nccl" or "gloo"
    device: str      # "cuda" or "cpu"
    description: str


def choose_placement(backend: str, device: str, world: int, gpus: int,
                     nccl_available: bool = True) -> Placement:
    """The three ways to place ranks, and the refusals, as a pure function:

    * NCCL, one GPU per rank, when there are at least as many GPUs as ranks;
    * gloo with CUDA tensors, the ranks sharing the GPUs round-robin (rank r on GPU
      r mod G), when there are GPUs but fewer than ranks: NCCL refuses two ranks on one
      GPU, gloo does not, and each rank's allocator then measures its own CUDA memory;
    * gloo on the CPU when there is no GPU (or when asked with device="cpu").
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; use one of {DEVICES}")
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device == "cuda" and not gpus:
        raise LaunchError("device 'cuda' needs a GPU, and torch sees none here; use "
                          "device='cpu' (or 'auto')")
    if backend == "auto":
        backend = "nccl" if device == "cuda" and gpus >= world and nccl_available else "gloo"
    if backend == "nccl":
        if not nccl_available:
            raise LaunchError("backend 'nccl' is not available in this build of torch; use "
                              "backend='gloo' (or 'auto')")
        if device == "cpu":
            raise LaunchError("backend 'nccl' runs on GPUs only; use backend='gloo' for the "
                              "CPU")
        if gpus < world:
            raise LaunchError(f"backend 'nccl' needs one GPU per rank: world={world} but "
                              f"{gpus} GPU(s) are visible; use backend='gloo' (ranks share "
                              f"the GPUs) or 'auto', or at most {gpus} ranks")
        return Placement("nccl", "cuda", f"nccl: {world} rank(s), one GPU each")
    if device == "cuda":
        return Placement("gloo", "cuda", f"gloo: {world} rank(s) sharing {min(gpus, world)} "
                                         f"GPU(s), CUDA tensors")
    return Placement("gloo", "cpu", f"gloo: {world} rank(s) on the CPU")


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world: int, device: str = "auto") -> str:
    """The backend a launch of `world` ranks uses here (see `choose_placement`)."""
    return choose_placement(backend, device, world, visible_gpus(),
                            dist.is_nccl_available()).backend


def check_importable(fn: Callable) -> None:
    """Refuse a function that a spawned child could not import, before starting any.
    A `functools.partial` is checked through the function it wraps, a bound method through
    its function; a callable object must be picklable (its class importable), which
    `launch` checks next."""
    if not callable(fn):
        raise LaunchError(f"launch needs a function, got a {type(fn).__name__}")
    while isinstance(fn, (functools.partial, types.MethodType)):
        # a bound method travels as its object and its name: its function is what the
        # child imports (the object is checked by pickling, next)
        fn = fn.func if isinstance(fn, functools.partial) else fn.__func__
    if not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
        fn = type(fn)  # a callable object: its class is what the child imports
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


def check_main_guard() -> None:
    """Refuse a launch from a script's top level without `if __name__ == "__main__":`.

    A spawned child imports the launching script again to find the function; without the
    guard it would run the script, launch again, and every child would fail with
    multiprocessing's bootstrapping error. Found here, in the parent, by reading the
    script: the line of its top-level code that led to this launch must sit inside an
    `if __name__ == "__main__":` block."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_globals.get("__name__") == "__main__"):
        frame = frame.f_back
    if frame is None:
        return  # not reached from the script's top level (the script is not __main__)
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and \
                node.lineno <= line <= (node.end_lineno or node.lineno):
            return
    raise LaunchError(f"{Path(path).name} calls launch() (line {line}) outside an "
                      f'`if __name__ == "__main__":` block: each rank imports the script '
                      f"again and would run it too. Put the script's top-level code under "
                      f"that guard.")


def _is_main_test(test: ast.expr) -> bool:
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    strings = {n.value for n in ast.walk(test) if isinstance(n, ast.Constant)}
    return "__name__" in names and "__main__" in strings


def _check_world(world: Any) -> int:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a whole number of ranks >= 1, got {world!r}")
    return world


def _check_threads(threads: Any) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a whole number >= 1 (intra-op threads per rank), "
                         f"got {threads!r}")
    return threads


# ----------------------------------------------------------------------------- torchrun


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def _run_in_this_process(fn, world, args, kwargs, backend, device):
    env_world = int(os.environ["WORLD_SIZE"])
    if world is not None and world != env_world:
        raise LaunchError(f"launched with world={world} under torchrun, whose WORLD_SIZE is "
                          f"{env_world}; pass world=None or the same number")
    local_rank = int(os.environ["LOCAL_RANK"])
    placement = choose_placement(backend, device,
                                 int(os.environ.get("LOCAL_WORLD_SIZE", env_world)),
                                 visible_gpus(), dist.is_nccl_available())
    created = not dist.is_initialized()
    if created:
        _place_this_rank(local_rank, placement)
        dist.init_process_group(placement.backend, init_method="env://")
    try:
        result = fn(*args, **kwargs)
        gathered: list[Any] = [None] * env_world
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        if created:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- the child

_PLACED: tuple[torch.device, str] | None = None  # this rank's device, and its placement


def _place_this_rank(rank: int, placement: Placement) -> None:
    global _PLACED
    if placement.device == "cuda":
        index = rank % visible_gpus()
        torch.cuda.set_device(index)
        _PLACED = (torch.device("cuda", index), placement.description)
    else:
        _PLACED = (torch.device("cpu"), placement.description)


def rank_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, a shared GPU under gloo with
    CUDA tensors, else the CPU."""
    if _PLACED is not None:
        return _PLACED[0]
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def placement() -> str:
    """How this rank was placed, in words (for the run report)."""
    if _PLACED is not None:
        return _PLACED[1]
    if dist.is_initialized():
        return f"{dist.get_backend()}: {dist.get_world_size()} rank(s) on {rank_device()}"
    return f"one process on {rank_device()}"


def _end_group() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)  # this rank and everything it started


def _die_with_parent(parent: int) -> None:
    """If the launching process dies (a killed notebook kernel, kill -9 of a script), this
    rank and every process it started end too, instead of lingering on ports and cores.

    The rank leads a process group of its own, so that one signal reaches whatever it
    started; a watchdog thread ends the group as soon as the parent is gone. The parent
    may already be gone when this runs (it died while the rank was importing torch): then
    the rank ends at once."""
    os.setsid()
    if os.getppid() != parent:
        _end_group()

    def watch() -> None:
        while True:
            time.sleep(0.2)
            if os.getppid() != parent:
                _end_group()

    threading.Thread(target=watch, name="shardlab-watch-parent", daemon=True).start()


def _child_main(rank: int, world: int, port: int, fn: Callable, args: tuple, kwargs: dict,
                run_dir: str, threads: int, timeout: float, parent: int,
                where: Placement) -> None:
    _die_with_parent(parent)
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
        _place_this_rank(rank, where)
        dist.init_process_group(where.backend, store=store, rank=rank, world_size=world,
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

RUN_DIR_PREFIX = "shardlab-launch-"
OWNER = "owner.pid"


@dataclass
class _Rank:
    rank: int
    process: Any


def _stop(ranks: list[_Rank]) -> None:
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


# The reaper: a process without torch (it starts in milliseconds), started before any rank,
# that holds the read end of a pipe from the launching process. It learns each rank's pid
# as the rank starts; if the pipe ends without "done" (the launching process was killed,
# even by SIGKILL), it kills every rank and the process group each rank leads. A rank's
# own watchdog (`_die_with_parent`) only starts once the rank has imported torch and the
# launching script, seconds later on a busy machine: the reaper covers those seconds.
_REAPER = """
import os, signal, sys
pids = []
for line in sys.stdin.buffer:
    if line.strip() == b"done":
        sys.exit(0)
    pids.append(int(line))
for pid in pids:
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


def _start_reaper() -> subprocess.Popen | None:
    try:  # its own session: a Ctrl-C meant for the launch does not reach it
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER],
                                stdin=subprocess.PIPE, bufsize=0, start_new_session=True)
    except OSError:
        return None  # the ranks' watchdogs still end them


def _tell_reaper(reaper: subprocess.Popen | None, line: str) -> None:
    if reaper is None:
        return
    with contextlib.suppress(OSError):  # a reaper that is gone has nothing left to do
        reaper.stdin.write(line.encode() + b"\n")


def _dismiss_reaper(reaper: subprocess.Popen | None) -> None:
    if reaper is None:
        return
    _tell_reaper(reaper, "done")
    with contextlib.suppress(OSError):
        reaper.stdin.close()
    try:
        reaper.wait(timeout=10)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim_run_dirs(tmp_root: str | None = None) -> list[Path]:
    """Remove the run folders of launches whose launching process is dead (killed before
    it could clean up): each folder names its owner in `owner.pid`."""
    removed = []
    for folder in Path(tmp_root or tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        try:
            owner = int((folder / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours to judge (or being created right now)
        if not _pid_alive(owner):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


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


@contextlib.contextmanager
def _terminate_as_exit():
    """SIGTERM to the launching process (a job scheduler, `kill`) unwinds like Ctrl-C, so
    the ranks are stopped and the run folder removed; only SIGKILL leaves work to the
    ranks' watchdogs and to the next launch's `reclaim_run_dirs`."""
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


def launch(fn: Callable, world: int | None, *args: Any, backend: str = "auto",
           device: str = "auto", timeout: float = DEFAULT_TIMEOUT, threads: int = 1,
           prefix: bool = True, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world` ranks; return the ranks' results in rank order.

    backend: "auto", "gloo" or "nccl"; device: "auto", "cpu" or "cuda" (see
    `choose_placement`: NCCL with a GPU per rank, gloo with ranks sharing the GPUs, gloo
    on the CPU). timeout: seconds for the whole launch; on expiry every rank is stopped.
    threads: intra-op threads per rank; 1 keeps N ranks from fighting over a few cores.
    prefix: prefix each printed line with its rank ("[rank 2] ...").
    """
    check_importable(fn)
    if under_torchrun():
        return _run_in_this_process(fn, world, args, kwargs, backend, device)
    world = _check_world(world)
    threads = _check_threads(threads)
    if timeout is None or isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    where = choose_placement(backend, device, world, visible_gpus(), dist.is_nccl_available())
    check_main_guard()
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as exc:  # noqa: BLE001
        raise LaunchError(f"the function or its arguments cannot be sent to a child "
                          f"process: {exc}") from None
    reclaim_run_dirs()
    ctx = get_context("spawn")
    # The parent owns the rendezvous; port 0 lets the OS choose a free port atomically.
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True,
                          datetime.timedelta(seconds=timeout), wait_for_workers=False)
    ranks: list[_Rank] = []
    reaper = None
    with _terminate_as_exit(), tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX) as tmp:
        run_dir = Path(tmp)
        (run_dir / OWNER).write_text(str(os.getpid()))
        try:
            reaper = _start_reaper()
            for rank in range(world):
                p = ctx.Process(target=_child_main, name=f"shardlab-rank{rank}",
                                args=(rank, world, store.port, fn, args, kwargs, tmp,
                                      threads, timeout, os.getpid(), where), daemon=True)
                p.start()
                _tell_reaper(reaper, str(p.pid))
                ranks.append(_Rank(rank, p))
            _wait_all(ranks, run_dir, timeout)
        finally:
            _stop(ranks)
            _dismiss_reaper(reaper)
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
