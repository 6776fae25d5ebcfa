"""Workers for test_trace.py: they must live in an importable module."""

from __future__ import annotations

import torch.distributed as dist

from shardlab import trace
from shardlab.clock import StepClock
from shardlab.launch import rank_device
from shardlab.models import build_model, get_batch
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.step import StepWatch, train_step
from shardlab.strategy import get_strategy


class Clocked(StepWatch):
    """The loop's clock around the step's phases, as the training loop times them."""

    def __init__(self):
        self.clock = StepClock()

    def phase(self, what: str):
        return self.clock.phase(what)

    def watch_backward(self, loss) -> None:
        self.clock.watch_backward(loss)


def one_traced_step(cases: list[tuple[str, dict]]) -> list[dict]:
    """For each (strategy, options): a step with no trace open, then one inside a trace,
    both timed by the loop's clock. Returns the traced step's events and what the clock
    kept of each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for strategy, options in cases:
        wrapped = get_strategy(strategy)(build_model("gpt-tiny", seed=0).to(rank_device()),
                                         get_precision("fp32"), optimizer_spec("adamw", 1e-3),
                                         dict(options))
        batches = [[tuple(t.to(rank_device()) for t in get_batch(s, rank, world, 8, 32))]
                   for s in range(2)]
        untraced, traced = Clocked(), Clocked()
        train_step(wrapped, batches[0], watch=untraced)
        with trace.tracing() as events:
            train_step(wrapped, batches[1], watch=traced)
        getattr(wrapped.optimizer, "wait_for_params", lambda: None)()
        out.append({"strategy": strategy, "events": list(events),
                    "phases": [untraced.clock.spans, traced.clock.spans]})
    return out
