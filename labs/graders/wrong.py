"""Deliberately wrong answers, one per exercise: each grader must reject its own (a grader
that passes everything grades nothing). Each is a mistake a reader could make."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from shardlab import comm


# ring: the chunks travel correctly, but each rank returns its right neighbour's sum
def ring_reduce_scatter_off_by_one(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    full = comm.ring_all_reduce(tensor.flatten().clone(), check=False)
    chunk = -(-tensor.numel() // world)
    padded = torch.zeros(world * chunk, dtype=tensor.dtype, device=tensor.device)
    padded[:tensor.numel()] = full
    return padded.view(world, chunk)[(rank + 1) % world].clone()


def ring_all_gather(chunk):
    return comm.ring_all_gather(chunk, check=False)


RING = (ring_reduce_scatter_off_by_one, ring_all_gather)


# DDP: sums the gradients instead of averaging them (and waits for backward to end)
class SummingDDP(nn.Module):
    def __init__(self, module, bucket_mb):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            dist.all_reduce(p.grad)


DDP = SummingDDP


# ZeRO-1: right parameters, but it is DDP: all-reduce, then every rank holds all the state
class NotSharded:
    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.optimizer = optimizer_class(self.params, **defaults)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad()


ZERO1 = NotSharded


# FSDP unit: torch.chunk without padding, so a rank's shard is short when d0 % N != 0
def reshard_unpadded(full):
    return torch.chunk(full, dist.get_world_size())[dist.get_rank()].clone()


def unshard_unpadded(shard, d0):
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, shard)
    return torch.cat(pieces)[:d0]


def reduce_scatter_grad_unpadded(grad):
    grad = grad.clone()
    dist.all_reduce(grad)
    return reshard_unpadded(grad / dist.get_world_size())


FSDP_UNIT = (reshard_unpadded, unshard_unpadded, reduce_scatter_grad_unpadded)


# checkpoint: one file, written by rank 0 only (every other rank's shard is lost)
def save_rank0_only(shard, folder):
    os.makedirs(folder, exist_ok=True)
    if dist.get_rank() == 0:
        torch.save(shard, os.path.join(folder, "model.pt"))


def load_the_one_file(folder):
    return torch.load(os.path.join(folder, "model.pt"), weights_only=True)


CHECKPOINT = (save_rank0_only, load_the_one_file)


# rows: floor(d0/N) rows a rank, the rest to the last (not torch.chunk's ceil(d0/N))
def read_rows_floor(path, name):
    import torch.distributed as dist
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        rows = f.get_slice(name)
        d0 = rows.get_shape()[0]
        per, rank, world = d0 // dist.get_world_size(), dist.get_rank(), dist.get_world_size()
        stop = d0 if rank == world - 1 else (rank + 1) * per
        return rows[rank * per:stop]


ROWS = read_rows_floor
