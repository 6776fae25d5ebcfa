"""Lab 5's grader: your ZeRO-1 optimizer against PyTorch's `ZeroRedundancyOptimizer` and
the course's `Zero1Optimizer`.

Your optimizer is built as `MyZero1(params, optimizer_class, **defaults)`, like PyTorch's,
and used in the ordinary loop: `loss.backward(); opt.step(); opt.zero_grad()` with no DDP
wrapper, so `step()` itself must average the gradients across the ranks. Checked at each
of 3 AdamW steps, then of 3 SGD steps with momentum, on ranks that train on different rows:

* every parameter, after the step, equals PyTorch's (gradients averaged);
* the step reduce-scatters instead of all-reducing (no `dist.all_reduce`), and the
  optimizer state a rank holds is its shard: about 1/N of AdamW's 8 bytes per parameter
  (of SGD's 4).

SGD is there for the mean: Adam divides each update by the gradient's own scale, so a
gradient summed over the ranks instead of averaged moves Adam's parameters by the same
amount (to within its eps), and only SGD tells them apart.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardlab.step import train_step
from shardlab.strategy import Wrapped
from shardlab.zero import Zero1Optimizer
from graders import wrong
from graders.common import agree, call, first_difference, grade_on_ranks, run_each, show
from graders.ddp import _CountAllReduce
from graders.models import batch, loss_of, mean_square_error, tiny_mlp

STEPS = 3
# AdamW, the optimizer whose state ZeRO-1 shards; then SGD with momentum, whose update (unlike
# Adam's, which divides by the gradient's own scale) shows a gradient summed, not averaged.
# Each with the bytes of state it keeps per parameter (Adam's m and v; SGD's momentum).
OPTIMIZERS = (("AdamW", torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, 8),
              ("SGD", torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, 4))


def state_bytes(optimizer) -> int:
    """Bytes of optimizer state (Adam's moments) held by `optimizer` or by any
    torch.optim.Optimizer among its attributes (a wrapper's inner optimizer)."""
    found, seen = 0, set()

    def visit(obj, depth):
        nonlocal found
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            found += sum(t.numel() * t.element_size() for s in obj.state.values()
                         for k, t in s.items() if torch.is_tensor(t) and k != "step")
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
            for value in vars(obj).values():
                visit(value, depth + 1)
    visit(optimizer, 0)
    return found


def _params_after(answer, step: int, optimizer_class, defaults: dict) -> dict:
    """The parameters `answer` (a ZeRO-1 class) leaves after `step`, trained as the graded
    class is: the same model, batches and optimizer."""
    model = tiny_mlp()
    optimizer = answer(list(model.parameters()), optimizer_class, **defaults)
    for s in range(step + 1):
        x, y = batch(s, 8, 4)
        loss_of(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def check_one(my_zero1_class, steps: int = STEPS) -> None:
    for optimizer_name, optimizer_class, defaults, per_param in OPTIMIZERS:
        check_with(my_zero1_class, optimizer_name, optimizer_class, defaults, per_param, steps)


def check_with(my_zero1_class, optimizer_name: str, optimizer_class, defaults: dict,
               per_param: int, steps: int) -> None:
    world = dist.get_world_size()
    model = tiny_mlp()
    torch_model, course_model = copy.deepcopy(model), copy.deepcopy(model)
    psi = sum(p.numel() for p in model.parameters())
    settings = ", ".join(f"{k}={v}" for k, v in defaults.items())
    mine = call(f"MyZero1(params, torch.optim.{optimizer_name}, {settings})",
                lambda: my_zero1_class(list(model.parameters()), optimizer_class, **defaults))
    theirs = ZeroRedundancyOptimizer(torch_model.parameters(), optimizer_class, **defaults)
    course = Wrapped(course_model,
                     Zero1Optimizer(course_model.parameters(), optimizer_class, **defaults))
    names = [n for n, _ in model.named_parameters()]
    for step in range(steps):
        where = f"{optimizer_name} step {step}"
        x, y = batch(step, 8, 4)
        loss_of(model, x, y).backward()
        with _CountAllReduce() as counter:
            call(f"{where}: step()", mine.step)
        call(f"{where}: zero_grad()", mine.zero_grad)
        loss_of(torch_model, x, y).backward()
        for p in torch_model.parameters():   # PyTorch's shards the state only: average first
            dist.all_reduce(p.grad)
            p.grad /= world
        theirs.step()
        theirs.zero_grad()
        train_step(course, [(x, y)], mean_square_error)  # the course's: the ordinary step
        for name, p, q, r in zip(names, model.parameters(), torch_model.parameters(),
                                 course_model.parameters()):
            assert torch.allclose(q, r, atol=1e-5), "the course's ZeRO-1 differs"
            problem = first_difference(p.detach(), q.detach(),
                                       "PyTorch's ZeroRedundancyOptimizer", atol=1e-6,
                                       rtol=1e-4)
            agree(problem and f"{where}, parameter {name} after step(): {problem}",
                  got=p.detach(), mistakes=wrong.ZERO1, atol=1e-6, rtol=1e-4,
                  rerun=lambda answer: _params_after(answer, step, optimizer_class,
                                                     defaults)[name])
        agree(None if counter.calls == 0 else
              f"{where}: step() made {counter.calls} all-reduce calls; ZeRO-1 "
              f"reduce-scatters the gradients (each rank needs only its shard's average)")
        held, full = state_bytes(mine), per_param * psi
        bound = per_param * (math.ceil(psi / world) + 64)   # a shard, and a little padding
        agree(None if held <= bound or world == 1 else
              f"{where}: holds {held:,} B of optimizer state; {optimizer_name}'s full "
              f"state is {full:,} B and a 1/{world} shard about {full // world:,} B")


def check(candidates: list) -> list:
    return run_each(candidates, check_one)


def grade(my_zero1_class, world: int = 2) -> SimpleNamespace:
    """Grade your ZeRO-1 optimizer class on `world` ranks and print one line."""
    [(verdict, _)] = grade_on_ranks(check, world, [my_zero1_class])
    return SimpleNamespace(passed=show("ZeRO-1 optimizer", verdict), verdict=verdict)
