"""What a gradient reduction loses in bf16: the same gradients summed over N ranks by a
ring's reduce-scatter in bf16 and in fp32, and accumulated over micro-batches in a bf16 or
an fp32 gradient, each set against the exact sum (fp64).

A ring's reduce-scatter (`shardlab.comm.ring.ring_reduce_scatter`) sums each chunk in ring
order: the partial sum of chunk c leaves rank c+1, every rank on the way adds its own
chunk to what arrives from its left, in the dtype of the tensor, and rank c adds last. So
chunk c's sum is ((g[c+1] + g[c+2]) + g[c+3]) + ... + g[c], rounded to that dtype after
every addition: N - 1 roundings, each of the partial sum so far. `ring_sum` applies that
arithmetic in one process, in the same order (the test checks it against the ring on gloo
ranks, bit for bit), so N = 64 ranks cost no launch. A bf16 add keeps 8 significant bits
(unit roundoff 2^-8, 3.9e-3), fp32 24 (2^-24, 6.0e-8): in bf16 the rounding error grows
with the number of additions, N - 1 per reduction and M - 1 per accumulation of M
micro-batches.

Which dtype each system reduces and accumulates in by default, with its source, is
`DEFAULT_REDUCE_DTYPES` (a table a chapter can print).

    >>> grads = model_gradients("gpt-tiny", ranks=64, micro_batches=4)
    >>> rows = reduction_errors(grads, ranks=(2, 4, 8, 16, 32, 64))
    >>> shardlab.viz.reduction_precision_figure(rows)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# (accumulate, reduce): in which dtype micro-batch gradients are summed on a rank, then in
# which dtype the ranks' gradients are summed
CASES = (("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "fp32"), ("bf16", "bf16"))
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp32": 2.0 ** -24}


def ring_sum(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum over ranks of `grads` (shape [N, L], one row per rank) as a ring's
    reduce-scatter computes it in `dtype`, then gathered: the L elements are padded to N
    chunks of ceil(L/N), chunk c summed from rank c+1 round the ring to rank c, each
    partial sum rounded to `dtype` (what `ring_reduce_scatter` does on each rank)."""
    if grads.dim() != 2 or grads.shape[0] < 1:
        raise ValueError(f"grads must be [ranks, elements], got shape {tuple(grads.shape)}")
    world, numel = grads.shape
    chunk = -(-numel // world)
    padded = torch.zeros(world, world * chunk, dtype=dtype, device=grads.device)
    padded[:, :numel] = grads.to(dtype)
    pieces = padded.view(world, world, chunk)          # [rank, chunk index, elements]
    chunks = torch.arange(world, device=grads.device)
    total = pieces[(chunks + 1) % world, chunks].clone()  # each chunk leaves rank c+1
    for k in range(2, world + 1):                      # ... and rank c+k adds its own
        total = total + pieces[(chunks + k) % world, chunks]
    return total.reshape(-1)[:numel]


def accumulate(micro_grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A rank's gradient after M micro-batches (`micro_grads`: [M, L], or [N, M, L] for N
    ranks at once) accumulated in `dtype`, as autograd does into `.grad`: each
    micro-batch's gradient arrives in that dtype (a bf16 model's backward produces bf16)
    and is added in it, in order."""
    total = micro_grads.select(-2, 0).to(dtype)
    for m in range(1, micro_grads.shape[-2]):
        total = total + micro_grads.select(-2, m).to(dtype)
    return total


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact||, in fp64."""
    exact = exact.double()
    return float((approx.double() - exact).norm() / exact.norm())


@dataclass(frozen=True)
class ReductionError:
    ranks: int
    accumulate: str   # "fp32" or "bf16": the dtype of each rank's gradient over micro-batches
    reduce: str       # "fp32" or "bf16": the dtype of the reduction over ranks
    error: float      # relative L2 error of the summed gradient against fp64


def reduction_errors(grads: torch.Tensor, ranks=(2, 4, 8, 16, 32, 64),
                     cases=CASES) -> list[ReductionError]:
    """For each N in `ranks` and each (accumulate, reduce) case: the relative error of the
    gradient summed over the first N ranks' rows of `grads` ([ranks, micro-batches,
    elements], fp32) against the exact sum. Summed, not averaged: dividing by a power of
    two changes no relative error."""
    if grads.dim() != 3:
        raise ValueError(f"grads must be [ranks, micro_batches, elements], got shape "
                         f"{tuple(grads.shape)}")
    if max(ranks) > grads.shape[0] or min(ranks) < 1:
        raise ValueError(f"ranks must lie in 1..{grads.shape[0]} (the rows of grads), "
                         f"got {tuple(ranks)}")
    bad = {c for case in cases for c in case} - set(DTYPES)
    if bad:
        raise ValueError(f"cases name dtypes {sorted(bad)}; use {sorted(DTYPES)}")
    rows = []
    for n in ranks:
        exact = grads[:n].double().sum(dim=(0, 1))
        for acc, red in cases:
            per_rank = accumulate(grads[:n], DTYPES[acc])
            rows.append(ReductionError(n, acc, red,
                                       relative_error(ring_sum(per_rank, DTYPES[red]), exact)))
    return rows


