"""Lab 2's grader: your ring reduce-scatter and all-gather against PyTorch's collectives and
the course's ring (`shardlab.comm`), for uneven lengths and two dtypes, bit for bit.

The plain case comes first (a length N divides, fp32), the edge cases after it, so the first
difference says what is wrong in general rather than at a corner. The values are small whole
numbers, so every sum is exact in fp32 and bf16 and any difference is a wrong chunk, not
rounding: the line shows your values and the expected ones, and the first difference is
tried against the typical mistakes (`wrong.RING`). A ring in which every rank receives
before it sends is told so within `common.RECV_PATIENCE` seconds. The last case runs inside
the course's ledger: what it records of your sends and receives is handed back for the lab
to read.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.distributed as dist

from shardlab import comm
from graders import wrong
from graders.common import (RECV_PATIENCE, agree, call, first_difference, grade_on_ranks,
                            run_each, show, values)

LENGTHS = (16, 5, 37, 1)          # even (the plain case), uneven, prime, shorter than N
DTYPES = ("float32", "bfloat16")


def _device() -> torch.device:
    from shardlab.launch import rank_device
    return rank_device()


def check_one(candidate: tuple, lengths=LENGTHS, dtypes=DTYPES) -> list:
    reduce_scatter, all_gather = candidate
    rank, world, device = dist.get_rank(), dist.get_world_size(), _device()
    for case, (dtype_name, length) in enumerate((d, n) for d in dtypes for n in lengths):
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(100 * case + rank)
        x = torch.randint(-8, 9, (length,), generator=g).to(device, dtype)
        chunk = math.ceil(length / world)
        padded = torch.zeros(world * chunk, dtype=dtype, device=device)
        padded[:length] = x
        expected = torch.empty(chunk, dtype=dtype, device=device)
        comm.reduce_scatter_into(expected, padded)
        ours = comm.ring_reduce_scatter(x.clone(), check=False)
        assert torch.equal(ours, expected), "the course's ring disagrees with PyTorch"
        where = f"{dtype_name} length {length}"
        got = call(f"ring_reduce_scatter ({where})", reduce_scatter, x.clone())
        problem = shown(got, expected, "PyTorch's reduce-scatter")
        agree(problem and f"ring_reduce_scatter, {where}: {problem}", got=got,
              mistakes=wrong.RING, rerun=lambda answer: answer[0](x.clone()))
        full = torch.empty(world * chunk, dtype=dtype, device=device)
        comm.all_gather_into(full, expected)
        got = call(f"ring_all_gather ({where})", all_gather, expected.clone())
        problem = shown(got, full, "PyTorch's all-gather")
        agree(problem and f"ring_all_gather, {where}: {problem}", got=got,
              mistakes=wrong.RING, rerun=lambda answer: answer[1](expected.clone()))
    x = torch.ones(1024, device=device)
    with comm.Ledger() as ledger:
        all_gather(reduce_scatter(x))
    return ledger.records


def shown(got, expected: torch.Tensor, reference: str) -> str | None:
    """Where `got` first differs from `expected`, then both (a few whole numbers: the
    reader sees which chunk landed where), or None."""
    problem = first_difference(got, expected, reference)
    if problem and isinstance(got, torch.Tensor):
        problem += f": yours {values(got)}, expected {values(expected)}"
    return problem


def check(candidates: list, lengths=LENGTHS, dtypes=DTYPES, patience=RECV_PATIENCE) -> list:
    return run_each(candidates, check_one, lengths, dtypes, patience=patience)


def grade(ring_reduce_scatter, ring_all_gather, world: int = 4) -> SimpleNamespace:
    """Grade your two functions on `world` ranks and print one line. `.passed`, `.verdict`,
    and `.ledger` (rank 0's records of the last case) for the lab to read."""
    [(verdict, ledger)] = grade_on_ranks(check, world, [(ring_reduce_scatter, ring_all_gather)])
    return SimpleNamespace(passed=show("ring", verdict), verdict=verdict, ledger=ledger)
