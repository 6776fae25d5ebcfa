"""The strategies `zero1` and `zero2`: a model and an optimizer spec in, the contract out.

Apart from the optimizers because a strategy is a recipe over them (check the options,
cast the model, build the stage's optimizer, say how the full parameters and the checkpoint
pieces are read), the part every strategy of the course writes the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardlab.buckets import DEFAULT_BUCKET_MB
from shardlab.optimizers import OptimizerSpec, WholeMatrixSpec
from shardlab.precision import Precision
from shardlab.steptime import overlaps_beside_compute
from shardlab.strategy import (Wrapped, cast_model, check_options, check_same_on_all_ranks,
                               named_full_parameters)
from shardlab.zero.layout import (check_bucket_mb, check_bucket_numel,
                                  check_gradient_collective)
from shardlab.zero.optimizer import ZeroOptimizer

# Options of wrap_zero1 / wrap_zero2, with their defaults.
ZERO_OPTIONS: dict[str, Any] = {
    # MB (2**20 bytes) of parameters per bucket (see shardlab.buckets).
    "bucket_mb": DEFAULT_BUCKET_MB,
    # The same size in elements instead (the earlier spelling); give one or the other.
    "bucket_numel": None,
    # Hide the parameters' all-gather behind the optimizer step and the next forward, one
    # all-gather per bucket (True), or gather them all in one after the step (False).
    # "auto": where the backend's collectives run beside the compute, NCCL, not gloo
    # (`steptime.overlaps_beside_compute`, measured by benchmarks/bench_overlap.py).
    "overlap_all_gather": "auto",
    # How each bucket's gradients are reduced: "reduce-scatter" (each rank receives only
    # its chunk) or "all-reduce" (every rank receives the sum and keeps its chunk, twice
    # the bytes on a ring: DeepSpeed's default for its stages 1 and 2). On gloo, whose
    # reduce-scatter clones the bucket, all-reduces the clone and copies this rank's chunk
    # out (`ProcessGroupGloo::reduce_scatter_tensor_coalesced`), "all-reduce" moves the
    # same bytes without the clone (benchmarks/bench_overlap.py --vary gradient_collective).
    "gradient_collective": "reduce-scatter",
    # None (one group: all trainable parameters) or a function model -> parameter groups
    # (a list of dicts, as for any torch.optim optimizer).
    "param_groups": None,
}


def _wrap_zero(stage: int, model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
               options: dict) -> Wrapped:
    opts = check_options(f"zero{stage}", options, ZERO_OPTIONS)
    if "bucket_mb" in options and "bucket_numel" in options:
        raise ValueError("give the bucket size once: bucket_mb (MB) or bucket_numel "
                         "(elements), not both")
    if opts["bucket_numel"] is not None:
        check_bucket_numel(opts["bucket_numel"])
    else:
        check_bucket_mb(opts["bucket_mb"])
    overlap = opts["overlap_all_gather"]
    if not (isinstance(overlap, bool) or overlap == "auto"):
        raise ValueError(f"overlap_all_gather must be True, False or \"auto\", got "
                         f"{overlap!r}")
    check_gradient_collective(opts["gradient_collective"])
    if opts["param_groups"] is not None and not callable(opts["param_groups"]):
        raise ValueError(f"param_groups must be None or a function model -> list of "
                         f"parameter groups, got {type(opts['param_groups']).__name__}")
    check_same_on_all_ranks(list(model.named_parameters()))
    if overlap == "auto":
        overlap = overlaps_beside_compute(dist.get_backend())
    model = cast_model(model, precision)
    params = opts["param_groups"](model) if opts["param_groups"] else model.parameters()
    build = None
    if isinstance(optimizer, WholeMatrixSpec):
        if opts["param_groups"] is not None:
            raise ValueError(f"{optimizer.name} makes its own parameter groups (Muon's "
                             f"matrices, AdamW's rest): leave param_groups unset")
        params, build = optimizer.param_groups(model.parameters()), optimizer.build
    zero = ZeroOptimizer(
        params, optimizer.cls, stage=stage, master_weights=precision.master_weights,
        bucket_mb=opts["bucket_mb"], bucket_numel=opts["bucket_numel"],
        overlap_all_gather=overlap, module=model,
        param_order=[p for p in model.parameters() if p.requires_grad],
        clip=optimizer.clipper(sharded=True), build=build,
        gradient_collective=opts["gradient_collective"], **optimizer.kwargs)

    def full_parameters() -> dict[str, torch.Tensor]:
        zero.wait_for_params()
        return named_full_parameters(model)

    # no_sync is not needed: stage 1 reduces only in step(), so micro-batches accumulate
    # locally; stage 2 reduces every micro-batch and accumulates into the shard.
    return Wrapped(model, zero, full_parameters=full_parameters,
                   pieces=lambda: zero.pieces(model), after_load=zero.all_gather_all,
                   settle=zero.wait_for_params, clip=zero.clip)


def wrap_zero1(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
               options: dict) -> Wrapped:
    """ZeRO-1: optimizer state sharded 1/N; gradients reduce-scattered in step()."""
    return _wrap_zero(1, model, precision, optimizer, options)


def wrap_zero2(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
               options: dict) -> Wrapped:
    """ZeRO-2: optimizer state and gradients sharded 1/N; buckets reduce-scattered
    during backward."""
    return _wrap_zero(2, model, precision, optimizer, options)

