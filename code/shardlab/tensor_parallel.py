"""Tensor parallelism of one MLP, beside ZeRO-3 of the same MLP: what each one sends.

Megatron-LM (Shoeybi et al., 2019) splits a transformer's MLP across T ranks without
ever gathering its weights. The first matrix is split by its output columns, so each rank
computes f/T of the hidden units from the whole input; the second by its input rows, so
each rank turns its f/T hidden units into a partial sum of the whole output; one
all-reduce adds the partial sums. Backward needs the mirror image: the gradient of the
input is a sum over the ranks' pieces, one more all-reduce. Two autograd functions carry
this, Megatron's f and g:

    copy_to_tensor_parallel      forward: identity     backward: all-reduce
    reduce_from_tensor_parallel  forward: all-reduce   backward: identity

So a rank sends 2 all-reduces of the activations per MLP and step, 2 x 2(T-1)/T x (s·b·h)
elements, however large the weights are; ZeRO-3 sends 3(T-1)/T x Ψ_mlp (gather for forward,
gather for backward, reduce-scatter of the gradients), however many tokens there are. And
each tensor-parallel rank keeps only f/T of the hidden activations, which ZeRO-3, holding
the whole layer while it computes, does not shard.

`mlp_traffic` is the worker the composition chapter launches: for each token count it
runs both on the same MLP with the ledger on, and checks tensor parallelism against the
unsplit MLP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardlab import comm
from shardlab.launch.devices import rank_device
from shardlab.models import MLP, GPTConfig
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.strategy import get_strategy


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: every rank uses the whole input; their input gradients add up."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: the ranks' partial outputs add up; the output gradient is everyone's."""

    @staticmethod
    def forward(ctx, partial, group):
        partial = partial.contiguous()
        dist.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def check_split(ffn: int, world: int) -> None:
    if world < 1 or ffn % world:
        raise ValueError(f"tensor parallelism splits the MLP's {ffn} hidden units evenly: "
                         f"use a number of ranks that divides {ffn} (got {world})")


class TensorParallelMLP(nn.Module):
    """Rank `rank`'s part of `mlp` (fc: h -> f, proj: f -> h) split `world` ways: rows
    [r·f/T, (r+1)·f/T) of fc and the same columns of proj. The output bias is added once,
    after the all-reduce."""

    def __init__(self, mlp: MLP, rank: int, world: int, group=None):
        super().__init__()
        ffn = mlp.fc.out_features
        check_split(ffn, world)
        piece = slice(rank * ffn // world, (rank + 1) * ffn // world)
        self.group = group
        self.fc_weight = nn.Parameter(mlp.fc.weight.detach()[piece].clone())
        self.fc_bias = nn.Parameter(mlp.fc.bias.detach()[piece].clone())
        self.proj_weight = nn.Parameter(mlp.proj.weight.detach()[:, piece].clone())
        self.proj_bias = nn.Parameter(mlp.proj.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel.apply(x, self.group)
        hidden = F.gelu(F.linear(x, self.fc_weight, self.fc_bias))
        partial = F.linear(hidden, self.proj_weight)
        return _ReduceFromTensorParallel.apply(partial, self.group) + self.proj_bias


def tensor_parallel_bytes(tokens: int, hidden: int, world: int, elem_size: int = 4) -> float:
    """Bytes one rank sends per MLP and step: 2 ring all-reduces of tokens x hidden."""
    return 2 * 2 * (world - 1) / world * tokens * hidden * elem_size


def _saved_activation_bytes(module: nn.Module, run) -> tuple[torch.Tensor, int]:
    """`run()`, and the bytes of the distinct storages autograd saved in it that are not
    the module's parameters (looked up when each is saved: ZeRO-3's parameters are the
    gathered unit's views while it computes)."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in {p.untyped_storage().data_ptr()
                                      for p in module.parameters()}:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def mlp_traffic(hidden: int, tokens: list[int], seed: int = 0) -> list[dict]:
    """Worker: per token count T, one forward and backward of the same fp32 MLP
    (hidden -> 4·hidden -> hidden) split by tensor parallelism, then sharded by ZeRO-3 as
    one unit, with the ledger on. Returns, for this rank and each T: the bytes each sent
    (`tp_sent`, `zero3_sent`), the activation bytes each saved for backward
    (`tp_saved`, `zero3_saved`), and the largest difference of the tensor-parallel
    output and input gradient from the unsplit MLP's (`max_error`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    check_split(4 * hidden, world)
    torch.manual_seed(seed)
    reference = MLP(GPTConfig(d_model=hidden)).to(device)
    tp = TensorParallelMLP(reference, rank, world).to(device)
    results = []
    for T in tokens:
        g = torch.Generator().manual_seed(seed + T)
        x = torch.randn(T, hidden, generator=g, device="cpu").to(device)  # same on every rank
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref = reference(x_ref)
        out_ref.square().sum().backward()
        with comm.Ledger() as tp_ledger:
            out_tp, tp_saved = _saved_activation_bytes(tp, lambda: tp(x_tp))
            out_tp.square().sum().backward()
        error = max((out_tp - out_ref).abs().max().item(),
                    (x_tp.grad - x_ref.grad).abs().max().item())

        zero3 = get_strategy("zero3")(MLP(GPTConfig(d_model=hidden)).to(device),
                                      get_precision("fp32"), optimizer_spec("sgd", 0.0),
                                      {"wrap": "model"})
        with comm.Ledger() as zero3_ledger:
            out_z, zero3_saved = _saved_activation_bytes(zero3.model, lambda: zero3.model(x))
            out_z.square().sum().backward()
        results.append({"tokens": T, "tp_sent": comm.totals(tp_ledger.records)["sent_bytes"],
                        "zero3_sent": comm.totals(zero3_ledger.records)["sent_bytes"],
                        "tp_ops": [r.op for r in tp_ledger.records],
                        "zero3_ops": [r.op for r in zero3_ledger.records],
                        "tp_saved": tp_saved, "zero3_saved": zero3_saved,
                        "max_error": error})
    return results
