"""Lab 7's grader: your sharded checkpoint, saved by 2 ranks and loaded by 3, against
PyTorch's `torch.distributed.checkpoint` (DCP) doing the same, and the course's rule
(`shardlab.checkpoint`: the file describes parameters, not ranks; nobody gathers the model).

    save_sharded(shard, folder)   every saving rank at once; `shard` maps a tensor's name to
                                  (rows, start, shape): this rank's rows of the tensor, the
                                  index of the first of them, and the whole tensor's shape
    load_sharded(folder, wanted)  every loading rank at once; `wanted` maps a name to the
                                  rows (start, stop) this rank now owns; return
                                  {name: those rows}

Each tensor is cut along dim 0 as `torch.chunk` cuts it (as FSDP2 and DCP's `Shard(0)` do):
on 2 ranks its 7 rows are 4 + 3, on 3 ranks 3 + 3 + 1, so a loading rank's rows can come
from two saving ranks' pieces. Checked: on 3 ranks, every rank reads back the rows it owns
bit for bit, as DCP reads back the same tensors saved on 2 ranks as sharded tensors; the
folder holds every saving rank's bytes once (not one rank's, not a gathered copy).

Two launches: the saves on 2 ranks (yours, and each typical mistake's for the hints), then
the loads on 3.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from graders import wrong
from graders.common import PASS, Wrong, agree, first_difference, grade_on_ranks, show

SAVE_WORLD, LOAD_WORLD = 2, 3


def whole_tensors() -> dict[str, torch.Tensor]:
    """The tensors every run checkpoints: a weight, its Adam moment, a bf16 vector, with
    first dims that 2 and 3 ranks cut unevenly."""
    g = torch.Generator().manual_seed(7)
    return {"weight": torch.randn(7, 4, generator=g),
            "exp_avg_sq": torch.rand(7, 4, generator=g),
            "scale": torch.randn(5, generator=g).to(torch.bfloat16)}


def rows_of(d0: int, world: int, rank: int) -> tuple[int, int]:
    """(start, stop) of rank `rank`'s rows when `torch.chunk` cuts d0 rows for `world`."""
    per = -(-d0 // world)
    return min(rank * per, d0), min((rank + 1) * per, d0)


def shard_of(rank: int, world: int) -> dict[str, tuple[torch.Tensor, int, tuple]]:
    """What saving rank `rank` of `world` hands to save_sharded: {name: (rows, start, shape)}."""
    out = {}
    for name, whole in whole_tensors().items():
        start, stop = rows_of(whole.shape[0], world, rank)
        out[name] = (whole[start:stop].clone(), start, tuple(whole.shape))
    return out


def wanted_of(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """What loading rank `rank` of `world` asks load_sharded for: {name: (start, stop)}."""
    return {name: rows_of(whole.shape[0], world, rank)
            for name, whole in whole_tensors().items()}


def _sharded(rows: torch.Tensor, shape: tuple, mesh) -> DTensor:
    return DTensor.from_local(rows, mesh, [Shard(0)], shape=torch.Size(shape),
                              stride=torch.empty(shape).stride(), run_check=False)


def _bytes_in(folder: str) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def _outcome(fn, *args):
    """What the code returns, or, if it raises, a one-line account of it: a rank that raises
    alone must not leave its peers in a collective."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the reader's code may raise anything
        message = str(exc).splitlines()[0] if str(exc) else ""
        for arg in args:      # a folder's path is this machine's: the line names it so
            if isinstance(arg, str):
                message = message.replace(arg, "<folder>")
        return Raised(f"raised {type(exc).__name__}" + (f": {message}" if message else ""))


class Raised(str):
    """A call that raised: compared by its exception's type (the hints' mistakes raise
    where yours do, with other words)."""

    def __eq__(self, other):
        return isinstance(other, Raised) and self.split(":")[0] == other.split(":")[0]

    __hash__ = str.__hash__


def _folders(root: str, count: int, mistakes: int) -> tuple[list[str], list[str]]:
    return ([os.path.join(root, f"yours-{i}") for i in range(count)],
            [os.path.join(root, f"mistake-{j}") for j in range(mistakes)])


# ----------------------------------------------------------------------------- on 2 ranks


def save_all(candidates: list, root: str) -> list[tuple[str, None]]:
    """On each saving rank: DCP's save of the reference, then each candidate's save and each
    mistake's, every one in a folder of its own; a candidate's verdict so far."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    mine = shard_of(rank, world)
    dcp.save({k: _sharded(rows, shape, mesh) for k, (rows, _, shape) in mine.items()},
             checkpoint_id=os.path.join(root, "dcp"))
    yours, theirs = _folders(root, len(candidates), len(wrong.CHECKPOINT))
    for mistake, folder in zip(wrong.CHECKPOINT, theirs):
        _outcome(mistake.answer[0], {k: (r.clone(), s, sh) for k, (r, s, sh) in mine.items()},
                 folder)
        dist.barrier()
    total = sum(rows.numel() * rows.element_size() for r in range(world)
                for rows, _, _ in shard_of(r, world).values())
    out = []
    for (save_sharded, _), folder in zip(candidates, yours):
        try:
            done = _outcome(save_sharded, {k: (r.clone(), s, sh) for k, (r, s, sh)
                                           in mine.items()}, folder)
            agree(f"save_sharded {done}" if isinstance(done, Raised) else None)
            dist.barrier()           # every rank has written before anyone measures
            written = _bytes_in(folder) if os.path.isdir(folder) else 0
            agree(None if rank != 0 or total <= written <= 2 * total + 8192 * world else
                  f"the folder holds {written:,} B; the {world} saving ranks' rows hold "
                  f"{total:,} B, each rank's once (plus a little metadata)")
            out.append((PASS, None))
        except Wrong as problem:
            out.append((str(problem), None))
        dist.barrier()
    return out


# ----------------------------------------------------------------------------- on 3 ranks


def load_all(candidates: list, root: str, saved: list[str]) -> list[tuple[str, None]]:
    """On each loading rank: DCP's load of the reference (resharded from 2 ranks to 3), then
    each candidate's load, compared tensor by tensor; the mistakes' loads for the hints."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    wanted = wanted_of(rank, world)
    whole = whole_tensors()
    reference = {k: _sharded(torch.zeros(b - a, *whole[k].shape[1:], dtype=whole[k].dtype),
                             tuple(whole[k].shape), mesh) for k, (a, b) in wanted.items()}
    dcp.load(reference, checkpoint_id=os.path.join(root, "dcp"))
    reference = {k: v.to_local() for k, v in reference.items()}
    yours, theirs = _folders(root, len(candidates), len(wrong.CHECKPOINT))
    folder_of = {id(m.answer): f for m, f in zip(wrong.CHECKPOINT, theirs)}
    out = []
    for (_, load_sharded), folder, before in zip(candidates, yours, saved):
        if before != PASS:           # its save failed on 2 ranks: the verdict stands
            out.append((before, None))
            dist.barrier()
            continue
        try:
            back = _outcome(load_sharded, folder, dict(wanted))
            agree(_first_problem(back, reference, wanted), got=back, mistakes=wrong.CHECKPOINT,
                  rerun=lambda answer: _outcome(answer[1], folder_of[id(answer)],
                                                dict(wanted)))
            out.append((PASS, None))
        except Wrong as problem:
            out.append((str(problem), None))
        dist.barrier()
    return out


def _first_problem(back, reference: dict, wanted: dict) -> str | None:
    """What is wrong with what load_sharded returned on this rank, in one line, or None."""
    if isinstance(back, Raised):
        return f"load_sharded {back}"
    if not isinstance(back, dict):
        return f"load_sharded returned a {type(back).__name__}, not a dict"
    if set(back) != set(wanted):
        return f"load_sharded returned keys {sorted(back)}, asked for {sorted(wanted)}"
    for name in wanted:
        problem = first_difference(back[name], reference[name], "DCP's load")
        if problem:
            return f"tensor {name!r} loaded: {problem}"
    return None


def verdicts(candidates: list, root: str) -> list[str]:
    """Grade each (save_sharded, load_sharded): saved on 2 ranks, loaded on 3; a verdict
    each, PASS or the first problem's line."""
    saved = [v for v, _ in grade_on_ranks(save_all, SAVE_WORLD, candidates, root)]
    return [v for v, _ in grade_on_ranks(load_all, LOAD_WORLD, candidates, root, saved)]


def grade(save_sharded, load_sharded) -> SimpleNamespace:
    """Grade your two functions (saved on 2 ranks, loaded on 3) and print one line."""
    with tempfile.TemporaryDirectory(prefix="graded-checkpoint-") as root:
        [verdict] = verdicts([(save_sharded, load_sharded)], root)
    return SimpleNamespace(passed=show(f"sharded checkpoint, saved on {SAVE_WORLD} ranks and "
                                       f"loaded on {LOAD_WORLD}", verdict), verdict=verdict)
