"""Collectives built from send/recv, a ledger of every byte, and the volumes of ZeRO.

Three things live here, because they are one idea: *what a collective costs*.

1. **Ring collectives** (`ring_reduce_scatter`, `ring_all_gather`, `ring_all_reduce`,
   `ring_broadcast`), written with nothing but point-to-point `isend`/`irecv`, so that
   every byte a rank sends is visible in twenty lines of Python. The tensor is cut into
   N chunks (N = `world`, padded with zeros when its length does not divide by N); in each
   of N-1 rounds every rank sends one chunk to its right neighbour and receives one from
   its left. A rank therefore sends (N-1)/N of the tensor per reduce-scatter or
   all-gather, and an all-reduce (= reduce-scatter then all-gather) sends 2(N-1)/N of it.

2. **The ledger.** `with Ledger() as ledger:` records every collective this rank runs
   inside it: the ring collectives above (they record themselves, once, without their
   inner send/recv) and every native `torch.distributed` collective, whoever calls it:
   our code, PyTorch's DDP (its C++ reducer), `ZeroRedundancyOptimizer`, `fully_shard`.
   Native collectives are seen where every caller ends up, at the `c10d` operators of
   torch's dispatcher: a Python kernel registered for them records each call and passes
   it on. That holds on any thread, so collectives launched from backward hooks and from
   DDP's C++ reducer are recorded too.

   Each record also carries *when*: its launch (`start`), its completion (`end`) and the
   spans during which this rank sat in `work.wait()` for it (`waits`; a blocking
   collective is one launch followed by a wait). Those timestamps, not an assumed
   bandwidth, are what `shardlab.report` turns into exposed communication and idle time.

   For a native collective, `sent_bytes`/`received_bytes` are what the *ring algorithm*
   would move for it on this rank, not what the backend did: the backend does not tell.
   That is the quantity of the ZeRO paper's analysis. gloo, for one, builds its
   reduce-scatter on an all-reduce, so it really moves twice what the ledger reports for
   it; the first chapter measures that against `ring_reduce_scatter`.

3. **The volumes** of the ZeRO paper as functions (`volume_per_rank`) and the α-β cost
   model of a ring (`predict_seconds`, `fit_alpha_beta`).

The module also holds the one shim for torch's renamed collectives: torch 2.13 renamed
`all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` and the old names warn. Every module of the course calls
`all_gather_into` / `reduce_scatter_into` instead, so the rename is handled here only.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------- the shim

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group=None, async_op=False):
    """Concatenate every rank's `input` (same shape on all ranks) into `output`."""
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                        group=None, async_op=False):
    """Reduce `input` (world * len(output) elements) across ranks; keep this rank's chunk."""
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


# ----------------------------------------------------------------------------- records


@dataclass
class CollectiveRecord:
    """One collective as one rank saw it.

    logical_bytes: elements x element size of the full (unsharded) tensor the collective
    is about. sent_bytes / received_bytes: what this rank sends and receives (for native
    collectives: what the ring algorithm would). seconds: from the call to completion
    (for a collective whose backend gives no completion signal, gloo's reduce-scatter and
    send/recv, to the return of the first wait for it, or else to the launch).
    rounds / round_bytes: sequential point-to-point rounds of the ring, and the bytes of
    one round: the α-β model's `steps` and `bytes per step`.

    start / end: `time.perf_counter()` at the launch and at the completion, the same
    instants as `seconds` (`end` is NaN while neither a completion nor a wait is known).
    waits: the (begin, end) spans in which this rank's thread was held by it: its launch,
    then `work.wait()` (the whole call, for a ring collective, which blocks). group: the process group's name,
    the same on every rank, so the ranks' records of one collective can be paired.
    """

    op: str
    dtype: torch.dtype
    numel: int
    logical_bytes: int
    sent_bytes: int
    received_bytes: int
    seconds: float
    step: int
    world: int = 1
    rounds: int = 0
    round_bytes: int = 0
    start: float = 0.0
    end: float = 0.0
    waits: list[tuple[float, float]] = field(default_factory=list)
    group: str = ""


