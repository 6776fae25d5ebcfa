"""The three designs: how each rank gets its slice of an orthogonalized matrix that the
ranks hold in pieces.

Each takes this rank's piece of every matrix's update (momentum applied, in bf16) and
returns this rank's slice of the orthogonalized matrix, also bf16: what it adds to its
own elements of the parameter.

    gather  every rank all-gathers every matrix and orthogonalizes it: simple, N times
            the compute (each matrix on every rank) and a whole matrix on every rank
    owner   each matrix has one owner rank (`owners_by_size`): the others send it their
            pieces, it orthogonalizes, and sends each rank its slice back; every matrix
            is orthogonalized once, the N owners at the same time
    whole   the strategy's layout holds every matrix whole on one rank (cuts between
            matrices, not through them): that rank orthogonalizes it, nothing moves

The pieces travel in bf16: Newton-Schulz starts by casting its input to bf16
(torch/optim/_muon.py), so casting first halves the bytes and changes no bit of the
result. The bytes each design sends (`shardlab.comm.whole_matrix`) and the gathered
matrices it holds (`shardlab.memory.whole_matrix`) are predicted from the same places.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from shardlab.comm.compat import all_gather_into
from shardlab.muon.newton_schulz import watch
from shardlab.muon.places import Place

Orthogonalize = Callable[[torch.Tensor], torch.Tensor]


def my_range(place: Place, rank: int) -> tuple[int, int] | None:
    return next(((a, z) for r, a, z in place.ranges if r == rank), None)


def all_gather_matrix(place: Place, piece: torch.Tensor, group) -> torch.Tensor:
    """The whole matrix on this rank: one all-gather of every rank's piece, each padded to
    the longest (L elements). When rank r holds elements [rL, (r+1)L) (FSDP2's rows) the
    gathered buffer is the matrix; otherwise (a flat ZeRO layout) its pieces are copied
    out into one."""
    world = dist.get_world_size(group)
    longest = max(z - a for _, a, z in place.ranges)
    mine = torch.zeros(longest, dtype=piece.dtype, device=piece.device)
    mine[:piece.numel()].copy_(piece)
    gathered = torch.empty(world * longest, dtype=piece.dtype, device=piece.device)
    all_gather_into(gathered, mine, group=group)
    watch().take(gathered)
    if all(a == r * longest for r, a, _ in place.ranges):
        return gathered[:place.numel].view(place.shape)
    whole = torch.cat([gathered[r * longest:r * longest + z - a] for r, a, z in place.ranges])
    watch().take(whole)
    watch().release(gathered)
    return whole.view(place.shape)


def gather(todo: list[Place], pieces: dict[Place, torch.Tensor], group,
           orthogonalize: Orthogonalize) -> dict[Place, torch.Tensor]:
    """Every rank gathers and orthogonalizes every matrix, one at a time, and keeps its
    own slice of the result."""
    rank = dist.get_rank(group)
    out = {}
    for place in todo:
        whole = all_gather_matrix(place, pieces[place], group)
        ortho = orthogonalize(whole).reshape(-1)
        watch().release(whole)
        mine = my_range(place, rank)
        if mine is not None:
            out[place] = ortho[mine[0]:mine[1]]
    return out


def owner(todo: list[Place], pieces: dict[Place, torch.Tensor], owners: dict[str, int],
          group, orthogonalize: Orthogonalize) -> dict[Place, torch.Tensor]:
    """Each matrix orthogonalized once, by its owner: every piece sent to the owner, the
    owners compute at the same time, each rank's slice sent back. With a layout that
    holds each matrix on its owner alone (`sole_holders`: the whole design) nothing is
    sent either way."""
    rank = dist.get_rank(group)
    # 1. Every piece to its matrix's owner (tag: the matrix's place in `todo`).
    inbox, works = {}, []
    for tag, place in enumerate(todo):
        dst, piece = owners[place.name], pieces[place]
        if rank != dst:
            if piece.numel():
                works.append(dist.isend(piece, group=group, group_dst=dst, tag=tag))
            continue
        if piece.numel() == place.numel:  # all of it here already
            inbox[place] = piece
            continue
        whole = torch.empty(place.numel, dtype=piece.dtype, device=piece.device)
        watch().take(whole)
        for r, a, z in place.ranges:
            if r == rank:
                whole[a:z].copy_(piece)
            else:
                works.append(dist.irecv(whole[a:z], group=group, group_src=r, tag=tag))
        inbox[place] = whole
    for work in works:
        work.wait()
    # 2. Each owner orthogonalizes its own matrices.
    results = {}
    for place, whole in inbox.items():
        results[place] = orthogonalize(whole.view(place.shape)).reshape(-1)
        if whole is not pieces[place]:
            watch().release(whole)
    inbox.clear()
    # 3. Every rank's slice of the result back from the owner.
    out, works = {}, []
    for tag, place in enumerate(todo):
        src, mine = owners[place.name], my_range(place, rank)
        if rank == src:
            ortho = results[place]
            for r, a, z in place.ranges:
                if r != rank:
                    works.append(dist.isend(ortho[a:z], group=group, group_dst=r, tag=tag))
            if mine is not None:
                out[place] = ortho[mine[0]:mine[1]]
        elif mine is not None:
            out[place] = torch.empty(mine[1] - mine[0], dtype=torch.bfloat16,
                                     device=pieces[place].device)
            works.append(dist.irecv(out[place], group=group, group_src=src, tag=tag))
    for work in works:
        work.wait()
    return out
