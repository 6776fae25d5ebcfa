"""Lab 12's grader: your owner design's step for one matrix, against Newton-Schulz of the
whole matrix (`shardlab.muon.newton_schulz`), on 3 ranks.

    owner_step(piece, shape, ranges, owner)   every rank at once: this rank's slice of the
                                              orthogonalized matrix, in bf16

`piece` is this rank's elements of the flattened update (bf16, [start, stop) of it, empty
where it holds none), `ranges` every rank's (rank, start, stop), `owner` the rank that
orthogonalizes. Checked on four layouts of a matrix over 3 ranks: FSDP2's rows, a flat
ZeRO cut through rows, one whose owner holds none of it, and one whole on its owner. Each
time: the values, bit for bit (the same bf16 Newton-Schulz on the same matrix); that the
owner alone ran Newton-Schulz, once; and the bytes each rank sent, as the ledger counts
them: its piece to the owner, and from the owner each rank's slice back
(`shardlab.comm.whole_matrix.muon_sent_bytes`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from shardlab.comm import Ledger
from shardlab.comm.whole_matrix import muon_sent_bytes
from shardlab.muon import dim0_ranges, newton_schulz, watching
from graders import wrong
from graders.common import agree, call, first_difference, grade_on_ranks, run_each, show

# (what the layout is, the matrix's shape, every rank's (rank, start, stop), the owner)
LAYOUTS = [
    ("rows", (6, 4), dim0_ranges((6, 4), 3), 1),
    ("flat", (5, 8), ((0, 0, 7), (1, 7, 30), (2, 30, 40)), 2),
    ("owner holds none", (4, 6), ((0, 0, 12), (2, 12, 24)), 1),
    ("whole on its owner", (3, 5), ((0, 0, 15),), 0),
]


def check_one(owner_step) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for k, (label, shape, ranges, owner) in enumerate(LAYOUTS):
        update = torch.randn(shape, generator=torch.Generator().manual_seed(11 + k))
        update = update.bfloat16()
        a, z = next(((a, z) for r, a, z in ranges if r == rank), (0, 0))
        expected = newton_schulz(update).reshape(-1)[a:z]
        piece = update.reshape(-1)[a:z]
        with watching() as seen, Ledger() as ledger:
            got = call(f"owner_step on the {label} layout", owner_step, piece.clone(),
                       shape, ranges, owner)
        where = f"{label} layout {shape}"
        problem = first_difference(got, expected, "the owner's Newton-Schulz slice")
        agree(problem and f"{where}: {problem}", got=got, mistakes=wrong.MUON_OWNER,
              rerun=lambda answer: answer(piece.clone(), shape, ranges, owner))
        calls, wanted = len(seen.calls), int(rank == owner)
        agree(None if calls == wanted else
              f"{where}: this rank ran Newton-Schulz {calls}x; the owner (rank {owner}) "
              f"runs it, once, and no other rank does")
        sent = sum(record.sent_bytes for record in ledger.records)
        predicted = muon_sent_bytes("owner", [ranges], world, rank, [owner])
        agree(None if sent == predicted else
              f"{where}: sent {sent} bytes, the owner design sends {predicted} (its piece to "
              f"the owner; from the owner, each rank its own slice back)")


def check(candidates: list) -> list:
    return run_each(candidates, check_one)


def grade(owner_step, world: int = 3) -> SimpleNamespace:
    """Grade your function on `world` ranks and print one line."""
    [(verdict, _)] = grade_on_ranks(check, world, [owner_step])
    return SimpleNamespace(passed=show("your owner step", verdict), verdict=verdict)
