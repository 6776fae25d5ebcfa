"""Placement: which backend (NCCL or gloo) and which device (a GPU or the CPU) each rank
uses, and the rank's own device once it is placed.

A pure rule (`choose_placement`) apart from the processes: it is tested without
starting any, and read by every strategy through `rank_device()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardlab.launch.errors import LaunchError


BACKENDS = ("auto", "gloo", "nccl")


DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a launch run: the backend, the device type, and in words."""

    backend: str     # "nccl" or "gloo"
    device: str      # "cuda" or "cpu"
    description: str


def choose_placement(backend: str, device: str, world: int, gpus: int,
                     nccl_available: bool = True) -> Placement:
    """The three ways to place ranks, and the refusals, as a pure function:

    * NCCL, one GPU per rank, when there are at least as many GPUs as ranks;
    * gloo with CUDA tensors, the ranks sharing the GPUs round-robin (rank r on GPU
      r mod G), when there are GPUs but fewer than ranks: NCCL refuses two ranks on one
      GPU, gloo does not, and each rank's allocator then measures its own CUDA memory;
    * gloo on the CPU when there is no GPU (or when asked with device="cpu").
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; use one of {DEVICES}")
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device == "cuda" and not gpus:
        raise LaunchError("device 'cuda' needs a GPU, and torch sees none here; use "
                          "device='cpu' (or 'auto')")
    if backend == "auto":
        backend = "nccl" if device == "cuda" and gpus >= world and nccl_available else "gloo"
    if backend == "nccl":
        if not nccl_available:
            raise LaunchError("backend 'nccl' is not available in this build of torch; use "
                              "backend='gloo' (or 'auto')")
        if device == "cpu":
            raise LaunchError("backend 'nccl' runs on GPUs only; use backend='gloo' for the "
                              "CPU")
        if gpus < world:
            raise LaunchError(f"backend 'nccl' needs one GPU per rank: world={world} but "
                              f"{gpus} GPU(s) are visible; use backend='gloo' (ranks share "
                              f"the GPUs) or 'auto', or at most {gpus} ranks")
        return Placement("nccl", "cuda", f"nccl: {world} rank(s), one GPU each")
    if device == "cuda":
        return Placement("gloo", "cuda", f"gloo: {world} rank(s) sharing {min(gpus, world)} "
                                         f"GPU(s), CUDA tensors")
    return Placement("gloo", "cpu", f"gloo: {world} rank(s) on the CPU")


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world: int, device: str = "auto") -> str:
    """The backend a launch of `world` ranks uses here (see `choose_placement`)."""
    return choose_placement(backend, device, world, visible_gpus(),
                            dist.is_nccl_available()).backend


_PLACED: tuple[torch.device, str] | None = None  # this rank's device, and its placement


def place_this_rank(rank: int, placement: Placement) -> None:
    global _PLACED
    if placement.device == "cuda":
        index = rank % visible_gpus()
        torch.cuda.set_device(index)
        _PLACED = (torch.device("cuda", index), placement.description)
    else:
        _PLACED = (torch.device("cpu"), placement.description)


def rank_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, a shared GPU under gloo with
    CUDA tensors, else the CPU."""
    if _PLACED is not None:
        return _PLACED[0]
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def placement() -> str:
    """How this rank was placed, in words (for the run report)."""
    if _PLACED is not None:
        return _PLACED[1]
    if dist.is_initialized():
        return f"{dist.get_backend()}: {dist.get_world_size()} rank(s) on {rank_device()}"
    return f"one process on {rank_device()}"