def ring_traffic(op: str, numel: int, world: int, elem_size: int, rank: int = 0,
                 src: int = 0) -> tuple[int, int, int, int]:
    """(sent, received, rounds, round_bytes) of one rank for a ring collective.

    `numel` is the full tensor's length. Reduce-scatter and all-gather: N-1 rounds of one
    chunk of ceil(numel/N) elements each way. All-reduce: both. Broadcast: the tensor is
    cut into N pieces that flow down the chain src -> src+1 -> ... (N+N-2 rounds); every
    rank but the last forwards the whole tensor, every rank but src receives it.
    """
    op = op.removeprefix("ring_")
    if world == 1 or numel == 0:
        return 0, 0, 0, 0
    chunk = math.ceil(numel / world) * elem_size
    if op in ("reduce_scatter", "all_gather"):
        return (world - 1) * chunk, (world - 1) * chunk, world - 1, chunk
    if op == "all_reduce":
        return 2 * (world - 1) * chunk, 2 * (world - 1) * chunk, 2 * (world - 1), chunk
    if op == "broadcast":
        pieces = min(world, numel)
        position = (rank - src) % world
        full = numel * elem_size
        return (full if position < world - 1 else 0, full if position > 0 else 0,
                pieces + world - 2, math.ceil(numel / pieces) * elem_size)
    if op in ("send", "recv"):
        full = numel * elem_size
        return (full, 0, 1, full) if op == "send" else (0, full, 1, full)
    raise ValueError(f"unknown collective {op!r}; use one of reduce_scatter, all_gather, "
                     f"all_reduce, broadcast, send, recv")


_ACTIVE: list["Ledger"] = []   # ledgers open in this process, innermost last
_local = threading.local()     # .depth > 0 while a ring collective runs on this thread


def _emit(op, dtype, numel, logical_bytes, sent, received, seconds, world, rounds,
          round_bytes, start=0.0, group="") -> list[CollectiveRecord]:
    records = []
    for ledger in list(_ACTIVE):
        record = CollectiveRecord(op, dtype, numel, logical_bytes, sent, received, seconds,
                                  ledger.step, world, rounds, round_bytes, start,
                                  start + seconds, [], group)
        ledger.records.append(record)
        records.append(record)
    return records


@contextmanager
def _recorded(op: str, tensor: torch.Tensor, numel: int, world: int, rank: int, src: int = 0,
              group=None):
    """Record the ring collective run inside, once: inner rings and send/recv are muted.
    It blocks from call to return, so that whole span is also its wait."""
    outer = getattr(_local, "depth", 0)
    _local.depth = outer + 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _local.depth = outer
    if outer == 0 and _ACTIVE:
        size = tensor.element_size()
        sent, received, rounds, round_bytes = ring_traffic(op, numel, world, size, rank, src)
        seconds = time.perf_counter() - start
        for record in _emit(op, tensor.dtype, numel, numel * size, sent, received, seconds,
                            world, rounds, round_bytes, start, _group_name(group)):
            record.waits.append((start, start + seconds))


# ----------------------------------------------------------------------------- the rings


def _reduce_name(op) -> str:
    if op in ("sum", dist.ReduceOp.SUM):
        return "sum"
    if op in ("avg", "mean", dist.ReduceOp.AVG):
        return "avg"
    raise ValueError(f"unsupported reduce op {op!r}; use 'sum' or 'avg' "
                     f"(or dist.ReduceOp.SUM / dist.ReduceOp.AVG)")


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32, torch.uint8, torch.int8, torch.int16, torch.bool]
_MAX_DIMS = 8


