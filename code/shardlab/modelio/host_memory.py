"""Host memory per rank for three ways of loading a pretrained model into shards, measured
(peak resident memory, Linux's VmHWM) beside what each way must hold.

    full       every rank builds the model (its own random init, 4Ψ bytes in fp32),
               reads the whole file (another 4Ψ), loads it, then shards:   8Ψ per rank
    broadcast  rank 0 reads the whole file (4Ψ) and PyTorch's set_model_state_dict
               broadcasts it tensor by tensor into the others' meta-built shards:
               rank 0 4Ψ + 4Ψ/N, the others 4Ψ/N + one tensor at a time
    meta       every rank builds on meta and reads only its own rows: its shards, 4Ψ/N,
               and the pages of the file that hold those rows, 4Ψ/N more: safetensors
               reads through a memory map, whose pages count as resident (they are the
               page cache, shared between ranks and dropped under pressure): 2 x 4Ψ/N

All three shard with PyTorch's `fully_shard` by default; "full" and "meta" take any
strategy that shards on meta (its card says `shards_on_meta`: the course's `fsdp2` too). A
run per way, in fresh ranks: a process's peak only grows.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from shardlab.cards import PYTORCH, names
from shardlab.launch.devices import rank_device
from shardlab.measure import host_peak_bytes, host_rss_bytes, reset_host_peak
from shardlab.modelio.hf_files import WEIGHTS
from shardlab.modelio.meta import build_on_meta, materialize, restore_buffers, wrap_on_meta
from shardlab.models import build_model
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.strategy import get_strategy

WAYS = ("full", "broadcast", "meta")
# The settings of the small model of the same family run first (its folder: `warm_up`)
WARM_UP = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}


def predicted_bytes(way: str, psi_bytes: int, largest_bytes: int, world: int,
                    rank: int) -> int:
    """What rank `rank` must hold at its peak, in bytes, for each way (the table above):
    `psi_bytes` the model's weights, `largest_bytes` its largest tensor."""
    shard = psi_bytes // world
    if way == "full":
        return 2 * psi_bytes
    if way == "broadcast":
        return psi_bytes + shard if rank == 0 else shard + largest_bytes
    if way == "meta":
        return 2 * shard
    raise ValueError(f"unknown way {way!r}; use one of {WAYS}")


def load_one_way(way: str, folder: str, name: str, config: dict | None = None,
                 warm_up: str | None = None, strategy: str = "torch-fsdp2") -> dict:
    """Run on every rank (a launch per way): load `folder` into `name` sharded by
    `strategy` the way `way` says; return this rank's peak host bytes above what it
    held before, and the model's sizes. `warm_up`: a folder of the model with WARM_UP's
    settings, loaded the same way first. ("broadcast" is PyTorch's own, for its
    `fully_shard` alone.)"""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_model_state_dict)

    if way not in WAYS:
        raise ValueError(f"unknown way {way!r}; use one of {WAYS}")
    # "broadcast" is PyTorch's own way (set_model_state_dict's broadcast_from_rank0), for
    # PyTorch's sharded model alone
    on_meta, broadcasts = names(shards_on_meta=True), names(family=PYTORCH, shards_on_meta=True)
    if strategy not in on_meta or (way == "broadcast" and strategy not in broadcasts):
        raise ValueError(f"way {way!r} with strategy {strategy!r}: use a strategy of "
                         f"{sorted(on_meta)} (\"broadcast\": {', '.join(broadcasts)} only)")
    if warm_up:  # the code's own first-use memory (imports, caches) is not the model's
        load_one_way(way, warm_up, name, {**(config or {}), **WARM_UP}, None, strategy)
    rank, device = dist.get_rank(), rank_device()
    precision, spec = get_precision("fp32"), optimizer_spec("adamw", 1e-3)
    wrap = get_strategy(strategy)
    reset_host_peak()
    before = host_rss_bytes()
    if way == "full":
        model = build_model(name, seed=0, config=config).to(device)
        model.load_state_dict(load_file(str(Path(folder) / WEIGHTS)), strict=False)
        wrapped = wrap(model, precision, spec, {})
    elif way == "broadcast":
        wrapped = wrap(build_on_meta(name, config), precision, spec, {})
        materialize(wrapped.module, device)  # the meta path's own rule for storage
        restore_buffers(wrapped.module, name, config)
        full = load_file(str(Path(folder) / WEIGHTS)) if rank == 0 else {}
        set_model_state_dict(wrapped.module, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=False))
        del full
    else:
        wrapped = wrap_on_meta(name, config, strategy, precision, spec, {}, device, folder)
    peak = host_peak_bytes() - before
    sizes = [p.numel() * p.element_size() for p in build_on_meta(name, config).parameters()]
    del wrapped
    return {"way": way, "rank": rank, "peak": peak, "psi_bytes": sum(sizes),
            "largest_bytes": max(sizes)}
