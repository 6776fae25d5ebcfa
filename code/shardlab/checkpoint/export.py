"""Out of the course's format: one full `torch.save` file, a checkpoint read by PyTorch's
own FSDP2, and the timings and sizes the chapter shows.

Each of these reads a checkpoint, or the live state, for someone else: a plain PyTorch
program, PyTorch's `fully_shard`, a table. Apart from saving and loading, which they
only call.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardlab.checkpoint.layout import barrier, pieces_of, rank_world
from shardlab.checkpoint.store import load, save
from shardlab.comm.full_tensor import full_tensor


def export_full_state_dict(wrapped, path: str | os.PathLike) -> None:
    """Write the full, unsharded state dict of the model, under the model's own names (a
    tied weight under each of its names) with its persistent buffers, as a plain
    `torch.save` file on rank 0. Every rank must call it: the shards are gathered. Any
    model: `model.load_state_dict(torch.load(path, weights_only=True))` reads it into a
    model built the same way."""
    full = wrapped.full_parameters() if wrapped.full_parameters else \
        {n: p.detach() for n, p in wrapped.module.named_parameters()}
    names = [(piece.name, piece.aliases) for piece in pieces_of(wrapped)]
    rank, _ = rank_world()
    if rank == 0:
        out = {}
        for name, aliases in names:
            for key in (name, *aliases):
                out[key] = full[name].detach().cpu().clone()
        persistent = set(wrapped.module.state_dict(keep_vars=True))
        for name, buffer in wrapped.module.named_buffers():
            if name in persistent:
                out[name] = buffer.detach().cpu().clone()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, path)
    barrier()


def files_per_rank(folder: str | os.PathLike) -> dict[int, int]:
    """Bytes on disk of each rank's shard file (DCP names them `__<rank>_<n>.distcp`)."""
    sizes: dict[int, int] = {}
    for f in Path(folder).glob("__*_*.distcp"):
        rank = int(f.name[2:].split("_")[0])
        sizes[rank] = sizes.get(rank, 0) + f.stat().st_size
    return sizes


def timed_save_load(cases: list[dict], root: str, repeats: int = 3) -> list[dict]:
    """Run on every rank (with `shardlab.launch.launch`): for each case {strategy, model,
    precision}, train one step, then save and load the state `repeats` times; return the
    median seconds of a save and of a load (all ranks together, barrier to barrier) and
    the bytes each rank wrote."""
    import statistics
    import time

    from shardlab.launch.devices import rank_device
    from shardlab.models import build_model, get_batch
    from shardlab.optimizers import optimizer_spec
    from shardlab.precision import get_precision
    from shardlab.step import train_step
    from shardlab.strategy import get_strategy

    rank, world = rank_world()
    out = []
    for i, case in enumerate(cases):
        wrapped = get_strategy(case["strategy"])(
            build_model(case.get("model", "gpt-tiny"), seed=0).to(rank_device()),
            get_precision(case.get("precision", "fp32")), optimizer_spec("adamw", 1e-3), {})
        x, y = (t.to(rank_device()) for t in get_batch(0, rank, world, 8, 16))
        train_step(wrapped, [(x, y)])  # one step: the optimizer's state exists
        saves, loads = [], []
        for r in range(repeats):
            barrier()
            start = time.perf_counter()
            folder = save(Path(root) / f"case{i}", r + 1, wrapped)
            saves.append(time.perf_counter() - start)
            barrier()
            start = time.perf_counter()
            load(folder, wrapped)
            barrier()
            loads.append(time.perf_counter() - start)
        out.append({"case": case, "save_s": statistics.median(saves),
                    "load_s": statistics.median(loads), "files": files_per_rank(folder)})
    return out


def open_with_pytorch_fsdp2(folder: str, model: str, model_config: dict | None = None,
                            wrap: str = "auto") -> dict:
    """Run on every rank: build `model`, shard it with PyTorch's own `fully_shard` (per
    unit of the wrap policy), and read the checkpoint with nothing but PyTorch's API
    (`get_state_dict`, `dcp.load`, `set_state_dict`). Returns the full parameters it
    loaded and the step count of Adam's state, on every rank."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardlab.launch.devices import rank_device
    from shardlab.models import build_model
    from shardlab.wrap import unit_modules

    module = build_model(model, seed=1, config=model_config).to(rank_device())  # other
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))  # weights
    for unit in unit_modules(module, wrap):
        fully_shard(unit, mesh=mesh)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    full = {n: full_tensor(p).detach().cpu() for n, p in module.named_parameters()}
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return {"params": full, "adam_step": steps[0] if steps else 0.0}
