"""Which link a collective crosses, and a slow link simulated on one machine.

Past one node, a collective's cost depends on the link it runs over: NVLink inside a
node, the NICs between nodes. HSDP's point is to put its frequent collectives (the
all-gathers, the reduce-scatter) on the first, and only one all-reduce per unit and step
on the second. To show that, the ledger must say which records crossed which link, and one
machine must have a slower link to cross.

    label_link(group, "intra-node")    name the link a process group's collectives use
    per_link(records)                  the ledger's totals by link
    throttle_link(link, alpha, seconds_per_byte)     (in `shardlab.comm.ledger`)
                                       SIMULATION: make every native collective of the
                                       groups labelled `link` take rounds x (alpha +
                                       round bytes x seconds_per_byte) longer than it
                                       really does

The throttle is a simulation, and says so wherever its numbers appear: on one machine all
ranks talk through shared memory, so "inter-node" is a label plus a sleep. After the real
collective completes, the calling rank sleeps the extra α-β time of the ring on the
slower link (its rounds and bytes per round from `ring_traffic`, the rule the ledger
counts by):
a ring is as slow as its slowest hop, and every round of a ring spanning two nodes has
one hop between them. The sleep holds the calling thread, as a blocking collective does:
an asynchronous collective on a throttled group loses its overlap. Ring collectives
(`shardlab.comm.ring`, send/recv inside) are not throttled: only native ones.

A group is known by its c10d name, the same on every rank of it (`CollectiveRecord.group`).
A group with no label is "unlabelled".
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch.distributed as dist

from shardlab.comm.records import CollectiveRecord, ring_traffic, totals

UNLABELLED = "unlabelled"
INTRA, INTER = "intra-node", "inter-node"   # the two links past one node

_LINKS: dict[str, str] = {}                 # group name -> link label
_THROTTLES: dict[str, "Throttle"] = {}      # link label -> its simulated slowness


@dataclass(frozen=True)
class Throttle:
    """The extra α-β cost a simulated slow link adds to each round of a ring."""

    alpha: float              # seconds added per round
    seconds_per_byte: float   # seconds added per byte of a round (1/β of the slowdown)

    def seconds(self, op: str, numel: int, world: int, elem_size: int, rank: int = 0,
                src: int = 0) -> float:
        _, _, rounds, round_bytes = ring_traffic(op, numel, world, elem_size, rank, src)
        return rounds * (self.alpha + round_bytes * self.seconds_per_byte)


def group_name(group) -> str:
    """The name c10d gave a process group (WORLD when None): the same on every rank."""
    try:
        group = group if group is not None else dist.group.WORLD
        return str(getattr(group, "group_name", ""))
    except (RuntimeError, ValueError):  # no default group
        return ""


def label_link(group, link: str) -> None:
    """Record the collectives of `group` (None: the default group) as crossing `link`
    (UNLABELLED to forget a label: a group of all ranks that crosses nodes in one run may
    be used as the loop's own group in the next)."""
    if not isinstance(link, str) or not link:
        raise ValueError(f"a link's label must be a non-empty string, got {link!r}")
    _LINKS[group_name(group)] = link


def link_of(name: str) -> str:
    """The link label of the group named `name` (a record's `group`)."""
    return _LINKS.get(name, UNLABELLED)


def set_throttle(link: str, alpha: float = 0.0, seconds_per_byte: float = 0.0) -> Throttle:
    """Register the simulated slowness of `link` (every group labelled so);
    `shardlab.comm.throttle_link` (in the ledger, whose kernels do the sleeping) is the
    call to use."""
    if not isinstance(link, str) or not link:
        raise ValueError(f"name the link to throttle by its label (e.g. 'inter-node'), "
                         f"got {link!r}")
    for name, value in (("alpha", alpha), ("seconds_per_byte", seconds_per_byte)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    throttle = Throttle(float(alpha), float(seconds_per_byte))
    _THROTTLES[link] = throttle
    return throttle


def unthrottle_link(link: str) -> None:
    """The link's collectives run at the machine's own speed again."""
    _THROTTLES.pop(link, None)


def throttle_of(name: str) -> Throttle | None:
    """The throttle of the link that the group named `name` is labelled with, if any."""
    return _THROTTLES.get(link_of(name))


def any_throttled() -> bool:
    return bool(_THROTTLES)


def per_link(records: Iterable[CollectiveRecord]) -> dict[str, dict]:
    """{link: totals} of the records, by the link each was labelled with when it ran."""
    groups: dict[str, list] = defaultdict(list)
    for record in records:
        groups[record.link].append(record)
    return {link: totals(rs) for link, rs in groups.items()}
