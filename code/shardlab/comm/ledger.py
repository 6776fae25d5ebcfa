"""The ledger: every collective this rank runs inside `with Ledger():`, with its bytes
and its times.

It records the ring collectives of `shardlab.comm.ring` (they record themselves, once,
without their inner send/recv, through `recorded_ring`) and every native
`torch.distributed` collective, whoever calls it: our code, PyTorch's DDP (its C++
reducer), `ZeroRedundancyOptimizer`, `fully_shard`. Native collectives are seen where
every caller ends up, at the `c10d` operators of torch's dispatcher: a Python kernel
registered for them records each call and passes it on. That holds on any thread, so
collectives launched from backward hooks and from DDP's C++ reducer are recorded too.

Each record also carries *when*: its launch (`start`), its completion (`end`) and the
spans during which this rank sat in `work.wait()` for it (`waits`; a blocking collective
is one launch followed by a wait). Those timestamps, not an assumed bandwidth, are what
`shardlab.report` turns into exposed communication and idle time.

For a native collective, `sent_bytes`/`received_bytes` are what the *ring algorithm* would
move for it on this rank, not what the backend did: the backend does not tell. That is
the quantity of the ZeRO paper's analysis. gloo, for one, builds its reduce-scatter on an
all-reduce, so it really moves twice what the ledger reports for it; the first chapter
measures that against `ring_reduce_scatter`.

Why a module apart from the ring: the watching (dispatcher kernels, a patched
`Work.wait`, completion callbacks) is the hardest code of the package, and a reader who
wants to see how a ring moves its chunks should not have to scroll past it.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist

from shardlab.comm import links
from shardlab.comm.links import Throttle, group_name, per_link
from shardlab.comm.records import (CollectiveRecord, format_table, per_op, per_step,
                                   ring_traffic, totals)


_ACTIVE: list["Ledger"] = []   # ledgers open in this process, innermost last
_local = threading.local()     # .depth > 0 while a ring collective runs on this thread;
                               # .ledgers: the thread's own, where a thread is a rank


def _open() -> list["Ledger"]:
    """The ledgers that record this thread's collectives: the process's, or, where each
    thread of the process is a rank of its own (`shardlab.many_ranks.threads`), the
    thread's."""
    own = getattr(_local, "ledgers", None)
    return _ACTIVE if own is None else own


def ledgers_per_thread() -> None:
    """This thread is a rank of its own: a ledger opened on it records its collectives
    alone, and the ledgers of the process do not see them. (In a process that is one rank,
    the ledger must see every thread: DDP's reducer and autograd's run collectives too.)"""
    _local.ledgers = []


def _emit(op, dtype, numel, logical_bytes, sent, received, seconds, world, rounds,
          round_bytes, start=0.0, group="") -> list[CollectiveRecord]:
    records = []
    for ledger in list(_open()):
        record = CollectiveRecord(op, dtype, numel, logical_bytes, sent, received, seconds,
                                  ledger.step, world, rounds, round_bytes, start,
                                  start + seconds, [], group, links.link_of(group))
        ledger.records.append(record)
        records.append(record)
    return records


@contextmanager
def muted():
    """Record nothing on this thread inside: what runs here is part of a collective already
    recorded (a ring's send/recv), or no part of any (a ring's shape check)."""
    outer = getattr(_local, "depth", 0)
    _local.depth = outer + 1
    try:
        yield
    finally:
        _local.depth = outer


@contextmanager
def recorded_ring(op: str, tensor: torch.Tensor, numel: int, world: int, rank: int,
                  src: int = 0, group=None):
    """Record the ring collective run inside, once: inner rings and send/recv are muted.
    It blocks from call to return, so that whole span is also its wait."""
    outer = getattr(_local, "depth", 0)
    _local.depth = outer + 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _local.depth = outer
    if outer == 0 and _open():
        size = tensor.element_size()
        sent, received, rounds, round_bytes = ring_traffic(op, numel, world, size, rank, src)
        seconds = time.perf_counter() - start
        records = _emit(op, tensor.dtype, numel, numel * size, sent, received, seconds,
                        world, rounds, round_bytes, start, group_name(group))
        for record in records:
            record.waits.append((start, start + seconds))
        _tell_ended(records)


def _tell_ended(records: list[CollectiveRecord]) -> None:
    """These collectives have completed: tell the open ledgers (a flight recorder writes it
    down at once; a plain ledger reads `end` later and does nothing here)."""
    for ledger in list(_open()):
        ledger.ended(records)


