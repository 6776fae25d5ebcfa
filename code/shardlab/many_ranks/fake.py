"""SIMULATION: one rank of N, alone in this process, its peers imagined.

PyTorch's fake process group (backend "fake", `torch/testing/_internal/distributed/
fake_pg.py`: "a process group which doesn't actually do any communication [...] You can
run a single rank with a fake process group without needing multiple processes") answers
every collective at once and writes nothing into its outputs. So a strategy's code runs
as rank r of N for any N, 1,024 as easily as 2: its layout is cut for N, its collectives
are called with the sizes they have at N, and the ledger (`shardlab.comm.Ledger`, which
sees the fake group's collectives where it sees gloo's, at the c10d operators) counts
the bytes the ring algorithm would move for them. What comes back from a collective is
whatever was in the buffer: the values are meaningless, the bytes and the layout are not.

    >>> with one_rank_of(1024, rank=0):
    ...     wrapped = get_strategy("fsdp2")(model, precision, spec, {})
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from shardlab.launch.errors import LaunchError


@contextlib.contextmanager
def one_rank_of(world: int, rank: int = 0):
    """This process is rank `rank` of a fake world of `world` ranks inside the block:
    `dist.get_rank()` and `dist.get_world_size()` say so, subgroups can be made, and
    every collective returns at once, moving nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a whole number >= 1, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank!r}")
    if dist.is_initialized():
        raise LaunchError("one_rank_of makes a world of its own: call it from a process "
                          "that has no process group (not from a rank)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
