"""A worker for the ZeRO chapter: the schedule of one step of each stage, as a timeline.

Run by `shardlab.launch.launch` on every rank, so it lives in the package (spawned ranks
import it by name); apart from the stages because it only reads what they mark on the
step's tracer (`shardlab.trace`).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch.distributed as dist

from shardlab import trace
from shardlab.launch.devices import rank_device
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.strategy import get_strategy
from shardlab.zero.optimizer import ZeroOptimizer


def schedule_timeline(strategies: Sequence[str] = ("zero1", "zero2"), steps: int = 3,
                      bucket_numel: int = 1 << 14, model: str = "gpt-tiny",
                      batch_size: int = 8, seq_len: int = 32,
                      overlap_all_gather: bool = False) -> dict[str, list[trace.Event]]:
    """Run on every rank (with `shardlab.launch.launch`): train `steps` steps with each
    strategy and return the schedule of the last one as `shardlab.trace.Event`s (t in
    seconds from the step's start, who: the bucket, None for a whole phase): forward,
    backward, each bucket's reduce-scatter and all-gather, and the optimizer step. With
    `overlap_all_gather` the all-gathers end in the next step's forward, so that forward
    ("next forward") is recorded too, with each module's "wait for all-gather"."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    timelines = {}
    for strategy in strategies:
        wrapped = get_strategy(strategy)(build_model(model, seed=0).to(device),
                                         get_precision("fp32"),
                                         optimizer_spec("adamw", 1e-3),
                                         {"bucket_numel": bucket_numel,
                                          "overlap_all_gather": overlap_all_gather})
        zero: ZeroOptimizer = wrapped.optimizer

        def batch(i):
            return (t.to(device) for t in get_batch(i, rank, world, batch_size, seq_len))

        def train_one(i) -> float:
            x, y = batch(i)
            dist.barrier()  # start the step together, so that waits are the schedule's
            start = time.perf_counter()
            with trace.span("forward"):
                loss = loss_fn(wrapped.model(x), y)
            with trace.span("backward"):
                loss.backward()
            zero.step()
            zero.zero_grad()
            return start

        for i in range(steps - 1):
            train_one(i)
        with trace.tracing() as events:
            start = train_one(steps - 1)
            if overlap_all_gather:  # the next step's forward, where the gathers are waited for
                x, y = batch(steps)
                with trace.span("next forward"):
                    loss_fn(wrapped.model(x), y)
            zero.wait_for_params()
        timelines[strategy] = trace.relative_to(events, start)
    return timelines