def numel_of(tensors) -> int:
    """The elements of a tensor or of nested lists of them (a collective's arguments)."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel()
    return sum(numel_of(t) for t in tensors)


def first_tensor(tensors) -> torch.Tensor:
    return tensors if isinstance(tensors, torch.Tensor) else first_tensor(tensors[0])


# c10d operator -> arguments -> (name, tensors that give the dtype, logical numel, boxed
# process group, source rank). Every torch.distributed collective, whoever calls it (and
# the functional collectives of torch.compile and DTensor, which lower to these), ends up
# as one of these operators.
_NATIVE = {
    "allreduce_": lambda a: ("all_reduce", a[0], numel_of(a[0]), a[1], 0),
    "allreduce_coalesced_": lambda a: ("all_reduce", a[0], numel_of(a[0]), a[1], 0),
    "_allgather_base_": lambda a: ("all_gather", a[1], a[0].numel(), a[2], 0),
    "allgather_": lambda a: ("all_gather", a[1], numel_of(a[0]), a[2], 0),
    "allgather_coalesced_": lambda a: ("all_gather", a[1], numel_of(a[0]), a[2], 0),
    "allgather_into_tensor_coalesced_": lambda a: ("all_gather", a[1], numel_of(a[0]), a[2], 0),
    "_reduce_scatter_base_": lambda a: ("reduce_scatter", a[1], a[1].numel(), a[2], 0),
    "reduce_scatter_": lambda a: ("reduce_scatter", a[0], numel_of(a[1]), a[2], 0),
    "reduce_scatter_tensor_coalesced_":
        lambda a: ("reduce_scatter", a[1], numel_of(a[1]), a[2], 0),
    "broadcast_": lambda a: ("broadcast", a[0], numel_of(a[0]), a[1], a[2]),
    # all-to-all (ZeRO++'s qgZ): the numel is one rank's input, cut into equal parts
    "alltoall_base_": lambda a: ("all_to_all", a[1], a[1].numel(), a[2], 0),
    "alltoall_": lambda a: ("all_to_all", a[1], numel_of(a[1]), a[2], 0),
    "reduce_": lambda a: ("reduce", a[0], numel_of(a[0]), a[1], a[3]),
    "send": lambda a: ("send", a[0], numel_of(a[0]), a[1], 0),
    "recv_": lambda a: ("recv", a[0], numel_of(a[0]), a[1], 0),
    "recv_any_source_": lambda a: ("recv", a[0], numel_of(a[0]), a[1], 0),
}


def _throttle_seconds(describe, args) -> float:
    """SIMULATION (`shardlab.comm.links`): the seconds a throttled group's collective is
    made to last longer than it does; 0 for a group that is not throttled."""
    name, tensors, numel, boxed_group, src = describe(args)
    group = dist.ProcessGroup.unbox(boxed_group)
    throttle = links.throttle_of(group_name(group))
    if throttle is None:
        return 0.0
    return throttle.seconds(name, numel, group.size(), first_tensor(tensors).element_size(),
                            group.rank(), src)


def _simulated(describe, args) -> tuple[str, float] | None:
    """SIMULATION (`shardlab.comm.links`): (the group's name, the collective's α-β time on
    the simulated network its group runs on), or None where there is none. Collectives of
    CUDA tensors run on the real network: a host thread cannot hold a GPU stream."""
    name, tensors, numel, boxed_group, src = describe(args)
    group = dist.ProcessGroup.unbox(boxed_group)
    network = links.network_of(group_name(group))
    if network is None or first_tensor(tensors).device.type != "cpu":
        return None
    return group_name(group), network.seconds(name, numel, group.size(),
                                              first_tensor(tensors).element_size(), group.rank(),
                                              src)


def _on_wire(out, group: str, seconds: float, launched: float):
    """`out` with its work replaced by one that the group's simulated wire completes."""
    work = out[-1] if isinstance(out, tuple) else out
    if not isinstance(work, torch.ScriptObject):
        return out
    real = dist.Work.unbox(work)
    if real is None:  # a blocking NCCL collective: nothing left to wait for
        return out
    carried = links.carry_on_wire(group, real, seconds, launched).boxed()
    return (*out[:-1], carried) if isinstance(out, tuple) else carried


def _hold(out, seconds: float) -> None:
    """Let the collective finish, then sleep: the simulated link's extra time."""
    work = out[-1] if isinstance(out, tuple) else out
    if isinstance(work, torch.ScriptObject):
        unboxed = dist.Work.unbox(work)
        if unboxed is not None:
            _original_wait(unboxed)
    time.sleep(seconds)


