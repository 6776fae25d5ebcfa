"""SIMULATION: N ranks as N threads of this process, with real values and real collectives.

Two cores hold four ranks as processes; the course's claims are about 64 to 1,024. PyTorch
ships, for its own tests, a process group whose ranks are threads of one process
(`torch/testing/_internal/distributed/multi_threaded_pg.py`, backend "threaded"): each
thread calls `init_process_group` with its rank, sees its own `dist.get_rank()`, its own
groups and device meshes, and every collective is done for real, by copying and adding
the threads' tensors. So the course's code runs on it, one thread a rank, at N = 64: the
strategies, the loop (`shardlab.train.train_rank`), the checkpoints, the ledger.

    >>> from shardlab.many_ranks.threads import launch_threads
    >>> launch_threads(fn, 64, *args)     # fn(*args) on 64 ranks; their values, in rank order

What this module adds to PyTorch's group, and why:

* send and recv: PyTorch's threaded group has none, and the course's rings are built of
  nothing else (`shardlab.comm.ring`). A send leaves a copy in a mailbox (pair of ranks,
  tag); a recv takes it, or waits for it. So a ring at N = 64 runs its 126 rounds of
  point-to-point traffic exactly as on processes.
* the ledger: a group written in Python is called directly, not through the c10d
  operators where the ledger watches native collectives (`shardlab.comm.ledger`), so each
  collective records itself here, with the bytes the ring algorithm moves, as the ledger
  counts a native one; and each thread's ledger records its own rank's collectives
  (`ledgers_per_thread`).
* a launch that fails says which rank raised first, with its traceback (`RankFailed`), and
  one that hangs is stopped and names the ranks that had not finished (`LaunchTimeout`):
  the errors of `shardlab.launch`.

What it does not model, and says wherever its numbers appear: time (the threads share the
cores and the GIL, a collective is a copy in memory: a step's seconds say nothing about N
GPUs), and separate allocators (every rank's tensors are in one process's memory: a
rank's model states are counted from its own tensors, `shardlab.measure.state_bytes`; a
peak per rank is not measured). Every collective blocks until every rank of its group has
called it, so an asynchronous launch completes at once: the order of a schedule is kept,
its overlap is not. PyTorch's process-global state is shared by the threads: the random
generator (so `shardlab.models.build_model` builds one model at a time) and the number of
intra-op threads (one, while the ranks run: N threads already share the cores).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, BarrierOptions,
                                        BroadcastOptions, ReduceScatterOptions,
                                        _create_work_from_future)
from torch.distributed.distributed_c10d import _store_based_barrier
from torch.futures import Future
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup, _install_threaded_pg, _uninstall_threaded_pg, ret_work)

from shardlab.comm.ledger import (first_tensor, ledgers_per_thread, muted, numel_of,
                                  recorded_ring)
from shardlab.launch.errors import LaunchError, LaunchTimeout, RankFailed

BACKEND = "shardlab-threads"
DEFAULT_TIMEOUT = 300.0


class _Mailboxes:
    """Point-to-point messages between the threads: a send leaves a copy under (group,
    source, destination, tag); a recv takes the oldest, or registers itself to be filled
    by the next send. Both under one lock, so a message is taken exactly once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.letters: dict[tuple, list[torch.Tensor]] = {}
        self.waiting: dict[tuple, list[tuple[torch.Tensor, Future]]] = {}

    def send(self, key: tuple, tensor: torch.Tensor) -> None:
        letter = tensor.detach().clone()
        with self.lock:
            waiting = self.waiting.get(key)
            if waiting:
                into, done = waiting.pop(0)
                into.detach().copy_(letter)
                done.set_result(None)
            else:
                self.letters.setdefault(key, []).append(letter)

    def recv(self, key: tuple, into: torch.Tensor) -> Future:
        done = Future()
        with self.lock:
            letters = self.letters.get(key)
            if letters:
                into.detach().copy_(letters.pop(0))
                done.set_result(None)
            else:
                self.waiting.setdefault(key, []).append((into, done))
        return done

    def abandon(self, why: str) -> None:
        """A rank failed: every rank waiting for a message is woken with an error."""
        with self.lock:
            for waiting in self.waiting.values():
                for _, done in waiting:
                    done.set_exception(RuntimeError(why))
            self.waiting.clear()
            self.letters.clear()


_MAIL = _Mailboxes()


