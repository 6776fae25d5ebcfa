"""Workers for the measurement tests: each builds tiny models, takes real optimizer steps
and returns what `shardlab.measure` counted, for the test to compare with `shardlab.memory`.

They run on every rank of a `launch` (or in the test process for a single process), and
each does many cases per launch, because starting ranks costs seconds and a case costs
milliseconds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardlab.measure import state_bytes, track_peak
from shardlab.precision import MasterWeightOptimizer, get_precision

OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-3}),
              "sgd": (torch.optim.SGD, {"lr": 1e-2}),
              "sgd-momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9})}


def tiny_model(seed: int = 0) -> nn.Module:
    """Odd sizes on purpose: nothing divides evenly by 2 or 4 ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.Linear(37, 21), nn.GELU(),
                         nn.Linear(21, 5))


def build_optimizer(model: nn.Module, precision: str, optimizer: str):
    cls, kwargs = OPTIMIZERS[optimizer]
    if get_precision(precision).master_weights:
        return MasterWeightOptimizer(model.parameters(), cls, **kwargs)
    return cls(model.parameters(), **kwargs)


def one_case(precision: str, optimizer: str, steps: int = 2) -> dict:
    """Train the tiny model for `steps` (under PyTorch's DDP when a process group is up)
    and count its bytes after the last backward and step, before zero_grad."""
    model = tiny_model().to(get_precision(precision).param_dtype)
    n_tensors = len(list(model.parameters()))
    psi = sum(p.numel() for p in model.parameters())
    if dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    opt = build_optimizer(model, precision, optimizer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(100 + rank)
    for step in range(steps):
        x = torch.randn(8, 13, dtype=get_precision(precision).param_dtype)
        with track_peak(model, opt) as peak:
            model(x).float().square().mean().backward()
            opt.step()
            counted = state_bytes(model, opt)
            opt.zero_grad()
    return {"psi": psi, "param_tensors": n_tensors, "state_bytes": counted,
            "after_zero_grad": state_bytes(model, opt), "peak": peak.bytes,
            "peak_by_category": peak.by_category}


def all_cases(cases: list[tuple[str, str]]) -> dict:
    return {case: one_case(*case) for case in cases}


def fully_shard_case() -> dict:
    """PyTorch's FSDP2 on CPU: parameters and Adam states are DTensors; count their
    local shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    model = tiny_model()
    shapes = [tuple(p.shape) for p in model.parameters()]
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(dist.get_rank())
    for _ in range(2):
        model(torch.randn(8, 13)).square().mean().backward()
        opt.step()
        counted = state_bytes(model, opt)
        opt.zero_grad()
    local = [tuple(p.to_local().shape) for p in model.parameters()]
    return {"shapes": shapes, "local_shapes": local, "state_bytes": counted}


def wide_model() -> nn.Module:
    """About a million fp32 parameters (4 MB): the Reducer's buckets stand far above the
    allocator's noise (Python objects, gloo's own buffers: tens of kB)."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))


def ddp_bucket_copy() -> dict:
    """PyTorch's DDP, both settings of `gradient_as_bucket_view`: the bytes the process's
    allocator holds for it after two steps beyond the model itself (`host_allocated_bytes`,
    which sees the C++ Reducer's buffers too), and what `state_bytes` counts."""
    import gc

    from shardlab.measure import host_allocated_bytes
    # one step of a DDP first: the one-off allocations of a process's first DDP (gloo's,
    # the Reducer's statics: about 23 MB here) and first backward through these shapes
    # (about 2 MB) are not the buckets
    warm = nn.parallel.DistributedDataParallel(wide_model())
    warm(torch.randn(8, 512)).square().mean().backward()
    del warm
    out = {}
    for view in (False, True):
        model = wide_model()
        psi = sum(p.numel() for p in model.parameters())
        gc.collect()
        before = host_allocated_bytes()
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=view)
        for step in range(2):  # the second rebuilds the buckets in the gradients' order
            ddp(torch.randn(8, 512)).square().mean().backward()
        gc.collect()
        out[view] = {"psi": psi, "allocated": host_allocated_bytes() - before,
                     "state_bytes": state_bytes(ddp)}
        del ddp, model
    return out


def ddp_and_fully_shard(cases: list[tuple[str, str]], bucket_copy: bool = False) -> dict:
    """One launch for all: PyTorch's DDP on every case, its bucket copy measured (when
    asked: it takes seconds), then PyTorch's FSDP2."""
    return {"ddp": all_cases(cases), "bucket_copy": ddp_bucket_copy() if bucket_copy else {},
            "fully_shard": fully_shard_case()}