def check_same_tensor(name: str, tensor: torch.Tensor, group=None) -> None:
    """Raise on every rank if the ranks did not pass tensors of one shape and dtype.

    A ring with mismatched chunks would hang (a rank waits for bytes that never come) or
    silently mix garbage; a tiny all-gather of (dtype, shape) first turns that into an
    error that names the ranks and their shapes.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"{name}: tensors of more than {_MAX_DIMS} dims are not supported; "
                         f"flatten it first")
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    meta = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64, device=tensor.device)
    meta[0], meta[1] = code, tensor.dim()
    meta[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64,
                                           device=tensor.device)
    everyone = [torch.empty_like(meta) for _ in range(world)]
    outer = getattr(_local, "depth", 0)
    _local.depth = outer + 1  # the check is not part of the collective's traffic
    try:
        dist.all_gather(everyone, meta, group=group)
    finally:
        _local.depth = outer
    if all(torch.equal(m, meta) for m in everyone):
        return

    def describe(m: torch.Tensor) -> str:
        code, dims = int(m[0]), int(m[1])
        dtype = str(_DTYPES[code]).removeprefix("torch.") if code < len(_DTYPES) else "?"
        return f"{dtype} {tuple(int(d) for d in m[2:2 + dims])}"

    table = ", ".join(f"rank {r}: {describe(m)}" for r, m in enumerate(everyone))
    raise ValueError(f"{name}: every rank must pass a tensor of the same shape and dtype, "
                     f"but got {table}")


def _ring_ranks(group) -> tuple[int, int, int, int]:
    """(world, rank, right, left), the neighbours as global ranks for send/recv."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return world, rank, to_global((rank + 1) % world), to_global((rank - 1) % world)


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group) -> None:
    """One round of the ring: send to the right neighbour while receiving from the left."""
    requests = [dist.isend(send, right, group=group), dist.irecv(recv, left, group=group)]
    for request in requests:
        request.wait()


def ring_reduce_scatter(tensor: torch.Tensor, op="sum", group=None,
                        check: bool = True) -> torch.Tensor:
    """Sum (or average) `tensor` over the ranks; return this rank's chunk of the result.

    The flattened tensor (L elements) is padded to N chunks of ceil(L/N); rank r gets chunk
    r, 1-D, zeros where it covers padding. In round s rank r sends its partial sum of chunk
    (r-s-1) mod N to the right and adds the partial sum of chunk (r-s-2) mod N arriving from
    the left: after N-1 rounds the chunk it last received, r, holds all N contributions.
    """
    reduce = _reduce_name(op)
    world, rank, right, left = _ring_ranks(group)
    if check:
        check_same_tensor("ring_reduce_scatter", tensor, group)
    numel = tensor.numel()
    chunk = math.ceil(numel / world)
    with _recorded("ring_reduce_scatter", tensor, numel, world, rank, group=group):
        padded = torch.zeros(world * chunk, dtype=tensor.dtype, device=tensor.device)
        padded[:numel].copy_(tensor.reshape(-1))
        chunks = padded.view(world, chunk)
        incoming = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
        for s in range(world - 1 if chunk else 0):
            _exchange(chunks[(rank - s - 1) % world], incoming, right, left, group)
            chunks[(rank - s - 2) % world].add_(incoming)
        mine = chunks[rank].clone()
        if reduce == "avg":
            mine.div_(world)
    return mine


def ring_all_gather(chunk: torch.Tensor, numel: int | None = None, group=None,
                    check: bool = True) -> torch.Tensor:
    """Concatenate every rank's `chunk` (same shape on all ranks) in rank order, 1-D.

    `numel` trims the padding that `ring_reduce_scatter` added. In round s rank r forwards
    chunk (r-s) mod N, the one it received last, and receives chunk (r-s-1) mod N.
    """
    world, rank, right, left = _ring_ranks(group)
    if check:
        check_same_tensor("ring_all_gather", chunk, group)
    size = chunk.numel()
    total = world * size if numel is None else numel
    if not 0 <= total <= world * size:
        raise ValueError(f"ring_all_gather: numel={numel} must be between 0 and world x "
                         f"chunk = {world * size}")
    with _recorded("ring_all_gather", chunk, world * size, world, rank, group=group):
        gathered = torch.empty(world * size, dtype=chunk.dtype, device=chunk.device)
        pieces = gathered.view(world, size)
        pieces[rank].copy_(chunk.reshape(-1))
        for s in range(world - 1 if size else 0):
            _exchange(pieces[(rank - s) % world], pieces[(rank - s - 1) % world],
                      right, left, group)
    return gathered[:total]


def ring_all_reduce(tensor: torch.Tensor, op="sum", group=None,
                    check: bool = True) -> torch.Tensor:
    """Sum (or average) `tensor` over the ranks, in place: reduce-scatter, then all-gather.

    Each half moves (N-1)/N of the tensor per rank, so the all-reduce moves 2(N-1)/N:
    the same bytes as the two collectives ZeRO runs instead, which is why sharding the
    gradient costs no extra communication.
    """
    _reduce_name(op)
    world, rank, _, _ = _ring_ranks(group)
    if check:
        check_same_tensor("ring_all_reduce", tensor, group)
    with _recorded("ring_all_reduce", tensor, tensor.numel(), world, rank, group=group):
        mine = ring_reduce_scatter(tensor, op, group, check=False)
        full = ring_all_gather(mine, tensor.numel(), group, check=False)
        tensor.copy_(full.view_as(tensor))
    return tensor


