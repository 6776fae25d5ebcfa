"""Ring collectives built from nothing but point-to-point `isend`/`irecv`.

`ring_reduce_scatter`, `ring_all_gather`, `ring_all_reduce` and `ring_broadcast` show every
byte a rank sends in twenty lines of Python. The tensor is cut into N chunks (N = `world`,
padded with zeros when its length does not divide by N); in each of N-1 rounds every rank
sends one chunk to its right neighbour and receives one from its left. A rank therefore
sends (N-1)/N of the tensor per reduce-scatter or all-gather, and an all-reduce
(= reduce-scatter then all-gather) sends 2(N-1)/N of it.

Each ring records itself in an open ledger (`shardlab.comm.ledger.recorded_ring`), once,
without its inner send/recv: that is the only thing it asks of the ledger.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardlab.comm.ledger import muted, recorded_ring


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
    with muted():  # the check is not part of the collective's traffic
        dist.all_gather(everyone, meta, group=group)
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
    with recorded_ring("ring_reduce_scatter", tensor, numel, world, rank, group=group):
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
    with recorded_ring("ring_all_gather", chunk, world * size, world, rank, group=group):
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
    with recorded_ring("ring_all_reduce", tensor, tensor.numel(), world, rank, group=group):
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
    with recorded_ring("ring_broadcast", tensor, numel, world, rank, src, group=group):
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
