"""Workers of tests/test_fsdp_knobs.py and tests/test_zeropp.py: many cases per launch.

`knob_cases` trains each case (a strategy, its options, micro-batches) through the course's
step, and returns what the tests compare: each step's global loss, the ledger's records
of each step (op, group size, elements, dtype, link, bytes sent), the bytes held between
micro-batches on the last step, and for a case with `same_as`, the largest
difference from that case's losses and full parameters over every step. `order` records
one steady step's events in order (the units' forward and backward, the collectives), as
`sharded_workers.gather_order` does for the defaults.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext

import torch.distributed as dist

from sharded_workers import OPTIMIZERS
from shardlab.comm import Ledger
from shardlab.measure import track_peak
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.precision import get_precision
from shardlab.step import NOTHING, StepWatch, train_step
from shardlab.strategy import get_strategy
from shardlab.wrap import unit_modules


class _Between(StepWatch):
    """Hands the tracked step's `next_forward` to the memory tracker."""

    def __init__(self, peak):
        self.peak = peak

    def next_forward(self) -> None:
        self.peak.next_forward()


def _hooks(model, events: list) -> None:
    names = {id(m): name or "root" for name, m in model.named_modules()}
    for unit in unit_modules(model, "auto"):
        name = names[id(unit)]
        unit.register_forward_pre_hook(
            lambda m, args, name=name: events.append((time.perf_counter(), "forward", name)))
        if unit is not model:  # the root's input (token ids) takes no gradient
            unit.register_full_backward_pre_hook(
                lambda m, grad, name=name: events.append((time.perf_counter(), "backward",
                                                          name)))


def knob_cases(cases: list[dict], steps: int = 4, batch_size: int = 8,
               seq_len: int = 16) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    runs, out = [], []
    for case in cases:
        micro = case.get("grad_accum", 1)
        model = build_model("gpt-tiny", seed=0)
        psi = sum(p.numel() for p in model.parameters())
        events: list = []
        if case.get("order"):
            _hooks(model, events)
        wrapped = get_strategy(case["strategy"])(
            model, get_precision(case.get("precision", "fp32")), OPTIMIZERS["adamw"],
            copy.deepcopy(case.get("options", {})))
        losses, params, ledgers, between, order = [], [], [], 0, []
        for step in range(steps):
            batches = [get_batch(step, rank, world, batch_size, seq_len, micro=m,
                                 micro_steps=micro) for m in range(micro)]
            events.clear()
            last = step == steps - 1
            with Ledger() as ledger, \
                    track_peak(*wrapped.holders()) if last else nullcontext() as peak:
                loss = train_step(wrapped, batches, lambda o, y: loss_fn(o, y) / micro,
                                  _Between(peak) if last and micro > 1 else NOTHING)
            ledgers.append([(r.op, r.world, r.numel, str(r.dtype), r.link, r.sent_bytes,
                             r.start) for r in ledger.records])
            between = peak.between if last else between
            if step == 1 and case.get("order"):
                timeline = events + [(r[-1], r[0], "") for r in ledgers[-1]]
                order = [(what, who) for _, what, who in sorted(timeline)]
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world)
            if "same_as" in case or case.get("keep"):
                params.append({k: v.float() for k, v in wrapped.full_parameters().items()})
        runs.append(params)
        result = {"case": case, "losses": losses, "psi": psi, "between": between,
                  "ledgers": [[r[:-1] for r in step] for step in ledgers], "order": order}
        if "same_as" in case:
            other = out[case["same_as"]]
            result["loss_diff"] = max(abs(a - b) for a, b in zip(losses, other["losses"]))
            result["param_diff"] = max(max((p[k] - q[k]).abs().max().item() for k in q)
                                       for p, q in zip(params, runs[case["same_as"]]))
        out.append(result)
    return out


def refusals() -> dict[str, str]:
    """What each FSDP2 refuses, in one line, ours beside PyTorch's where PyTorch refuses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardlab.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out = {}

    def said(key, call):
        try:
            call()
            out[key] = ""
        except (ValueError, TypeError) as refused:
            out[key] = f"{type(refused).__name__}: {refused}"

    bad = world + 1 if world > 2 else 3
    said("ours int", lambda: fully_shard(build_model("gpt-tiny"), reshard_after_forward=bad))
    said("torch int", lambda: torch_fully_shard(build_model("gpt-tiny"), mesh=mesh,
                                                reshard_after_forward=bad))
    said("ours float", lambda: fully_shard(build_model("gpt-tiny"), reshard_after_forward=0.5))
    said("torch float", lambda: torch_fully_shard(build_model("gpt-tiny"), mesh=mesh,
                                                  reshard_after_forward=0.5))
    ours = fully_shard(build_model("gpt-tiny"))
    theirs = torch_fully_shard(build_model("gpt-tiny"), mesh=mesh)
    said("ours set int", lambda: ours.set_reshard_after_forward(2))
    said("torch set int", lambda: theirs.set_reshard_after_forward(2))
    said("ours all-reduce", lambda: ours.set_requires_all_reduce(False))
    # PyTorch's (torch 2.13) sets a flag that a 1-D mesh never reads: no refusal
    said("torch all-reduce", lambda: theirs.set_requires_all_reduce(False))
    return out
