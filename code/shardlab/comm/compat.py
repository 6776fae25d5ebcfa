"""The one shim over torch's renamed collectives.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to
`all_gather_single` / `reduce_scatter_single`, and the old names warn. Every module of the
course calls `all_gather_into` / `reduce_scatter_into` instead, so the rename is handled
here only, for every torch from 2.6 on. It is a module of its own because everything
imports it and it imports nothing of the course: the ring and the ledger stay out of the
way of a reader who only wants to call a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
