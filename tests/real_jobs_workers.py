"""Workers of tests/test_real_jobs.py (ranks import their function)."""

import torch

from shardlab.fsdp import fully_shard
from shardlab.models import build_model, get_batch, loss_fn


def _one_step(optimizer_first: bool) -> str | None:
    model = build_model("gpt-tiny")
    optimizer = torch.optim.AdamW(model.parameters()) if optimizer_first else None
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = optimizer or torch.optim.AdamW(model.parameters())
    x, y = get_batch(0, torch.distributed.get_rank(), 2, 4, 8)
    loss_fn(model(x), y).backward()
    try:
        optimizer.step()
    except ValueError as refused:
        return str(refused)
    return None


def optimizer_before_and_after_fully_shard() -> tuple[str | None, str | None]:
    return _one_step(optimizer_first=True), _one_step(optimizer_first=False)
