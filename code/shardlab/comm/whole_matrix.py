"""The bytes a whole-matrix optimizer (Muon, `shardlab.muon`) sends per step, by design.

Each matrix is given as its every rank's (rank, start, stop) of its flattened elements
(a strategy's cut, `shardlab.muon.Place.ranges`); its update travels in bf16 (2 bytes an
element: Newton-Schulz casts to bf16 first). Counted as the ledger counts them
(`shardlab.comm.records.ring_traffic`):

    gather  one all-gather per matrix of N pieces padded to the longest, L elements:
            every rank sends (N-1) L elements of it
    owner   each rank sends its piece to the matrix's owner (a send of its elements),
            and the owner sends every other rank its piece of the result: the owner
            sends the M - m_owner elements it did not hold
    whole   nothing: each matrix is on its owner already

Summed over ranks, gather moves (N-1) x the matrix (N L ~ M) and owner 2 (M - m_owner):
for N > 2 the owner design moves fewer bytes, and computes each matrix once.

The whole design's price is elsewhere: ZeRO's buckets of matrices laid out whole are
padded to N times the fullest rank's load, and every reduce-scatter and all-gather of
them moves that padding (`whole_layout_extra_bytes`).
"""

from __future__ import annotations

import math
from typing import Sequence

from shardlab.muon.places import owners_by_size

Ranges = Sequence[tuple[int, int, int]]
UPDATE_BYTES = 2  # bf16


def muon_sent_bytes(design: str, matrices: Sequence[Ranges], world: int, rank: int,
                    owners: Sequence[int] | None = None,
                    elem_size: int = UPDATE_BYTES) -> int:
    """Bytes rank `rank` sends per step for the matrices' orthogonalization under
    `design` ("gather", "owner", "whole"); `owners[i]`: the rank that orthogonalizes
    matrix i (owner design)."""
    sent = 0
    for i, ranges in enumerate(matrices):
        pieces = {r: z - a for r, a, z in ranges}
        if design == "gather":
            sent += (world - 1) * max(pieces.values()) if world > 1 else 0
        elif design == "owner":
            owner = owners[i]
            if rank == owner:
                sent += sum(n for r, n in pieces.items() if r != owner)
            else:
                sent += pieces.get(rank, 0)
        elif design != "whole":
            raise ValueError(f"unknown Muon design {design!r}; use gather, owner or whole")
    return sent * elem_size


def muon_messages(design: str, matrices: Sequence[Ranges], world: int,
                  owners: Sequence[int] | None = None) -> int:
    """Latency-bound steps of a step's exchange, the α of the α-β model: gather runs N-1
    ring rounds per matrix, one matrix after another; owner two rounds of messages (to
    the owners, back), each rank's messages in flight at once, so at most N-1 sends of
    one rank's in a row."""
    if design == "gather":
        return (world - 1) * len(matrices) if world > 1 else 0
    if design == "owner":
        return 2 * (world - 1) if world > 1 and matrices else 0
    return 0


def whole_layout_extra_bytes(buckets: Sequence[Sequence[int]], world: int,
                             elem_size: int = 4) -> int:
    """Bytes a rank sends more per step when ZeRO-1/2 lays out these buckets (each the
    sizes of its matrices) whole, one matrix on one rank (`muon:whole`,
    `shardlab.zero.layout.whole_offsets`), than cut N ways: a bucket's chunk is its
    fullest rank's load instead of ceil(numel/N), and its reduce-scatter and all-gather
    each send N-1 chunks."""
    extra = 0
    for sizes in buckets:
        owner = owners_by_size(list(enumerate(sizes)), world)
        load = [sum(n for i, n in enumerate(sizes) if owner[i] == r) for r in range(world)]
        extra += 2 * (world - 1) * (max(load) - math.ceil(sum(sizes) / world))
    return extra * elem_size
