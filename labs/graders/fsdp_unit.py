"""Lab 6's grader: one FSDP unit's reshard, unshard and gradient reduce-scatter, in FSDP2's
layout, against PyTorch's `fully_shard` and the course's (`shardlab.fsdp.fully_shard`).

FSDP2 cuts each parameter along dim 0 into N chunks of ceil(d0/N) rows; rank r keeps chunk
r, its missing rows zero (padding). Your three functions, for one parameter:

    reshard(full)                -> this rank's chunk, ceil(d0/N) rows (padding rows zero)
    unshard(shard, d0)           -> the full parameter, d0 rows: all-gather, drop the padding
    reduce_scatter_grad(grad)    -> this rank's chunk of the gradient averaged over ranks

The unit is a two-layer MLP whose first dims (5 and 3) do not divide by 2 ranks, so the
padding is exercised. Checked for every parameter: your chunk against the course's
padded shard and PyTorch's local rows (`to_local()`), your unshard against PyTorch's
`full_tensor()`, your reduced gradient against the gradients both keep after backward.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardlab.fsdp import fully_shard as course_fully_shard
from graders import wrong
from graders.common import agree, call, first_difference, grade_on_ranks, run_each, show
from graders.models import batch, loss_of, uneven_mlp


def check_one(candidate: tuple) -> None:
    reshard, unshard, reduce_scatter_grad = candidate
    world, rank = dist.get_world_size(), dist.get_rank()
    model = uneven_mlp()
    torch_model, course_model = copy.deepcopy(model), copy.deepcopy(model)
    torch_fully_shard(torch_model, mesh=init_device_mesh("cpu", (world,)))
    course_fully_shard(course_model)
    x, y = batch(0, 6, 3)
    for m in (model, torch_model, course_model):
        loss_of(m, x, y).backward()
    course = dict(course_model.named_parameters())
    for (name, full), theirs in zip(model.named_parameters(), torch_model.parameters()):
        rows = theirs.to_local().shape[0]            # PyTorch's rows here (no padding)
        shard = call(f"reshard({name})", reshard, full.detach().clone())
        hints = {"got": shard, "mistakes": wrong.FSDP_UNIT,
                 "rerun": lambda answer: answer[0](full.detach().clone())}
        problem = first_difference(shard, course[name].detach(),
                                   "the course's padded shard")
        agree(problem and f"reshard({name}): {problem}", **hints)
        problem = first_difference(shard[:rows], theirs.to_local().detach(),
                                   "PyTorch's fully_shard")
        agree(problem and f"reshard({name}), PyTorch's rows: {problem}", **hints)
        gathered = call(f"unshard({name})", unshard, shard.clone(), full.shape[0])
        problem = first_difference(gathered, theirs.full_tensor().detach(),
                                   "PyTorch's full_tensor()")
        agree(problem and f"unshard({name}): {problem}", got=gathered, mistakes=wrong.FSDP_UNIT,
              rerun=lambda answer: answer[1](shard.clone(), full.shape[0]))
        reduced = call(f"reduce_scatter_grad({name})", reduce_scatter_grad,
                       full.grad.clone())
        hints = {"got": reduced, "mistakes": wrong.FSDP_UNIT, "atol": 1e-6, "rtol": 1e-5,
                 "rerun": lambda answer: answer[2](full.grad.clone())}
        problem = first_difference(reduced, course[name].grad, "the course's sharded "
                                   "gradient", atol=1e-6, rtol=1e-5)
        agree(problem and f"reduce_scatter_grad({name}): {problem}", **hints)
        problem = first_difference(reduced[:rows], theirs.grad.to_local(),
                                   "PyTorch's sharded gradient", atol=1e-6, rtol=1e-5)
        agree(problem and f"reduce_scatter_grad({name}), PyTorch's rows: {problem}", **hints)


def check(candidates: list) -> list:
    return run_each(candidates, check_one)


def grade(reshard, unshard, reduce_scatter_grad, world: int = 2) -> SimpleNamespace:
    """Grade your three functions on `world` ranks and print one line."""
    [(verdict, _)] = grade_on_ranks(check, world, [(reshard, unshard, reduce_scatter_grad)])
    return SimpleNamespace(passed=show("FSDP unit", verdict), verdict=verdict)
