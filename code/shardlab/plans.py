"""Which collectives one training step launches, listed before it runs, from a strategy's
options alone: the rule its card names (`StrategyCard.plan`) applied to the model.

    ddp-buckets                  DDP's buckets of `bucket_mb` (the first of
                                 `first_bucket_mb` when set), each all-reduced
    ddp-buckets-then-broadcasts  the same, then each parameter broadcast by the rank that
                                 stepped it (PyTorch's ZeroRedundancyOptimizer)
    per-parameter                one all-reduce per parameter (naive DDP)
    zero-buckets                 ZeRO-1/2's buckets, each reduce-scattered (or
                                 all-reduced), then the parameters all-gathered
    units                        ZeRO-3/FSDP2's units, each gathered in forward and in
                                 backward, its gradients reduce-scattered
    none                         nothing (one rank, or no communication)

The list is what the ledger records of a step (tests check it, `tests/test_steptime.py`),
up to where a bucket's edge falls on a parameter's border. The time model prices it
(`shardlab.steptime.predict_step`), the probes of a strategy's own work count its calls
(`shardlab.probes`), and the scaling study drives it past this machine
(`shardlab.scaling`).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from shardlab.cards import CARDS, StrategyCard
from shardlab.units import MiB
from shardlab.wrap import unit_modules


# The rules that list one step's collectives, (op, bytes of the whole tensor) in launch
# order, from a strategy's options alone; a card names its rule (`StrategyCard.plan`).
Plan = Callable[[nn.Module, list[nn.Parameter], dict, int], list[tuple[str, int]]]


def _buckets(nbytes: int, first_mb: float, mb: float) -> list[int]:
    """`nbytes` cut into buckets: the first `first_mb`, then `mb` each."""
    out, left, limit = [], nbytes, first_mb * MiB
    while left > 0:
        out.append(int(min(left, limit)))
        left -= out[-1]
        limit = mb * MiB
    return out


def _ddp_buckets(model, params, options, bytes_per_elem):
    """DDP's buckets of `bucket_mb`, all-reduced (the first of `first_bucket_mb` if set)."""
    total = sum(p.numel() for p in params) * bytes_per_elem
    mb = options.get("bucket_mb", 25.0)
    first = options.get("first_bucket_mb")
    return [("all_reduce", b) for b in _buckets(total, mb if first is None else first, mb)]


def _ddp_buckets_then_broadcasts(model, params, options, bytes_per_elem):
    """DDP's buckets, then each parameter broadcast by the rank that stepped it
    (PyTorch's ZeroRedundancyOptimizer)."""
    return (_ddp_buckets(model, params, options, bytes_per_elem)
            + [("broadcast", p.numel() * bytes_per_elem) for p in params])


def _per_parameter(model, params, options, bytes_per_elem):
    """One all-reduce per parameter (naive DDP)."""
    return [("all_reduce", p.numel() * bytes_per_elem) for p in params]


def _zero_buckets(model, params, options, bytes_per_elem):
    """ZeRO-1/2's buckets of `bucket_mb`: each reduce-scattered (or all-reduced, with
    `gradient_collective="all-reduce"`); the updated parameters all-gathered bucket by
    bucket when overlapped (as on NCCL, where "auto" is left undecided:
    `with_overlap_decided`), else in one collective (`shardlab.zero.gather`)."""
    mb = options.get("bucket_mb", 25.0)
    zero = _buckets(sum(p.numel() for p in params) * bytes_per_elem, mb, mb)
    gathers = zero if options.get("overlap_all_gather", "auto") else [sum(zero)]
    reduce = options.get("gradient_collective", "reduce-scatter").replace("-", "_")
    return [(reduce, b) for b in zero] + [("all_gather", b) for b in gathers]


def _units(model, params, options, bytes_per_elem):
    """ZeRO-3/FSDP2's units (the `wrap` option): each gathered in forward (the root
    first) and in backward (the root last), and its gradients reduce-scattered."""
    units, seen = [], set()
    for unit in unit_modules(model, options.get("wrap", "auto")):
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen |= {id(p) for p in own}
        units.append(sum(p.numel() for p in own if p.requires_grad) * bytes_per_elem)
    forward = [("all_gather", b) for b in units[::-1]]     # the root first
    backward = [("all_gather", b) for b in units]          # the root last
    return forward + backward + [("reduce_scatter", b) for b in units]


PLANS: dict[str, Plan] = {
    "none": lambda model, params, options, bytes_per_elem: [],
    "ddp-buckets": _ddp_buckets,
    "ddp-buckets-then-broadcasts": _ddp_buckets_then_broadcasts,
    "per-parameter": _per_parameter,
    "zero-buckets": _zero_buckets,
    "units": _units,
}


def timed_card(strategy: str) -> StrategyCard:
    """The card of a strategy the time model knows (one with a schedule), or a one-line
    refusal naming those it knows."""
    found = CARDS.get(strategy)
    if found is None or found.schedule is None:
        raise ValueError(f"no step-time schedule for strategy {strategy!r}; use one of "
                         f"{sorted(n for n, c in CARDS.items() if c.schedule is not None)}")
    return found


def planned_collectives(strategy: str, model: nn.Module, world: int, options: dict,
                        bytes_per_elem: int = 4) -> list[tuple[str, int]]:
    """(op, bytes of the whole tensor) of one step, in launch order, from the strategy's
    rules alone (what the ledger will record, up to buckets' edges on parameter borders):
    DDP's buckets (the first `first_bucket_mb`, then `bucket_mb`), ZeRO-1/2's buckets,
    ZeRO-3/FSDP2's units (each gathered in forward and in backward)."""
    plan = PLANS[timed_card(strategy).plan]
    if world < 2:
        return []
    params = [p for p in model.parameters() if p.requires_grad]
    return plan(model, params, options, bytes_per_elem)
