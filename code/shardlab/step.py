"""One optimizer step, the same for every strategy: the course's four lines.

    loss = loss_fn(wrapped.model(x), y)
    wrapped.backward(loss)          # loss.backward(); DeepSpeed's engine runs its own
    wrapped.optimizer.step()
    wrapped.optimizer.zero_grad()

over one or more micro-batches (gradient accumulation: every micro-batch but the last
runs under `wrapped.no_sync()`, so that the gradients are reduced once, after the last).
The training loop (`shardlab.train`), the chapters' workers, the labs' graders and the
tests all call `train_step`, so a step means one thing everywhere.

What looks inside a step without changing it (the loop's clock, its memory tracker) does
so through a `StepWatch`, whose points do nothing unless a subclass asks.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Sequence

import torch

from shardlab.measure import state_bytes
from shardlab.models import loss_fn
from shardlab.strategy import Wrapped


class StepWatch:
    """The points of a step where an observer may look; here each does nothing.

    `phase` wraps "forward", "backward" and "optimizer step" (`shardlab.clock.StepClock`
    times them); `watch_backward` sees each loss before its backward; `next_forward` comes
    before every micro-batch's forward but the first; `stepped` after the optimizer step
    and before `zero_grad`, the one moment when parameters, gradients and optimizer states
    all exist (what a rank holds at its fullest between steps)."""

    def phase(self, what: str) -> ContextManager:
        return contextlib.nullcontext()

    def watch_backward(self, loss: torch.Tensor) -> None:
        pass

    def next_forward(self) -> None:
        pass

    def stepped(self) -> None:
        pass


NOTHING = StepWatch()


class HeldAfterStep(StepWatch):
    """Counts what a rank holds at its fullest between steps: `held`, the bytes of its
    model states by category (`shardlab.measure.state_bytes`), after the optimizer step
    and before `zero_grad` frees the gradients."""

    def __init__(self, wrapped: Wrapped):
        self.wrapped = wrapped
        self.held: dict[str, int] = {}

    def stepped(self) -> None:
        self.held = state_bytes(*self.wrapped.holders())


def train_step(wrapped: Wrapped, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
               loss_of: Callable[..., torch.Tensor] = loss_fn,
               watch: StepWatch = NOTHING) -> torch.Tensor:
    """One optimizer step over `micro_batches` ((x, y) pairs, read one at a time, when the
    step reaches them); return the sum of their losses, detached.

    `loss_of(output, y)` is each micro-batch's loss, scaled as the step's loss needs
    (`shardlab.models.micro_batch_loss` divides by the micro-batches or the tokens)."""
    last = len(micro_batches) - 1
    step_loss = None
    for micro, (x, y) in enumerate(micro_batches):
        if micro:
            watch.next_forward()
        else:  # the sum is held from the first forward on, as the loop always held it
            step_loss = torch.zeros((), device=x.device)
        with contextlib.nullcontext() if micro == last else wrapped.no_sync():
            with watch.phase("forward"):
                loss = loss_of(wrapped.model(x), y)
            watch.watch_backward(loss)
            with watch.phase("backward"):
                wrapped.backward(loss)
        step_loss += loss.detach()
    with watch.phase("optimizer step"):
        wrapped.optimizer.step()
    watch.stepped()
    wrapped.optimizer.zero_grad()
    return step_loss
