"""What a whole-matrix optimizer (Muon, `shardlab.muon`) holds beyond its states, per
rank: the gathered matrices, in bf16 (2 bytes an element), by design.

    gather  one matrix at a time: the all-gather's buffer of N pieces padded to the
            longest (N L elements) and, where the pieces are not rank-major (a flat ZeRO
            cut), the matrix copied out of it (M); the largest matrix sets the peak
    owner   every matrix this rank owns and does not hold whole, all at once (the
            pieces of all of them arrive before the owners compute together)
    whole   nothing: each matrix is whole where it is stepped

and the states themselves: Muon keeps one momentum (4 bytes) per element of a matrix,
AdamW two moments (8 bytes) per element of the rest; sharded, each rank keeps its own
elements' (`muon_state_bytes`).
"""

from __future__ import annotations

import math
from typing import Sequence

Ranges = Sequence[tuple[int, int, int]]
UPDATE_BYTES = 2  # bf16


def muon_gathered_bytes(design: str, matrices: Sequence[tuple[Sequence[int], Ranges]],
                        world: int, rank: int, owners: Sequence[int] | None = None,
                        elem_size: int = UPDATE_BYTES) -> int:
    """Peak bytes of gathered matrices rank `rank` holds during a step; `matrices` as
    (shape, every rank's (rank, start, stop)), `owners[i]` the owner of matrix i."""
    if design == "whole":
        return 0
    if design == "gather":
        peak = 0
        for shape, ranges in matrices:
            longest = max(z - a for _, a, z in ranges)
            rank_major = all(a == r * longest for r, a, _ in ranges)
            held = world * longest + (0 if rank_major else math.prod(shape))
            peak = max(peak, held)
        return peak * elem_size
    if design == "owner":
        held = 0
        for i, (shape, ranges) in enumerate(matrices):
            numel = math.prod(shape)
            mine = sum(z - a for r, a, z in ranges if r == rank)
            if owners[i] == rank and mine != numel:
                held += numel
        return held * elem_size
    raise ValueError(f"unknown Muon design {design!r}; use gather, owner or whole")


def muon_state_bytes(matrix_elements: int, other_elements: int) -> int:
    """Optimizer state bytes for these elements (a rank's own, or all): fp32 momentum
    for Muon's, fp32 first and second moments for AdamW's."""
    return 4 * matrix_elements + 8 * other_elements
