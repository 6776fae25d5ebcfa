"""Lab 4's grader: your DDP with bucketed, overlapped all-reduce, against PyTorch's
`DistributedDataParallel` and the course's `BucketedDataParallel`.

Your wrapper is a module: `MyDDP(module, bucket_mb)`; after `loss.backward()` the grader
calls its `finish_gradient_synchronization()` (if it has one), then an SGD step. Checked at
each of 3 steps, on ranks that train on different rows:

* every gradient equals PyTorch's DDP's (the average over the ranks);
* the all-reduce calls of a step are one per bucket, as the course's `make_buckets` cuts
  the parameters (last to first, a new bucket when the next one would pass `bucket_mb`);
* some all-reduce starts before backward has produced its last gradient (the first
  layer's weight): the buckets overlap the backward pass.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardlab.ddp import BucketedDataParallel, make_buckets
from graders import wrong
from graders.common import agree, call, first_difference, grade_on_ranks, run_each, show
from graders.models import batch, loss_of, tiny_mlp

BUCKET_MB = 0.001   # 1,048 bytes: the tiny model's six tensors fall into 3 buckets
STEPS = 3


class _CountAllReduce:
    """Count `dist.all_reduce` calls while the graded code runs backward."""

    def __enter__(self):
        self.calls, self.original = 0, dist.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.original


def _grads_at(answer, step: int, bucket_mb: float) -> dict[str, torch.Tensor]:
    """The gradients `answer` (a DDP class) leaves at `step`, trained as the graded class is:
    the same model, batches and SGD steps."""
    model = tiny_mlp()
    wrapped = answer(model, bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(step + 1):
        x, y = batch(s, 8, 4)
        loss_of(wrapped, x, y).backward()
        finish = getattr(wrapped, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()
        if s < step:
            optimizer.step()
            optimizer.zero_grad()
    return {n: p.grad for n, p in model.named_parameters()}


def check_one(my_ddp_class, bucket_mb: float = BUCKET_MB, steps: int = STEPS) -> None:
    model = tiny_mlp()
    torch_model, course_model = copy.deepcopy(model), copy.deepcopy(model)
    mine = call(f"{getattr(my_ddp_class, '__name__', 'your class')}(model, {bucket_mb})",
                my_ddp_class, model, bucket_mb)
    theirs = DistributedDataParallel(torch_model)
    ours = BucketedDataParallel(course_model, bucket_mb, bucket_mb)
    buckets = len(make_buckets([p for p in model.parameters()], bucket_mb, bucket_mb))
    names = [n for n, _ in model.named_parameters()]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1)
                  for m in (model, torch_model, course_model)]
    last_grad = model[0].weight          # backward produces the first layer's last
    for step in range(steps):
        x, y = batch(step, 8, 4)
        with _CountAllReduce() as counter:
            seen = {}

            def note_calls(_):
                seen.setdefault("before_last", counter.calls)
            hook = last_grad.register_post_accumulate_grad_hook(note_calls)
            call(f"step {step}: backward", lambda: loss_of(mine, x, y).backward())
            hook.remove()
            finish = getattr(mine, "finish_gradient_synchronization", None)
            if finish is not None:
                call(f"step {step}: finish_gradient_synchronization", finish)
        loss_of(theirs, x, y).backward()
        loss_of(ours, x, y).backward()
        for name, p, q, r in zip(names, model.parameters(), torch_model.parameters(),
                                 course_model.parameters()):
            assert torch.allclose(q.grad, r.grad, atol=1e-6), "course's DDP differs"
            problem = first_difference(p.grad, q.grad, "PyTorch's DDP", atol=1e-6, rtol=1e-5)
            agree(problem and f"step {step}, gradient of {name}: {problem}", got=p.grad,
                  mistakes=wrong.DDP, atol=1e-6, rtol=1e-5,
                  rerun=lambda answer: _grads_at(answer, step, bucket_mb)[name])
        agree(None if counter.calls == buckets else
              f"step {step}: {counter.calls} all-reduce calls, one per bucket of "
              f"{bucket_mb} MB is {buckets} (the course's make_buckets)")
        agree(None if seen.get("before_last", 0) > 0 else
              f"step {step}: no all-reduce started before backward's last gradient "
              f"({names[0]}): start each bucket's (async_op=True) from a gradient hook")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def check(candidates: list) -> list:
    return run_each(candidates, check_one)


def grade(my_ddp_class, world: int = 2) -> SimpleNamespace:
    """Grade your DDP class on `world` ranks and print one line."""
    [(verdict, _)] = grade_on_ranks(check, world, [my_ddp_class])
    return SimpleNamespace(passed=show("bucketed DDP", verdict), verdict=verdict)
