"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients too.

Data parallelism keeps on every rank the same three things: the parameters, their
gradients and the optimizer state. Only the parameters are needed everywhere (every rank
runs the whole forward and backward). ZeRO (Rajbhandari et al., 2020) keeps them whole
and splits the rest N ways:

    stage 1  each rank keeps the optimizer state (the fp32 master copy and Adam's m and v
             in mixed precision) of 1/N of the parameters; gradients stay whole.
    stage 2  the gradients are split too: during backward, as soon as a bucket of
             gradients is complete it is reduce-scattered and the full gradients are freed.

Both move 2 psi logical bytes per step (psi in the communicated dtype), as much as DDP's
all-reduce. One optimizer, `ZeroOptimizer(params, torch.optim.AdamW, stage=1)`, made of
parts that each own their state, a file per idea:

    layout.py      which elements of which parameters each bucket holds and each rank
                   owns: buckets of whole parameters, each padded and cut N ways
    flat.py        the flat buffer per parameter group the model's parameters view
    stage1.py      `StepReducer`: gradients whole, reduce-scattered in `step()`
    stage2.py      `BackwardReducer`: gradients reduce-scattered bucket by bucket in backward
    gather.py      `ParamAllGather`: the parameters' all-gather, plain or overlapped with
                   the next forward
    optimizer.py   `ZeroOptimizer` (and `Zero1Optimizer`, `Zero2Optimizer`, its stages by
                   name): the step on this rank's chunks, the torch.optim face
    strategies.py  the strategies `zero1` and `zero2`, and their options
    torch_ref.py   PyTorch's ZeroRedundancyOptimizer as the reference `torch-zero1`
    timeline.py    `schedule_timeline`, the worker behind the chapter's timelines
"""

from shardlab.zero.flat import FlatGroup, flatten_into_buckets
from shardlab.zero.gather import ParamAllGather
from shardlab.zero.layout import (Bucket, bucket_numel_for, check_bucket_mb, check_bucket_numel,
                                  fill_buckets, in_backward_order, in_forward_order,
                                  padded_size, split_groups)
from shardlab.zero.optimizer import Zero1Optimizer, Zero2Optimizer, ZeroOptimizer
from shardlab.zero.stage1 import StepReducer
from shardlab.zero.stage2 import BackwardReducer
from shardlab.zero.strategies import ZERO_OPTIONS, wrap_zero1, wrap_zero2
from shardlab.zero.timeline import schedule_timeline
from shardlab.zero.torch_ref import TORCH_ZERO1_OPTIONS, TorchZero1, wrap_torch_zero1

__all__ = ["ZERO_OPTIONS", "TORCH_ZERO1_OPTIONS", "padded_size", "Bucket", "fill_buckets",
           "in_forward_order", "in_backward_order", "FlatGroup", "flatten_into_buckets",
           "split_groups", "check_bucket_numel", "check_bucket_mb", "bucket_numel_for",
           "ZeroOptimizer", "Zero1Optimizer", "Zero2Optimizer", "StepReducer",
           "BackwardReducer", "ParamAllGather", "wrap_zero1", "wrap_zero2", "TorchZero1",
           "wrap_torch_zero1", "schedule_timeline"]
