"""`launch`: run one function of the package on N ranks and collect what each returns.

A notebook cannot host a multi-process job by itself: the ranks must be separate
processes, started clean (a fork of the kernel would copy its threads and sockets): forked
from a fork server that imported torch once (`starter`), or spawned. Such processes can
import a function of a module, which travels by name; one written in a notebook cell, an
interactive session or a script read from standard input travels by value (`carry`):

    >>> from shardlab.launch import launch
    >>> from shardlab.workers import whoami
    >>> launch(whoami, world=4)          # one value per rank, in rank order
    >>> def mine():                      # in a notebook cell
    ...     return torch.distributed.get_rank() * 10
    >>> launch(mine, world=4)
    [0, 10, 20, 30]

What `launch` promises, because a stuck or half-dead job is the worst thing a lab can do:

* the rendezvous is a `TCPStore` that *this* process opens on 127.0.0.1 with a port the
  kernel picks (port 0), so two launches at once never fight over a port;
* a rank that raises ends the launch: the other ranks are stopped and the caller gets one
  `RankFailed` that names the rank and carries its traceback; a rank killed by a signal
  (or that exits without a word) is named before the peers whose collectives it broke;
* a rank that hangs is stopped by the timeout, which names the ranks still running;
* a launch that fails or times out says which rank waits in which collective and what
  the others last ran: every rank keeps PyTorch's flight recorder, dumped when the launch
  fails and compared (`recorders`); a rank that died is said to have died, first;
* Ctrl-C stops every rank; if the launching process is killed (even by SIGKILL), a
  small reaper process it started first kills the ranks at once and removes the run
  folder, and each rank's own watchdog ends it too once it is running;
* whatever happens, no process of the launch outlives the call;
* what the ranks print is shown after they finish, grouped by rank, in rank order, so a
  notebook's stored output is the same on every run.

Under `torchrun` there is nothing to spawn: `launch` runs the function in this process
with the environment's rank and world size, and returns every rank's value (gathered);
`torchrun` holds what that takes (where each rank runs, the node that died named).
"""


from __future__ import annotations

import ast
import datetime
import faulthandler
import os
import pickle
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardlab.launch import carry, recorders
from shardlab.launch.blame import the_cause
from shardlab.launch.devices import (Placement, choose_placement, place_this_rank,
                                     visible_gpus)
from shardlab.launch.errors import LaunchError, LaunchTimeout
from shardlab.launch.hygiene import (OWNER, RUN_DIR_PREFIX, RankProcess, die_with_parent,
                                     dismiss_reaper, reclaim_run_dirs, start_reaper,
                                     stop_ranks, tell_reaper, terminate_as_exit)
from shardlab.launch.starter import rank_context, socket_folder
from shardlab.launch.torchrun import run_in_this_process, under_torchrun


DEFAULT_TIMEOUT = 300.0


def check_importable(fn: Callable) -> None:
    """Refuse a function that could not reach a rank, before starting any.

    A function a rank can import travels by name; any other (a notebook cell's, an
    interactive session's, a lambda, a nested function) by value, with what it captures.
    What cannot travel, a closure over a lock or an open file, is refused here with one
    line naming the object (`carry.pack`)."""
    if not callable(fn):
        raise LaunchError(f"launch needs a function, got a {type(fn).__name__}")
    carry.check_carriable(fn)


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


