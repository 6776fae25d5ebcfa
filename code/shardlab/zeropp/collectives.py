"""ZeRO++'s two collectives, called as PyTorch's FSDP2 calls a custom one.

    QuantizedAllGather       qwZ: every rank's shard in int8 with a scale per block,
                             all-gathered as bytes, dequantized into the gathered buffer
    QuantizedReduceScatter   qgZ: the gradients in int4, reduced by two all-to-alls, inside
                             the node first, then across nodes, each hop's sum dequantized
                             and summed in fp32 before the next quantization

Each is an object with PyTorch's call (`AllGather` and `ReduceScatter` in
`torch/distributed/fsdp/_fully_shard/_fsdp_api.py`): `comm(output_tensor=, input_tensor=,
group=, async_op=)` (and `op=` for the reduction), handed to a unit by
`set_custom_all_gather` / `set_custom_reduce_scatter`. Both block until their output is
written (dequantizing needs the bytes) and return the work of their last collective, done.

Why all-to-all for the gradients (the paper's section 4.3): a ring reduce-scatter would
dequantize, add and requantize at each of its N-1 hops, the error growing with N; an
all-to-all sends every piece once to the rank that sums it. Two hops because a node's k
GPUs share its links: the first all-to-all, inside the node, sums the node's k gradients,
so that the second, across nodes, sends 1/k of the data. Per rank, with Ψ elements of
gradient, R = N/k nodes and b bits per value:

    hop 1 (inside the node)   (k-1)/k · Ψ · b/8 bytes
    hop 2 (across nodes)      (R-1)/R · Ψ/k · b/8 bytes, (R-1)/R · Ψ · b/8 out of each node

The order of the rows ("tensor reordering" in the paper): FSDP's reduce-scatter buffer has
rank r's chunk in row r = n·k + l (node n, local rank l). Hop 1 sends local rank l' the rows
of every rank with local index l' (one per node); hop 2 sends node n' its own row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.comm.compat import all_gather_into
from shardlab.zeropp.quantize import dequantize, quantize


class QuantizedAllGather:
    """qwZ: all-gather each rank's `input_tensor` in `bits` (8) with a scale per `block`
    elements; every rank, this one included, dequantizes every shard, so all hold the
    same full parameters."""

    def __init__(self, bits: int = 8, block: int = 2048):
        self.bits, self.block = bits, block

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                 async_op: bool = False):
        world, n = dist.get_world_size(group), input_tensor.numel()
        payload = quantize(input_tensor.reshape(-1), self.bits, self.block)
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8,
                               device=payload.device)
        work = all_gather_into(gathered, payload, group=group, async_op=True)
        work.wait()
        shards = dequantize(gathered.view(world, -1), n, self.bits, self.block)
        output_tensor.view(world, n).copy_(shards)
        return work


class QuantizedReduceScatter:
    """qgZ: sum every rank's `input_tensor` (N rows of S elements, row r for rank r) into
    this rank's `output_tensor` (S), by an all-to-all in `node_group` (k ranks, consecutive)
    and one in `cross_group` (the R ranks of this local index, one per node), each in
    `bits` (4) with a scale per `block` elements."""

    def __init__(self, node_group, cross_group, bits: int = 4, block: int = 2048):
        self.node_group, self.cross_group = node_group, cross_group
        self.bits, self.block = bits, block

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        k = dist.get_world_size(self.node_group)
        nodes = dist.get_world_size(self.cross_group)
        world, size = k * nodes, output_tensor.numel()
        if dist.get_world_size(group) != world:
            raise ValueError(f"qgZ's groups hold {k} x {nodes} ranks, the shard group "
                             f"{dist.get_world_size(group)}: shard over every rank")
        rows = input_tensor.view(nodes, k, size)
        # hop 1: to local rank l, the rows of the ranks n*k + l of every node n
        mine, _ = self._exchange(rows.transpose(0, 1).reshape(k, nodes * size),
                                 self.node_group)
        node_sum = mine.sum(dim=0)  # this node's sum for the R ranks of my local index
        # hop 2: to node n, the row of its rank of my local index
        received, work = self._exchange(node_sum.view(nodes, size), self.cross_group)
        total = received.sum(dim=0)
        if op == dist.ReduceOp.AVG:  # PyTorch's FSDP2 asks for the mean
            total /= world
        output_tensor.copy_(total)
        return work

    def _exchange(self, rows: torch.Tensor, group):
        """Row i quantized and sent to rank i of `group`: (the rows received, dequantized;
        the all-to-all's work, done)."""
        payload = quantize(rows, self.bits, self.block)
        received = torch.empty_like(payload)
        work = dist.all_to_all_single(received, payload, group=group, async_op=True)
        work.wait()
        return dequantize(received, rows.shape[1], self.bits, self.block), work