def _record_native(describe, args, start: float) -> Callable:
    """Record one native collective launched at `start`; return what to do with its
    result (time it)."""
    name, tensors, numel, boxed_group, src = describe(args)
    group = dist.ProcessGroup.unbox(boxed_group)
    world, rank = group.size(), group.rank()
    size = first_tensor(tensors).element_size()
    sent, received, rounds, round_bytes = ring_traffic(name, numel, world, size, rank, src)
    records = _emit(name, first_tensor(tensors).dtype, numel, numel * size, sent, received, 0.0,
                    world, rounds, round_bytes, start, group_name(group))

    def finished(out):
        elapsed = time.perf_counter() - start
        for record in records:
            record.seconds = elapsed  # the launch; replaced by the completion if we can
            record.end = start + elapsed
            # the launch holds this thread too (copies, a full queue, a blocking backend)
            record.waits.append((start, start + elapsed))
        work = out[-1] if isinstance(out, tuple) else out
        if not isinstance(work, torch.ScriptObject):
            _tell_ended(records)
            return
        unboxed = dist.Work.unbox(work)
        if unboxed is None:  # a blocking NCCL collective: it is done, keep the launch time
            _tell_ended(records)
            return
        for record in records:
            record.end = math.nan  # known when the future completes, or a wait returns
        try:  # time to completion, without waiting here (DDP overlaps its all-reduce)
            future = unboxed.get_future()
        except RuntimeError:  # gloo's reduce-scatter and send/recv give no future
            future = None
        pending = None
        if future is not None:
            def completed(done):
                now = time.perf_counter()
                for record in records:
                    record.seconds = now - start
                    record.end = now
                try:
                    done.value()
                except Exception:  # noqa: BLE001 - it ended (a timeout, a lost peer) unfinished
                    return
                _tell_ended(records)

            pending = future.then(completed)
        # on the CPU a wait returns when the work is done, so waiting for its callback
        # too costs nothing; on a GPU it must not block the host (it orders streams)
        callback = pending if first_tensor(tensors).device.type == "cpu" else None
        for ledger in _open():  # `work.wait()` finds its records here (see _timed_wait)
            ledger._by_work[id(unboxed)] = (unboxed, records, callback)
            if pending is not None:
                ledger._pending.append(pending)

    return finished


_original_wait = dist.Work.wait


def _timed_wait(self, *args, **kwargs):
    """`Work.wait`, timed: the span this rank's thread blocked on a collective."""
    if not _open():
        return _original_wait(self, *args, **kwargs)
    begin = time.perf_counter()
    completed = False
    try:
        result = _original_wait(self, *args, **kwargs)
        completed = True
        return result
    finally:
        done = time.perf_counter()
        for ledger in list(_open()):
            # waited: let the work go, and the tensors it holds with it (a ZeRO-3 unit's
            # full gradient, reduce-scattered, must be freed when the strategy drops it,
            # not when the ledger forgets the step). The completion callback runs on the
            # backend's thread and holds the result until it has run: wait for it too,
            # so that when the tensors go does not depend on how busy the machine is.
            _, records, callback = ledger._by_work.pop(id(self), (None, (), None))
            if callback is not None:
                callback.wait()
            for record in records:
                record.waits.append((begin, done))
                if math.isnan(record.end):  # no completion signal (yet): the wait's return
                    record.end = done
                    record.seconds = done - record.start
            if completed:  # a wait that raised (a timeout) ends a collective unfinished
                ledger.ended(records)


def _watching_kernel(op, describe):
    """A kernel for `op` at the BackendSelect key: record, then run the real kernel."""
    below = torch._C.DispatchKey.BackendSelect

    def kernel(keyset, *args, **kwargs):
        if not (_open() or links.any_throttled() or links.any_simulated()) \
                or getattr(_local, "depth", 0):
            return op.redispatch(keyset.remove(below), *args, **kwargs)
        launched = time.perf_counter()
        held = _throttle_seconds(describe, args) if links.any_throttled() else 0.0
        wire = _simulated(describe, args) if links.any_simulated() else None
        finished = _record_native(describe, args, launched) if _open() else None
        out = op.redispatch(keyset.remove(below), *args, **kwargs)
        if held:
            _hold(out, held)
        if wire is not None:  # the caller gets a work that the simulated wire completes
            out = _on_wire(out, *wire, launched)
        if finished is not None:
            finished(out)
        return out

    return kernel


_watch_library = None


def _watch_native_collectives() -> None:
    """Route every c10d collective through a Python kernel that records it, once.

    Why a kernel at the BackendSelect dispatch key, and not a TorchDispatchMode: every
    operator call passes BackendSelect (it is always in the dispatch key set) and only
    the c10d operators have a kernel there, so the cost is paid per collective, not per
    tensor operation (a dispatch mode sends every aten op through Python, which doubles
    the step time of a small model). And it holds for every thread: DDP's C++ reducer and
    the hooks that run inside autograd's backward are caught like any other caller.
    """
    global _watch_library
    if _watch_library is not None:
        return
    # `work.wait()` is where a rank blocks on an async collective (and, inside
    # torch.distributed, on a blocking one): timed while a ledger is open.
    dist.Work.wait = _timed_wait
    library = torch.library.Library("c10d", "IMPL")
    for name, describe in _NATIVE.items():
        op = getattr(torch.ops.c10d, name).default
        library.impl(name, _watching_kernel(op, describe), "BackendSelect", with_keyset=True)
    _watch_library = library  # kept alive: the kernels last as long as the library object


