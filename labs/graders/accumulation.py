"""Lab 13's grader: ZeRO-1 with PyTorch's `fully_shard`, by setting FSDP2's knobs for each
micro-batch of an optimizer step.

Your `zero1_step(model, optimizer, micro_batches)` runs one optimizer step of gradient
accumulation on the course's GPT, which PyTorch's `fully_shard` sharded block by block with
`reshard_after_forward=False` (a unit stays gathered from its forward to its backward).
ZeRO-1 gathers the parameters once a step and reduce-scatters the gradients once a step,
whatever the number of micro-batches: checked at each of 3 steps of 2 micro-batches on
ranks that train on different rows,

* the step runs one all-gather and one reduce-scatter of each unit, no more (the ledger);
* every parameter the optimizer steps, after the step, equals PyTorch's `fully_shard`
  trained with ZeRO-1's knobs (`shardlab.fsdp.strategies.RECIPES["zero1"]`, through the
  course's step).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from shardlab.comm import Ledger
from shardlab.fsdp.strategies import RECIPES
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.step import train_step
from shardlab.strategy import get_strategy
from graders import wrong
from graders.common import agree, call, first_difference, grade_on_ranks, run_each, show

STEPS, MICRO = 3, 2
UNITS = 3  # gpt-tiny's: its two blocks and the root (embeddings, final norm)
REFERENCE = "PyTorch's fully_shard with ZeRO-1's knobs"


def sharded(options: dict):
    """The GPT sharded by PyTorch's `fully_shard` (each block, then the root) under
    `options`, with AdamW over its shards, the same on every call."""
    return get_strategy("torch-fsdp2")(build_model("gpt-tiny", seed=0), get_precision("fp32"),
                                       optimizer_spec("adamw", 1e-2), options)


def micro_batches(step: int) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    return [get_batch(step, rank, world, 4 * world, 16, micro=m, micro_steps=MICRO)
            for m in range(MICRO)]


def full(wrapped) -> dict[str, torch.Tensor]:
    """The full parameters the optimizer steps (its shards, gathered), by name: what the
    next step computes with, if the model gathers them again."""
    names = [name for name, _ in wrapped.model.named_parameters()]
    shards = [p for group in wrapped.optimizer.param_groups for p in group["params"]]
    return {name: p.full_tensor().detach().clone() for name, p in zip(names, shards)}


def run(answer) -> dict:
    """Train with `answer` (a `zero1_step`): each step's full parameters and its count of
    (all-gathers, reduce-scatters)."""
    wrapped = sharded({"reshard_after_forward": False})
    params, collectives = [], []
    for step in range(STEPS):
        with Ledger() as ledger:
            call(f"step {step}: zero1_step(model, optimizer, micro_batches)", answer,
                 wrapped.model, wrapped.optimizer, micro_batches(step))
        ops = [r.op for r in ledger.records]
        collectives.append((ops.count("all_gather"), ops.count("reduce_scatter")))
        params.append(full(wrapped))
    return {"params": params, "collectives": collectives}


def reference() -> list[dict[str, torch.Tensor]]:
    wrapped = sharded(dict(RECIPES["zero1"]))
    out = []
    for step in range(STEPS):
        train_step(wrapped, micro_batches(step), lambda o, y: loss_fn(o, y) / MICRO)
        out.append(full(wrapped))
    return out


def check_one(zero1_step) -> None:
    expected = reference()
    mine = run(zero1_step)
    # the collectives first: whole counts, the same on every machine
    for step, counted in enumerate(mine["collectives"]):
        gathers, scatters = counted
        agree(None if counted == (UNITS, UNITS) else
              f"step {step}: {gathers} all-gathers and {scatters} reduce-scatters; ZeRO-1's "
              f"are {UNITS} and {UNITS} (one of each unit a step)",
              got=mine["collectives"], mistakes=wrong.ACCUMULATION,
              rerun=lambda answer: run(answer)["collectives"])
    for step, (got, want) in enumerate(zip(mine["params"], expected)):
        for name in want:
            problem = first_difference(got[name], want[name], REFERENCE, atol=1e-6,
                                       rtol=1e-5)
            agree(problem and f"step {step}, parameter {name}: {problem}", got=got[name],
                  mistakes=wrong.ACCUMULATION, atol=1e-6, rtol=1e-5,
                  rerun=lambda answer: run(answer)["params"][step][name])


def check(candidates: list) -> list:
    return run_each(candidates, check_one)


def grade(zero1_step, world: int = 2) -> SimpleNamespace:
    """Grade your `zero1_step` on `world` ranks and print one line."""
    [(verdict, _)] = grade_on_ranks(check, world, [zero1_step])
    return SimpleNamespace(passed=show("ZeRO-1 with fully_shard", verdict), verdict=verdict)
