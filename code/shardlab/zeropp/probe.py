"""What each of ZeRO++'s quantizations costs in accuracy, measured on the ranks.

`quantization_errors` runs on every rank of a launch: it builds the course's GPT, runs one
forward and backward on this rank's rows, then moves the real weights and the real
gradients both ways, exactly and quantized, through the same collectives `zeropp` uses:

    qwZ   the flat fp32 weights, this rank's 1/N shard, all-gathered in int8 and in fp32
    qgZ   the flat gradients (N rows, one a rank), reduce-scattered in int4 by the two
          all-to-alls and in fp32 by a reduce-scatter

and returns each relative error ||x' - x|| / ||x|| (over every rank, from an all-reduce of
the squared norms). Block quantization bounds each element's error by half a step,
|x - x'| <= max|block| / (2 q_max); the norms say how much of that a real tensor pays.
hpZ moves the weights it already holds, bit for bit: no error to measure.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardlab.comm.compat import all_gather_into, reduce_scatter_into
from shardlab.launch.devices import rank_device
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.zeropp.collectives import QuantizedAllGather, QuantizedReduceScatter
from shardlab.zeropp.quantize import dequantize, quantize
from shardlab.zeropp.strategy import zeropp_groups


def _relative(error_sq: float, norm_sq: float) -> float:
    total = torch.tensor([error_sq, norm_sq], dtype=torch.float64, device=rank_device())
    dist.all_reduce(total)
    return math.sqrt(total[0] / total[1]) if total[1] > 0 else 0.0


def quantization_errors(node_size: int, model: str = "gpt-tiny", batch_size: int = 16,
                        seq_len: int = 32, weight_block: int = 2048,
                        gradient_block: int = 2048, seed: int = 0) -> dict[str, float]:
    """{"qwz": relative error of the weights gathered in int8, "qgz": of the gradients
    reduced in int4 by two hops, "qgz_one_hop": of one quantization of a rank's own
    gradient in int4 (the first hop's alone)}, on this launch's ranks in nodes of
    `node_size`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone, node, cross = zeropp_groups(node_size)
    device = rank_device()  # NCCL moves only tensors on the rank's GPU
    net = build_model(model, seed).to(device)
    x, y = (t.to(device) for t in get_batch(0, rank, world, batch_size, seq_len, seed))
    loss_fn(net(x), y).backward()
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    size = -(-weights.numel() // world)
    padded = torch.zeros(world * size, device=device)
    padded[:weights.numel()] = weights
    shard = padded.view(world, size)[rank].clone()
    exact = torch.empty(world * size, device=device)
    quantized = torch.empty_like(exact)
    all_gather_into(exact, shard, group=everyone)
    QuantizedAllGather(8, weight_block)(output_tensor=quantized, input_tensor=shard,
                                        group=everyone)
    out = {"qwz": _relative((quantized - exact).square().sum().item() if rank == 0 else 0.0,
                            exact.square().sum().item() if rank == 0 else 0.0)}

    full = torch.zeros(world * size, device=device)
    full[:grads.numel()] = grads
    exact, quantized = torch.empty(size, device=device), torch.empty(size, device=device)
    reduce_scatter_into(exact, full.clone(), group=everyone)
    QuantizedReduceScatter(node, cross, 4, gradient_block)(
        output_tensor=quantized, input_tensor=full.clone(), group=everyone)
    out["qgz"] = _relative((quantized - exact).square().sum().item(),
                           exact.square().sum().item())
    rows = full.view(world, size)
    once = dequantize(quantize(rows, 4, gradient_block), size, 4, gradient_block)
    out["qgz_one_hop"] = _relative((once - rows).square().sum().item(),
                                   rows.square().sum().item())
    return out