def throttle_link(link: str, alpha: float = 0.0, seconds_per_byte: float = 0.0) -> Throttle:
    """SIMULATION: make every native collective of the groups labelled `link` last its
    ring's rounds x (`alpha` + bytes per round x `seconds_per_byte`) longer, on every rank
    of them, as if they crossed a slower link (`shardlab.comm.links` says how and what it
    leaves out). The calling thread sleeps that time, so an asynchronous collective loses
    its overlap: `simulate_network` is the overlapping simulation. Their records then
    carry that time too. `unthrottle_link` undoes it."""
    throttle = links.set_throttle(link, alpha, seconds_per_byte)
    _watch_native_collectives()  # the sleep happens in the kernels that watch collectives
    return throttle


def simulate_network(network: links.SimulatedNetwork, link: str | None = None) -> None:
    """SIMULATION: every native collective of the groups labelled `link` (None: of every
    group) lasts at least its ring's α-β time on `network`, counted on a wire of its own
    while the rank computes on (`shardlab.comm.links` says how and what it leaves out).
    Their records then carry that time too. `unsimulate_network` undoes it."""
    links.set_network(network, link)
    _watch_native_collectives()  # the wires are fed by the kernels that watch collectives


@contextmanager
def simulated_network(network: links.SimulatedNetwork | None, link: str | None = None):
    """`simulate_network` for the block (nothing when `network` is None): what a
    `TrainConfig`'s `simulated_network` does around the training loop."""
    if network is None:
        yield
        return
    simulate_network(network, link)
    try:
        yield
    finally:
        links.unsimulate_network(link)


class Ledger:
    """Record every collective this rank runs inside `with Ledger() as ledger:`.

    `ledger.mark_step()` starts the next step; `ledger.records` is the list of
    `CollectiveRecord`s; `totals()`, `per_op()` and `per_step()` add them up and
    `table()` prints them.
    """

    def __init__(self):
        self.records: list[CollectiveRecord] = []
        self.step = 0
        self._pending: list[torch.futures.Future] = []
        # id(work) -> (work, its records, its completion callback): a work waited later
        # (even a step later, as a deferred all-gather is) finds its records; the work is
        # kept until then so that its id stays its own, and dropped once waited (it holds
        # its tensors)
        self._by_work: dict[int, tuple] = {}

    def __enter__(self) -> "Ledger":
        _watch_native_collectives()
        _open().append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _open().remove(self)
        if exc_type is None:  # fill in the times of collectives still in flight
            for pending in self._pending:
                pending.wait()
        self._pending.clear()
        self._by_work.clear()

    def ended(self, records: list[CollectiveRecord]) -> None:
        """Called when collectives have completed (`records` may hold other ledgers' records
        of them too). Nothing to do here: `shardlab.comm.flight` overrides it."""

    def mark_step(self) -> None:
        self.step += 1
        # forget works launched two steps ago or earlier: nobody waits for them any more
        self._by_work = {k: entry for k, entry in self._by_work.items()
                         if any(r.step >= self.step - 1 for r in entry[1])}

    def totals(self) -> dict:
        return totals(self.records)

    def per_op(self) -> dict[str, dict]:
        return per_op(self.records)

    def per_step(self) -> list[dict[str, dict]]:
        return per_step(self.records)

    def per_link(self) -> dict[str, dict]:
        return per_link(self.records)

    def table(self, seconds: bool = False) -> str:
        return format_table(self.records, seconds=seconds)


def clock_offset(group=None, rounds: int = 5) -> float:
    """This rank's `time.perf_counter()` minus rank 0's at the same instant, so that the
    ranks' ledgers can be laid on one time axis (who arrived last at a collective).

    Ranks on one host read one monotonic clock: 0. Across hosts the clocks differ by an
    arbitrary amount; it is estimated as the median, over a few rounds, of the difference
    between the clocks read just after a barrier (good to the barrier's exit skew). Call
    it outside a `Ledger`: its collectives are not the strategy's.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 0.0
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) == 1:
        return 0.0
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    differences = []
    for _ in range(rounds):
        dist.barrier(group=group)
        now = torch.tensor([time.perf_counter()], dtype=torch.float64, device=device)
        dist.broadcast(now, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        differences.append(time.perf_counter() - float(now))
    return sorted(differences)[len(differences) // 2]
