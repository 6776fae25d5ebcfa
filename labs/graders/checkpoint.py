"""Lab 7's grader: your sharded checkpoint, saved and loaded by every rank, against
PyTorch's `torch.distributed.checkpoint` (DCP) and the course's rule (`shardlab.checkpoint`:
each rank writes its own shard, nobody gathers the model).

    save_sharded(shard, folder)  every rank at once: write this rank's tensors (a dict)
    load_sharded(folder)         every rank at once: read back this rank's tensors

Each rank's shard differs (as a ZeRO-3 or FSDP rank's does). Checked: every rank reads
back its own tensors bit for bit, as DCP reads back the same shards saved as a sharded
tensor; the folder holds every rank's bytes once (not one rank's, not a gathered copy).
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
from graders.common import agree, call, first_difference, grade_on_ranks, run_each, show


def shard_of(rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors: a weight's rows, its Adam moment, a bf16 buffer."""
    g = torch.Generator().manual_seed(7 + rank)
    return {"weight": torch.randn(3, 4, generator=g),
            "exp_avg_sq": torch.rand(3, 4, generator=g),
            "scale": torch.randn(5, generator=g).to(torch.bfloat16)}


def _bytes_in(folder: str) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def _with_dcp(mine: dict[str, torch.Tensor], folder: str) -> dict[str, torch.Tensor]:
    """PyTorch's reference: the same shards as dim-0 shards of global tensors, saved and
    loaded by DCP; what each rank gets back."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {k: DTensor.from_local(v, mesh, [Shard(0)]) for k, v in mine.items()}
    dcp.save(state, checkpoint_id=folder)
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, checkpoint_id=folder)
    return {k: v.to_local() for k, v in back.items()}


def _saved_and_loaded(answer: tuple, mine: dict, folder: str):
    """What `answer`'s load reads back, every rank having saved its `mine` into `folder`."""
    save_sharded, load_sharded = answer
    call("save_sharded(shard, folder)", save_sharded, {k: v.clone() for k, v in mine.items()},
         folder)
    dist.barrier()                       # every rank has written before any reads
    return call("load_sharded(folder)", load_sharded, folder)


def check_one(candidate: tuple, root: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = shard_of(rank)
    folder = os.path.join(root, "yours")
    reference = _with_dcp(mine, os.path.join(root, "dcp"))
    back = _saved_and_loaded(candidate, mine, folder)
    problem = None if isinstance(back, dict) else f"load_sharded returned a {type(back)}"
    if problem is None and set(back) != set(mine):
        problem = f"load_sharded returned keys {sorted(back)}, saved {sorted(mine)}"
    agree(problem)
    for name in mine:
        problem = first_difference(back[name], reference[name], "DCP's load")
        agree(problem and f"tensor {name!r} loaded: {problem}", got=back,
              mistakes=wrong.CHECKPOINT,
              rerun=lambda answer: _saved_and_loaded(answer, mine, _fresh(root)))
    total = sum(v.numel() * v.element_size() for r in range(world)
                for v in shard_of(r).values())
    written = _bytes_in(folder)
    agree(None if rank != 0 or total <= written <= 2 * total + 8192 * world else
          f"the folder holds {written:,} B; the {world} shards hold {total:,} B, each "
          f"rank's once (plus a little metadata)")


def check(candidates: list, root: str) -> list:
    return run_each(candidates, lambda c: check_one(c, _fresh(root)))


def _fresh(root: str) -> str:
    """A new folder for each candidate, the same on every rank."""
    names = [None]
    if dist.get_rank() == 0:
        names = [tempfile.mkdtemp(dir=root)]
    dist.broadcast_object_list(names)
    return names[0]


def grade(save_sharded, load_sharded, world: int = 2) -> SimpleNamespace:
    """Grade your two functions on `world` ranks and print one line."""
    with tempfile.TemporaryDirectory(prefix="graded-checkpoint-") as root:
        [(verdict, _)] = grade_on_ranks(check, world, [(save_sharded, load_sharded)], root)
    return SimpleNamespace(passed=show("sharded checkpoint", verdict), verdict=verdict)