class ThreadRank(ProcessLocalGroup):
    """PyTorch's threaded group, with send/recv, and each collective recorded in this
    rank's open ledgers as the ledger records a native one (the same op names, the same
    numel: an all-gather's output, a reduce-scatter's input). A collective built on
    another (all_gather_single on allgather, barrier on allreduce) is recorded once."""

    def _recorded(self, op: str, tensors, numel: int, src: int = 0):
        """The ledger's record of a collective that blocks from call to return (every
        collective of this group does), counted as the ring algorithm moves it."""
        return recorded_ring(op, first_tensor(tensors), numel, self._world_size, self._rank, src,
                             group=self)

    def allreduce(self, tensor_list, opts=AllreduceOptions()):
        with self._recorded("all_reduce", tensor_list, numel_of(tensor_list)):
            return super().allreduce(tensor_list, opts)

    def allreduce_coalesced(self, tensor_list, opts=AllreduceOptions()):
        with self._recorded("all_reduce", tensor_list, numel_of(tensor_list)):
            return super().allreduce_coalesced(tensor_list, opts)

    def allgather(self, output_tensors, input_tensor, opts=AllgatherOptions()):
        with self._recorded("all_gather", input_tensor, numel_of(output_tensors)):
            return super().allgather(output_tensors, input_tensor, opts)

    def all_gather_single(self, output_tensor, input_tensor, opts=AllgatherOptions()):
        with self._recorded("all_gather", input_tensor, output_tensor.numel()):
            return super().all_gather_single(output_tensor, input_tensor, opts)

    def reduce_scatter(self, output_tensor, scatter_list, opts=ReduceScatterOptions()):
        with self._recorded("reduce_scatter", output_tensor, numel_of(scatter_list)):
            return super().reduce_scatter(output_tensor, scatter_list, opts)

    def reduce_scatter_single(self, output_tensor, input_tensor,
                              opts=ReduceScatterOptions()):
        with self._recorded("reduce_scatter", output_tensor, input_tensor.numel()):
            return super().reduce_scatter_single(output_tensor, input_tensor, opts)

    def broadcast(self, tensor_list, opts=BroadcastOptions()):
        with self._recorded("broadcast", tensor_list, numel_of(tensor_list), opts.rootRank):
            return super().broadcast(tensor_list, opts)

    def barrier(self, opts=BarrierOptions()):
        with muted():  # a barrier moves no data: gloo's is not in the ledger either
            return super().barrier(opts)

    def send(self, tensors, dst, tag=0):
        with self._recorded("send", tensors, numel_of(tensors)):
            _MAIL.send((self.pg_name, self._rank, dst, tag), tensors[0])
            return ret_work(None)

    def recv(self, tensors, src, tag=0):
        # recorded when it is posted, as the ledger records a native irecv at its launch
        with self._recorded("recv", tensors, numel_of(tensors)):
            return _create_work_from_future(
                _MAIL.recv((self.pg_name, src, self._rank, tag), tensors[0]))

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError("recv from any source is not simulated: name the source")

    def getBackendName(self):
        return BACKEND

    def _get_backend_name(self):
        # what ShardedTensor (a checkpoint's layout) asks a group to find the device of a
        # tensor this rank holds no piece of: "gloo" is the CPU, any other name CUDA
        # (`torch/distributed/_shard/sharded_tensor/_ops/tensor_ops.py`). The CPU it is.
        return "gloo"


def _create_group(prefix_store, rank, world_size, timeout):
    group = ThreadRank(rank, world_size)
    # every group's ranks meet once before its first collective: threads create the
    # groups of a mesh independently (PyTorch's `_create_threaded_pg` does the same)
    _store_based_barrier(rank, prefix_store, "", world_size, timeout)
    return group


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu"])


_LAUNCHING = threading.Lock()  # one simulated world at a time: the group's state is global


def launch_threads(fn: Callable, world: int, *args: Any,
                   timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """SIMULATION: run `fn(*args)` on `world` ranks, each a thread of this process in a
    process group of its own ("shardlab-threads"); return their values in rank order.

    A rank that raises ends the launch (`RankFailed`, naming the first rank that raised,
    with its traceback); a launch still running after `timeout` seconds is stopped
    (`LaunchTimeout`, naming the ranks that had not finished)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a whole number >= 1, got {world!r}")
    if dist.is_initialized():
        raise LaunchError("launch_threads runs its ranks in a world of their own: call it "
                          "from a process that has no process group (not from a rank)")
    if not _LAUNCHING.acquire(blocking=False):
        raise LaunchError("another launch_threads is running in this process; simulated "
                          "worlds run one at a time")
    try:
        with _threaded_world(), _one_intra_op_thread():
            return _run(fn, world, args, timeout)
    finally:
        _LAUNCHING.release()


def _run(fn: Callable, world: int, args: tuple, timeout: float) -> list[Any]:
    store = dist.HashStore()
    results: list[Any] = [None] * world
    failures: dict[int, tuple[float, BaseException, str]] = {}
    # `init_process_group` reads the installed world: each thread's own
    installed = dist.distributed_c10d._world

    def rank_main(rank: int) -> None:
        ledgers_per_thread()
        try:
            dist.init_process_group(BACKEND, rank=rank, world_size=world, store=store)
            results[rank] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            failures[rank] = (time.perf_counter(), exc, traceback.format_exc())
            _stop_everyone(f"rank {rank} failed")
        finally:
            if dist.distributed_c10d._world is installed and dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank {r}", daemon=True)
               for r in range(world)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    unfinished = [r for r, t in enumerate(threads) if t.is_alive()]
    if unfinished:
        _stop_everyone("the launch timed out")
        for thread in threads:
            thread.join(5.0)
        raise LaunchTimeout(timeout, unfinished)
    if failures:
        # the cause: the first rank that raised something other than being stopped
        causes = {r: f for r, f in failures.items() if not isinstance(f[1], SystemExit)}
        rank = min(causes or failures, key=lambda r: (causes or failures)[r][0])
        raise RankFailed(rank, failures[rank][2])
    return results


def _stop_everyone(why: str) -> None:
    """Wake every rank that waits: in a collective (PyTorch's group ends it with
    SystemExit) or for a message."""
    ProcessLocalGroup.exception_handle(RuntimeError(why))
    _MAIL.abandon(why)


@contextlib.contextmanager
def _threaded_world():
    """PyTorch's threaded world for the block: each thread's groups are its own
    (`ThreadLocalWorld`), groups are found by name per thread (thread isolation), and
    autograd runs backward on the calling thread (so a rank's hooks run on its thread)."""
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    hook = sys.excepthook  # each rank's init_process_group prefixes it with "[rank r]"
    try:
        yield
    finally:
        sys.excepthook = hook
        ProcessLocalGroup.reset()
        _MAIL.abandon("the launch ended")
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)


@contextlib.contextmanager
def _one_intra_op_thread():
    """N ranks already share the cores: each op on one thread, as a rank's would be on
    its own GPU, instead of N x cores threads fighting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
