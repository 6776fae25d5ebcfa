"""What the ledger writes down: one record a collective, and the sums of the records.

A record is plain data (bytes, rounds, times), apart from the machinery that watches the
collectives (`shardlab.comm.ledger`): the reports, the cost model and the tables of the
chapters read records without caring how they were taken. `ring_traffic` is here too:
it is the rule by which a record's bytes are counted, what the ring algorithm moves for
that collective on this rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import torch


@dataclass
class CollectiveRecord:
    """One collective as one rank saw it.

    logical_bytes: elements x element size of the full (unsharded) tensor the collective
    is about. sent_bytes / received_bytes: what this rank sends and receives (for native
    collectives: what the ring algorithm would). seconds: from the call to completion
    (for a collective whose backend gives no completion signal, gloo's reduce-scatter and
    send/recv, to the return of the first wait for it, or else to the launch).
    rounds / round_bytes: sequential point-to-point rounds of the ring, and the bytes of
    one round: the α-β model's `steps` and `bytes per step`.

    start / end: `time.perf_counter()` at the launch and at the completion, the same
    instants as `seconds` (`end` is NaN while neither a completion nor a wait is known).
    waits: the (begin, end) spans in which this rank's thread was held by it: its launch,
    then `work.wait()` (the whole call, for a ring collective, which blocks). group: the process group's name,
    the same on every rank, so the ranks' records of one collective can be paired. link:
    the label of the link that group crosses (`shardlab.comm.links`: "intra-node",
    "inter-node"), "unlabelled" for a group nobody labelled.
    """

    op: str
    dtype: torch.dtype
    numel: int
    logical_bytes: int
    sent_bytes: int
    received_bytes: int
    seconds: float
    step: int
    world: int = 1
    rounds: int = 0
    round_bytes: int = 0
    start: float = 0.0
    end: float = 0.0
    waits: list[tuple[float, float]] = field(default_factory=list)
    group: str = ""
    link: str = "unlabelled"


def ring_traffic(op: str, numel: int, world: int, elem_size: int, rank: int = 0,
                 src: int = 0) -> tuple[int, int, int, int]:
    """(sent, received, rounds, round_bytes) of one rank for a ring collective.

    `numel` is the full tensor's length. Reduce-scatter and all-gather: N-1 rounds of one
    chunk of ceil(numel/N) elements each way. All-reduce: both. Broadcast: the tensor is
    cut into N pieces that flow down the chain src -> src+1 -> ... (N+N-2 rounds); every
    rank but the last forwards the whole tensor, every rank but src receives it. Reduce (to
    src): a reduce-scatter, then one round in which every other rank sends src its chunk.
    All-to-all (`numel` is one rank's input, cut into N equal parts): N-1 rounds of a
    pairwise exchange, one part to each other rank and one from each.
    """
    op = op.removeprefix("ring_")
    if world == 1 or numel == 0:
        return 0, 0, 0, 0
    chunk = math.ceil(numel / world) * elem_size
    if op in ("reduce_scatter", "all_gather"):
        return (world - 1) * chunk, (world - 1) * chunk, world - 1, chunk
    if op == "all_reduce":
        return 2 * (world - 1) * chunk, 2 * (world - 1) * chunk, 2 * (world - 1), chunk
    if op == "broadcast":
        pieces = min(world, numel)
        position = (rank - src) % world
        full = numel * elem_size
        return (full if position < world - 1 else 0, full if position > 0 else 0,
                pieces + world - 2, math.ceil(numel / pieces) * elem_size)
    if op == "reduce":  # a reduce-scatter, then every chunk sent to the root (src)
        gathered = (world - 1) * chunk if rank == src else 0
        return ((world - 1) * chunk + (chunk if rank != src else 0),
                (world - 1) * chunk + gathered, world, chunk)
    if op == "all_to_all":
        return (world - 1) * chunk, (world - 1) * chunk, world - 1, chunk
    if op in ("send", "recv"):
        full = numel * elem_size
        return (full, 0, 1, full) if op == "send" else (0, full, 1, full)
    raise ValueError(f"unknown collective {op!r}; use one of reduce_scatter, all_gather, "
                     f"all_reduce, broadcast, reduce, all_to_all, send, recv")


_SUMMED = ("logical_bytes", "sent_bytes", "received_bytes", "seconds")


def totals(records: Iterable[CollectiveRecord]) -> dict:
    """calls, logical_bytes, sent_bytes, received_bytes, seconds, summed over records."""
    out = {"calls": 0, **{key: 0 for key in _SUMMED}}
    for record in records:
        out["calls"] += 1
        for key in _SUMMED:
            out[key] += getattr(record, key)
    return out


def per_op(records: Iterable[CollectiveRecord]) -> dict[str, dict]:
    """{op: totals} in the order the ops first ran."""
    groups: dict[str, list] = defaultdict(list)
    for record in records:
        groups[record.op].append(record)
    return {op: totals(rs) for op, rs in groups.items()}


def per_step(records: Iterable[CollectiveRecord]) -> list[dict[str, dict]]:
    """[{op: totals} for each step], step 0 first (steps with no collective are empty)."""
    records = list(records)
    steps = max((r.step for r in records), default=-1) + 1
    return [per_op(r for r in records if r.step == s) for s in range(steps)]


def format_table(records: Iterable[CollectiveRecord], seconds: bool = False) -> str:
    """A per-step, per-op table of bytes (and times, which vary from run to run)."""
    header = f"{'step':>4}  {'op':<22}{'calls':>6}{'logical B':>12}{'sent B':>12}{'recv B':>12}"
    header += f"{'ms':>10}" if seconds else ""
    lines = [header]
    for step, ops in enumerate(per_step(records)):
        for op, t in ops.items():
            line = (f"{step:>4}  {op:<22}{t['calls']:>6}{t['logical_bytes']:>12}"
                    f"{t['sent_bytes']:>12}{t['received_bytes']:>12}")
            lines.append(line + (f"{1e3 * t['seconds']:>10.2f}" if seconds else ""))
    return "\n".join(lines)
