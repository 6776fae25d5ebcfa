"""A DTensor's whole tensor on every rank, on every placement the course launches.

`DTensor.full_tensor()` all-gathers through PyTorch's functional collectives. Over gloo
with CUDA tensors (ranks sharing one GPU, as the course places them on a one-GPU machine)
that path killed every rank with SIGSEGV under torch 2.11 on an H100 (the course's GPU
check, `pytest -m cuda`, 2026-11-27). PyTorch knows the class: its issue #152645 shows
gloo's all-gather into a tensor crashing on CUDA tensors, and PR #132709 names
`full_tensor()` of a CUDA DTensor over gloo as failing. On that placement `full_tensor`
here gathers each sharded mesh dimension itself with c10d's plain all-gather, the call the
course's own strategies make there, and which ran; everywhere else it is PyTorch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardlab.comm.compat import all_gather_into


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t` on this rank (`t` itself if it is no DTensor)."""
    if not isinstance(t, DTensor):
        return t
    mesh = t.device_mesh
    over_gloo_off_cpu = t.to_local().device.type != "cpu" and any(
        dist.get_backend(mesh.get_group(mesh_dim=i)) == "gloo" for i in range(mesh.ndim))
    return gather_shards(t) if over_gloo_off_cpu else t.full_tensor()


@torch.no_grad()
def gather_shards(t: DTensor) -> torch.Tensor:
    """`t.full_tensor()` by c10d's all-gather: each mesh dimension that shards a tensor
    dimension is gathered over its own group. A shard is `torch.chunk`'s piece (the last
    non-empty piece may be short, and those after it empty), so every rank pads its piece
    to the full chunk, and the first n rows of the gathered pieces are the tensor. The
    result is a copy, outside autograd (as `full_tensor().detach()`): a parameter's
    gathered copy is read, never trained."""
    mesh, whole = t.device_mesh, t.to_local().detach()
    sharded_dims = [p.dim for p in t.placements if isinstance(p, Shard)]
    for p in t.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(f"gather_shards takes Shard and Replicate placements, not {p}: "
                             "a Partial tensor needs a reduction, which `full_tensor()` does")
    if len(sharded_dims) != len(set(sharded_dims)):
        raise ValueError(f"gather_shards takes one mesh dimension per tensor dimension, not "
                         f"{t.placements}")
    for mesh_dim, p in enumerate(t.placements):
        if not isinstance(p, Shard):
            continue
        group, size = mesh.get_group(mesh_dim=mesh_dim), mesh.size(mesh_dim)
        n = t.shape[p.dim]
        chunk = -(-n // size)
        rows = whole.movedim(p.dim, 0)
        padded = rows.new_zeros((chunk, *rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        gathered = padded.new_empty((size * chunk, *rows.shape[1:]))
        all_gather_into(gathered, padded.contiguous(), group=group)
        whole = gathered[:n].movedim(0, p.dim)
    return whole.contiguous()
