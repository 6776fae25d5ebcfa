"""Small workers for the first lab and the launcher's own examples."""

from __future__ import annotations

import torch.distributed as dist


def whoami() -> tuple[int, int, str]:
    """Return (rank, world size, backend): the smallest proof that N ranks ran."""
    return dist.get_rank(), dist.get_world_size(), dist.get_backend()
