"""Rank workers for tests/test_stepparts.py: how a strategy calls torch.distributed's
collectives."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

# torch.distributed's collective functions, the names of this torch and of older ones
WATCHED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
           "reduce_scatter_tensor", "all_reduce", "broadcast")


def returned_work(strategies: list[str], model: str = "gpt-tiny") -> dict:
    """Run on every rank: for each strategy, one training step with torch.distributed's
    collective functions watched, and for every call the strategy makes through them,
    (function, whether it returned a Work). A call that returns None was made with
    async_op=False, and on gloo it returns once its collective is done: the calling thread
    waited it. A call made inside another watched one is not counted twice."""
    from shardlab.models import build_model, get_batch
    from shardlab.optimizers import OptimizerSpec
    from shardlab.precision import get_precision
    from shardlab.step import train_step
    from shardlab.strategy import get_strategy
    calls: list[tuple[str, bool]] = []
    depth = [0]

    def watched(name, function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            depth[0] += 1
            try:
                out = function(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                calls.append((name, out is not None))
            return out
        return call

    originals = {name: getattr(dist, name) for name in WATCHED if hasattr(dist, name)}
    x, y = get_batch(0, dist.get_rank(), dist.get_world_size(), 4, 16)
    out = {}
    for strategy in strategies:
        wrapped = get_strategy(strategy)(build_model(model, 0), get_precision("fp32"),
                                         OptimizerSpec(torch.optim.SGD, {"lr": 0.1}), {})
        calls.clear()
        for name, function in originals.items():
            setattr(dist, name, watched(name, function))
        try:
            train_step(wrapped, [(x, y)])
        finally:
            for name, function in originals.items():
                setattr(dist, name, function)
        out[strategy] = list(calls)
    return out