def ring_broadcast(tensor: torch.Tensor, src: int = 0, group=None,
                   check: bool = True) -> torch.Tensor:
    """Copy `tensor` of rank `src` into every rank's `tensor`, in place.

    A pipelined chain around the ring: the tensor is cut into N pieces and each rank
    forwards piece k to its right while it receives piece k+1, so the time is N+N-2
    rounds of one piece instead of N-1 rounds of the whole tensor.
    """
    world, rank, right, left = _ring_ranks(group)
    if not 0 <= src < world:
        raise ValueError(f"ring_broadcast: src={src} is not a rank of a group of {world}")
    if check:
        check_same_tensor("ring_broadcast", tensor, group)
    numel = tensor.numel()
    with _recorded("ring_broadcast", tensor, numel, world, rank, src, group=group):
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        position = (rank - src) % world
        sends = []
        for piece in torch.tensor_split(flat, min(world, numel)) if numel else []:
            if position > 0:
                dist.recv(piece, left, group=group)
            if position < world - 1:
                sends.append(dist.isend(piece, right, group=group))
        for request in sends:
            request.wait()
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
    return tensor


# ----------------------------------------------------------------------------- the ledger

def _numel(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel()
    return sum(_numel(t) for t in tensors)


def _first(tensors) -> torch.Tensor:
    return tensors if isinstance(tensors, torch.Tensor) else _first(tensors[0])


# c10d operator -> arguments -> (name, tensors that give the dtype, logical numel, boxed
# process group, source rank). Every torch.distributed collective, whoever calls it (and
# the functional collectives of torch.compile and DTensor, which lower to these), ends up
# as one of these operators.
_NATIVE = {
    "allreduce_": lambda a: ("all_reduce", a[0], _numel(a[0]), a[1], 0),
    "allreduce_coalesced_": lambda a: ("all_reduce", a[0], _numel(a[0]), a[1], 0),
    "_allgather_base_": lambda a: ("all_gather", a[1], a[0].numel(), a[2], 0),
    "allgather_": lambda a: ("all_gather", a[1], _numel(a[0]), a[2], 0),
    "allgather_coalesced_": lambda a: ("all_gather", a[1], _numel(a[0]), a[2], 0),
    "allgather_into_tensor_coalesced_": lambda a: ("all_gather", a[1], _numel(a[0]), a[2], 0),
    "_reduce_scatter_base_": lambda a: ("reduce_scatter", a[1], a[1].numel(), a[2], 0),
    "reduce_scatter_": lambda a: ("reduce_scatter", a[0], _numel(a[1]), a[2], 0),
    "reduce_scatter_tensor_coalesced_":
        lambda a: ("reduce_scatter", a[1], _numel(a[1]), a[2], 0),
    "broadcast_": lambda a: ("broadcast", a[0], _numel(a[0]), a[1], a[2]),
    "send": lambda a: ("send", a[0], _numel(a[0]), a[1], 0),
    "recv_": lambda a: ("recv", a[0], _numel(a[0]), a[1], 0),
    "recv_any_source_": lambda a: ("recv", a[0], _numel(a[0]), a[1], 0),
}


def _group_name(group) -> str:
    """The name c10d gave a process group: the same on every rank of it."""
    try:
        group = group if group is not None else dist.group.WORLD
        return str(getattr(group, "group_name", ""))
    except (RuntimeError, ValueError):  # no default group
        return ""


def _record_native(describe, args) -> Callable:
    """Record one native collective; return what to do with its result (time it)."""
    name, tensors, numel, boxed_group, src = describe(args)
    group = dist.ProcessGroup.unbox(boxed_group)
    world, rank = group.size(), group.rank()
    size = _first(tensors).element_size()
    sent, received, rounds, round_bytes = ring_traffic(name, numel, world, size, rank, src)
    start = time.perf_counter()
    records = _emit(name, _first(tensors).dtype, numel, numel * size, sent, received, 0.0,
                    world, rounds, round_bytes, start, _group_name(group))

    def finished(out):
        elapsed = time.perf_counter() - start
        for record in records:
            record.seconds = elapsed  # the launch; replaced by the completion if we can
            record.end = start + elapsed
            # the launch holds this thread too (copies, a full queue, a blocking backend)
            record.waits.append((start, start + elapsed))
        work = out[-1] if isinstance(out, tuple) else out
        if not isinstance(work, torch.ScriptObject):
            return
        unboxed = dist.Work.unbox(work)
        if unboxed is None:  # a blocking NCCL collective: it is done, keep the launch time
            return
        for record in records:
            record.end = math.nan  # known when the future completes, or a wait returns
        try:  # time to completion, without waiting here (DDP overlaps its all-reduce)
            future = unboxed.get_future()
        except RuntimeError:  # gloo's reduce-scatter and send/recv give no future
            future = None
        pending = None
        if future is not None:
            def completed(_):
                now = time.perf_counter()
                for record in records:
                    record.seconds = now - start
                    record.end = now

            pending = future.then(completed)
        # on the CPU a wait returns when the work is done, so waiting for its callback
        # too costs nothing; on a GPU it must not block the host (it orders streams)
        callback = pending if _first(tensors).device.type == "cpu" else None
        for ledger in _ACTIVE:  # `work.wait()` finds its records here (see _timed_wait)
            ledger._by_work[id(unboxed)] = (unboxed, records, callback)
            if pending is not None:
                ledger._pending.append(pending)

    return finished


_original_wait = dist.Work.wait


def _timed_wait(self, *args, **kwargs):
    """`Work.wait`, timed: the span this rank's thread blocked on a collective."""
    if not _ACTIVE:
        return _original_wait(self, *args, **kwargs)
    begin = time.perf_counter()
    try:
        return _original_wait(self, *args, **kwargs)
    finally:
        done = time.perf_counter()
        for ledger in list(_ACTIVE):
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


def _watching_kernel(op, describe):
    """A kernel for `op` at the BackendSelect key: record, then run the real kernel."""
    below = torch._C.DispatchKey.BackendSelect

    def kernel(keyset, *args, **kwargs):
        if not _ACTIVE or getattr(_local, "depth", 0):
            return op.redispatch(keyset.remove(below), *args, **kwargs)
        finished = _record_native(describe, args)
        out = op.redispatch(keyset.remove(below), *args, **kwargs)
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
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _ACTIVE.remove(self)
        if exc_type is None:  # fill in the times of collectives still in flight
            for pending in self._pending:
                pending.wait()
        self._pending.clear()
        self._by_work.clear()

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


_SUMMED = ("logical_bytes", "sent_bytes", "received_bytes", "seconds")


def totals(records: Iterable[CollectiveRecord]) -> dict:
    """calls, logical_bytes, sent_bytes, received_bytes, seconds, summed over records."""
    out = {"calls": 0, **{key: 0 for key in _SUMMED}}
    for record in records:
        out["calls"] += 1
        for key in _SUMMED:
            out[key] += getattr(record, key)
    return out


def per_op(records: Iterable[CollectiveRecord]) -> dict[str, dict]:
    """{op: totals} in the order the ops first ran."""
    groups: dict[str, list] = defaultdict(list)
    for record in records:
        groups[record.op].append(record)
    return {op: totals(rs) for op, rs in groups.items()}


def per_step(records: Iterable[CollectiveRecord]) -> list[dict[str, dict]]:
    """[{op: totals} for each step], step 0 first (steps with no collective are empty)."""
    records = list(records)
    steps = max((r.step for r in records), default=-1) + 1
    return [per_op(r for r in records if r.step == s) for s in range(steps)]


def format_table(records: Iterable[CollectiveRecord], seconds: bool = False) -> str:
    """A per-step, per-op table of bytes (and times, which vary from run to run)."""
    header = f"{'step':>4}  {'op':<22}{'calls':>6}{'logical B':>12}{'sent B':>12}{'recv B':>12}"
    header += f"{'ms':>10}" if seconds else ""
    lines = [header]
    for step, ops in enumerate(per_step(records)):
        for op, t in ops.items():
            line = (f"{step:>4}  {op:<22}{t['calls']:>6}{t['logical_bytes']:>12}"
                    f"{t['sent_bytes']:>12}{t['received_bytes']:>12}")
            lines.append(line + (f"{1e3 * t['seconds']:>10.2f}" if seconds else ""))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- volumes

# Multiples of psi (N-1)/N bytes that each strategy sends per rank and step (ring).
VOLUME_FACTORS = {
    "single": 0,
    "ddp": 2, "ddp-naive": 2, "torch-ddp": 2,    # all-reduce the gradients: RS + AG
    "zero1": 2, "zero2": 2,                      # reduce-scatter grads, all-gather params
    "torch-zero1": 3,                            # DDP's all-reduce, then N broadcasts
    "zero3": 3, "fsdp2": 3, "torch-fsdp2": 3,    # AG forward, AG backward, RS gradients
}

# Which collectives each strategy runs per step, for the tables of the text.
STRATEGY_COLLECTIVES = {
    "ddp": "all-reduce of the gradients (2Ψ)",
    "zero1": "reduce-scatter of the gradients (Ψ) + all-gather of the updated parameters (Ψ)",
    "zero2": "reduce-scatter of the gradients (Ψ) + all-gather of the updated parameters (Ψ)",
    "zero3": "all-gather of the parameters in forward (Ψ) and in backward (Ψ) "
             "+ reduce-scatter of the gradients (Ψ)",
}


def volume_per_rank(strategy: str, psi: int, world: int, bytes_per_elem: int = 1) -> float:
    """Bytes one rank sends per training step in the ZeRO paper's analysis, on a ring.

    DDP all-reduces Ψ gradients: 2Ψ(N-1)/N. ZeRO-1 and ZeRO-2 reduce-scatter the gradients
    and all-gather the updated parameters: the same 2Ψ(N-1)/N. ZeRO-3 / FSDP all-gather
    the parameters twice (forward and backward) and reduce-scatter the gradients:
    3Ψ(N-1)/N. Multiply by `bytes_per_elem` for bytes (2 for bf16, 4 for fp32).
    """
    if strategy not in VOLUME_FACTORS:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {sorted(VOLUME_FACTORS)}")
    if world < 1 or psi < 0:
        raise ValueError(f"need world >= 1 and psi >= 0, got world={world}, psi={psi}")
    return VOLUME_FACTORS[strategy] * psi * bytes_per_elem * (world - 1) / world


# ----------------------------------------------------------------------------- cost model


def predict_seconds(op: str, nbytes: int, world: int, alpha: float, beta: float) -> float:
    """α-β time of a ring collective over a tensor of `nbytes`:

        time = rounds x (α + bytes per round / β)

    α: the fixed cost of one round (latency, s); β: bandwidth (bytes/s).
    """
    _, _, rounds, round_bytes = ring_traffic(op, nbytes, world, 1)
    return rounds * (alpha + round_bytes / beta)


def fit_alpha_beta(records: Iterable[CollectiveRecord]) -> tuple[float, float]:
    """Least-squares (α, β) of `seconds ≈ α·rounds + rounds·round_bytes/β`.

    Rows are weighted by 1/seconds, so a 10 µs and a 10 ms collective count alike (the
    error that matters is relative).
    """
    rows = [r for r in records if r.rounds > 0 and r.seconds > 0]
    if len(rows) < 2:
        raise ValueError("fit_alpha_beta needs at least two timed ring collectives "
                         "(world >= 2) of different sizes")
    x = torch.tensor([[r.rounds, r.rounds * r.round_bytes] for r in rows], dtype=torch.float64,
                     device="cpu")
    y = torch.tensor([r.seconds for r in rows], dtype=torch.float64, device="cpu")
    w = 1.0 / y
    solution = torch.linalg.lstsq(x * w[:, None], (y * w)[:, None]).solution.flatten()
    alpha, inverse_beta = float(solution[0]), float(solution[1])
    return max(alpha, 0.0), (1.0 / inverse_beta if inverse_beta > 0 else math.inf)


__all__ = [
    "all_gather_into", "reduce_scatter_into", "ring_reduce_scatter", "ring_all_gather",
    "ring_all_reduce", "ring_broadcast", "check_same_tensor", "CollectiveRecord", "Ledger",
    "ring_traffic", "clock_offset", "totals", "per_op", "per_step", "format_table",
    "VOLUME_FACTORS", "STRATEGY_COLLECTIVES", "volume_per_rank", "predict_seconds",
    "fit_alpha_beta",
]
