"""The graders' models and data: tiny, so that a graded run takes a second, and uneven, so
that padding and bucket edges are exercised."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def tiny_mlp(seed: int = 0) -> nn.Sequential:
    """Three linear layers (8 -> 16 -> 16 -> 4): six tensors of 16 to 1,024 bytes, first
    dims 16, 16 and 4, so that bucket caps of a kilobyte split them into several buckets."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def uneven_mlp(seed: int = 0) -> nn.Sequential:
    """First dims 5 and 3: on 2 ranks, each weight's last shard is padded."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def batch(step: int, inputs: int, outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows for a step: different on every rank and every step."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(4, inputs, generator=g), torch.randn(4, outputs, generator=g)


def mean_square_error(output, y) -> torch.Tensor:
    return ((output - y) ** 2).mean()


def loss_of(model, x, y) -> torch.Tensor:
    return mean_square_error(model(x), y)
