"""Lab 10's grader: your reader of this rank's rows of a safetensors file, against the
shard PyTorch's `fully_shard` keeps (`distribute_tensor(..., [Shard(0)])`: `torch.chunk`'s
cut, ceil(d0/N) rows a rank, the last ranks fewer).

    read_my_rows(path, name)   every rank at once: this rank's dim-0 rows of tensor `name`

Checked on tensors whose rows do not split evenly (5 rows on 2 ranks: 3 and 2), a 1-D one,
and one of 1 row (rank 1 gets none: a tensor of 0 rows): the values, shape and dtype.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from graders import wrong
from graders.common import agree, call, first_difference, grade_on_ranks, run_each, show


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10)
    return {"embed.weight": torch.randn(5, 4, generator=g),
            "norm.weight": torch.randn(7, generator=g),
            "head.weight": torch.randn(6, 3, generator=g).to(torch.bfloat16),
            "one_row": torch.randn(1, 8, generator=g)}


def _write(root: str) -> str:
    from safetensors.torch import save_file
    path = os.path.join(root, "model.safetensors")
    if dist.get_rank() == 0:
        save_file(tensors(), path)
    dist.barrier()
    return path


def check_one(read_my_rows, path: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name, full in tensors().items():
        expected = distribute_tensor(full, mesh, [Shard(0)]).to_local()
        got = call(f"read_my_rows(path, {name!r})", read_my_rows, path, name)
        problem = first_difference(got, expected, "fully_shard's shard")
        agree(problem and f"{name}: {problem}", got=got, mistakes=wrong.ROWS,
              rerun=lambda answer: answer(path, name))


def check(candidates: list, root: str) -> list:
    path = _write(root)
    return run_each(candidates, lambda c: check_one(c, path))


def grade(read_my_rows, world: int = 2) -> SimpleNamespace:
    """Grade your function on `world` ranks and print one line."""
    with tempfile.TemporaryDirectory(prefix="graded-rows-") as root:
        [(verdict, _)] = grade_on_ranks(check, world, [read_my_rows], root)
    return SimpleNamespace(passed=show("your rows", verdict), verdict=verdict)