def _child_main(rank: int, world: int, port: int, payload: bytes, surroundings: dict,
                run_dir: str, threads: int, timeout: float, parent: int,
                where: Placement) -> None:
    die_with_parent(parent)
    out_dir = Path(run_dir)
    # Redirect the file descriptors, not just sys.stdout, so that prints from C++ (gloo,
    # NCCL) are captured with the rank's own output instead of lost or interleaved.
    for fd, name in ((1, "out"), (2, "err")):
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        f = open(out_dir / f"rank{rank}.{name}", "wb", buffering=0)
        os.dup2(f.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    # A crash in native code (SIGSEGV, SIGABRT, ...) kills the rank before Python can write
    # an error: the Python stacks of all its threads go to its stderr file instead, where
    # `blame` finds them to say where the rank was.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    try:
        os.environ.clear()
        os.environ.update(surroundings["environ"])
        os.chdir(surroundings["cwd"])
        sys.path[:] = surroundings["sys_path"]
        recorders.turn_on(out_dir)
        # loaded here, not by multiprocessing, so that a function that cannot be found is
        # reported like any other failure of the rank (with its traceback)
        fn, args, kwargs = carry.unpack(payload)
        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, world + 1, False,
                              datetime.timedelta(seconds=timeout))
        place_this_rank(rank, where)
        dist.init_process_group(where.backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        recorders.answer_requests(out_dir, rank)
        result = fn(*args, **kwargs)
        recorders.returned()
        tmp = out_dir / f"rank{rank}.result.tmp"
        tmp.write_bytes(carry.dumps_result(result))
        tmp.rename(out_dir / f"rank{rank}.result")
        # No rank leaves before every rank is done: a function that runs no collective
        # can return while a peer is still connecting to it, and the peer's connection
        # then fails ("Connection closed by peer") on a busy machine. The result is
        # written first, so a timeout still names only the ranks that had not finished.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        recorders.dump(out_dir, rank, exc)
        (out_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit handlers that could block on a dead peer
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is on disk. Leave without the interpreter's teardown: destructors of
    # backend threads still winding down can abort() a healthy rank at exit.
    os._exit(0)


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
    if timeout is None or isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if under_torchrun():
        return run_in_this_process(fn, world, args, kwargs, backend, device, timeout)
    world = _check_world(world)
    threads = _check_threads(threads)
    where = choose_placement(backend, device, world, visible_gpus(), dist.is_nccl_available())
    check_main_guard()
    payload = carry.pack(fn, args, kwargs)
    # Where the function is looked up: this process's, at this launch (a fork server
    # started earlier keeps the directory and path it started with).
    surroundings = {"cwd": os.getcwd(), "sys_path": carry.lookup_path(),
                    "environ": dict(os.environ)}
    reclaim_run_dirs()
    # The parent owns the rendezvous; port 0 lets the OS choose a free port atomically.
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True,
                          datetime.timedelta(seconds=timeout), wait_for_workers=False)
    ranks: list[RankProcess] = []
    reaper = None
    with rank_context() as ctx, terminate_as_exit(), \
            tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX) as tmp:
        run_dir = Path(tmp)
        (run_dir / OWNER).write_text(str(os.getpid()))
        try:
            reaper = start_reaper(tmp)
            with carry.main_not_reimported():
                folder = socket_folder(ctx)  # told before the fork server starts in it
                if folder is not None:
                    tell_reaper(reaper, f"folder {folder}")
                for rank in range(world):
                    p = ctx.Process(target=_child_main, name=f"shardlab-rank{rank}",
                                    args=(rank, world, store.port, payload, surroundings,
                                          tmp, threads, timeout, os.getpid(), where),
                                    daemon=True)
                    p.start()
                    tell_reaper(reaper, f"rank {p.pid}")
                    ranks.append(RankProcess(rank, p))
            try:
                _wait_all(ranks, run_dir, timeout)
            except LaunchError as failure:
                recorders.ask_ranks(run_dir, ranks)
                stop_ranks(ranks)
                recorders.explain(failure, run_dir, world)
                raise
        finally:
            stop_ranks(ranks)
            dismiss_reaper(reaper)
            _print_outputs(run_dir, world, prefix)
            del store
        return [pickle.loads((run_dir / f"rank{r}.result").read_bytes()) for r in range(world)]


def _wait_all(ranks: list[RankProcess], run_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = {r.process.sentinel: r for r in ranks}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            # a rank waiting for its peers after writing its result has finished
            raise LaunchTimeout(timeout, sorted(
                r.rank for r in pending.values()
                if not (run_dir / f"rank{r.rank}.result").exists()))
        for sentinel in wait(list(pending), timeout=min(remaining, 1.0)):
            r = pending.pop(sentinel)
            r.process.join()
            if r.process.exitcode == 0 and (run_dir / f"rank{r.rank}.result").exists():
                continue
            raise the_cause(ranks, run_dir)