def model_gradients(model: str = "gpt-tiny", ranks: int = 64, micro_batches: int = 4,
                    batch_size: int = 2, seq_len: int = 32, seed: int = 0) -> torch.Tensor:
    """Real gradients to reduce: the fp32 gradient of `model` on `ranks` x `micro_batches`
    different micro-batches of the course's data (`models.get_batch`, each rank's rows of
    each step), every parameter flattened into one row: [ranks, micro_batches, Ψ]."""
    from shardlab.models import build_model, get_batch, loss_fn

    net = build_model(model, seed)
    params = [p for p in net.parameters() if p.requires_grad]
    out = torch.empty(ranks, micro_batches, sum(p.numel() for p in params),
                      device=params[0].device)
    for rank in range(ranks):
        for micro in range(micro_batches):
            x, y = get_batch(0, rank, ranks, batch_size * ranks * micro_batches, seq_len,
                             seed, micro, micro_batches)
            net.zero_grad(set_to_none=True)
            loss_fn(net(x), y).backward()
            out[rank, micro] = torch.cat([p.grad.reshape(-1) for p in params])
    return out


# ----------------------------------------------------------------------------- defaults


@dataclass(frozen=True)
class ReduceDefault:
    system: str
    setting: str       # the knob, as the system names it
    reduce: str        # the dtype its gradients are reduced in under bf16 training
    accumulate: str    # the dtype they are accumulated in over micro-batches
    source: str        # where it is decided, a file of the system


DEFAULT_REDUCE_DTYPES = (
    ReduceDefault("Megatron-LM (--bf16)", "accumulate_allreduce_grads_in_fp32", "fp32", "fp32",
                  "megatron/training/arguments.py: with --bf16 it is set True unless "
                  "--grad-reduce-in-bf16 (\"bfloat16 requires gradient accumulation and "
                  "all-reduce to be done in fp32\"); the main_grad buffers are fp32"),
    ReduceDefault("Megatron Core DDP, used directly", "DistributedDataParallelConfig."
                  "grad_reduce_in_fp32", "param dtype (bf16)", "param dtype (bf16)",
                  "megatron/core/distributed/distributed_data_parallel_config.py: "
                  "grad_reduce_in_fp32 = False"),
    ReduceDefault("torchtitan (FSDP2)", "training.mixed_precision_reduce", "fp32", "fp32",
                  "torchtitan/config/job_config.py: mixed_precision_reduce = \"float32\" "
                  "(param dtype bfloat16), passed to fully_shard's MixedPrecisionPolicy"),
    ReduceDefault("PyTorch FSDP2 fully_shard", "MixedPrecisionPolicy.reduce_dtype",
                  "param_dtype (bf16 with param_dtype=bf16)", "reduce_dtype",
                  "torch/distributed/fsdp/_fully_shard/_fsdp_api.py: reduce_dtype = None, "
                  "\"If this is None but param_dtype is not None, then the reduction uses "
                  "the compute dtype\""),
    ReduceDefault("PyTorch AMP (torch.autocast) + DDP", "(parameters stay fp32)", "fp32",
                  "fp32", "torch/amp/autocast_mode.py: the model is created in default "
                  "precision and autocast casts ops' inputs, not parameters, so .grad and "
                  "DDP's buckets (the parameters' dtype) are fp32"),
    ReduceDefault("PyTorch DDP on a bf16 model", "(the parameters' dtype)", "bf16", "bf16",
                  "torch/nn/parallel/distributed.py: the buckets take the gradients' dtype, "
                  "the parameters'"),
    ReduceDefault("DeepSpeed ZeRO-1/2 (bf16 enabled)", "communication_data_type",
                  "bf16", "bf16 (grad_accum_dtype = model dtype)",
                  "deepspeed/runtime/engine.py: communication_data_type None -> bf16 when "
                  "bf16 is enabled; get_data_types: grad_accum_dtype None -> the model's "
                  "dtype (deepspeed/runtime/constants.py GRAD_ACCUM_DTYPE_DEFAULT = None)"),
    ReduceDefault("this course, bf16-mixed", "precision='bf16-mixed' (2+2+K)",
                  "bf16 in ddp, zero1-3; fp32 in fsdp2, torch-fsdp2 (option reduce_dtype)",
                  "bf16", "shardlab/precision.py (bf16 parameters and gradients, fp32 "
                  "masters); the flat buffers of shardlab/zero and shardlab/zero3.py take "
                  "the parameters' dtype; shardlab/fsdp/strategies.py FSDP2_OPTIONS "
                  "reduce_dtype='fp32'"),
)


def defaults_table() -> list[tuple[str, str, str, str, str]]:
    """(system, setting, reduce dtype, accumulate dtype, source) per row of
    `DEFAULT_REDUCE_DTYPES`, for a chapter's table."""
    return [(d.system, d.setting, d.reduce, d.accumulate, d.source)
            for d in DEFAULT_REDUCE_DTYPES]
