"""Workers for test_deepspeed.py: many DeepSpeed training cases inside one launch.

Each rank trains a case with the course's own loop (`train.train_worker`), then trains the
single-process reference on the whole global batch itself, in the same process, so one
launch checks every case without paying for more process start-ups (DeepSpeed's own
start-up, about a second a rank, is paid once too).
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from shardlab.config import TrainConfig
from shardlab.models import build_model
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.strategy import get_strategy
from shardlab.train import train_worker
from zero_workers import compared, reference


def parity_cases(cases: list[TrainConfig]) -> list[dict]:
    """Train every case on this group through the loop; compare with one process."""
    world = dist.get_world_size()
    out = []
    for config in cases:
        config = replace(config, world=world, keep_params=True)
        report = train_worker(config)
        ref_losses, ref_params = reference(config)
        assert report.params.keys() == ref_params.keys(), config
        out.append({**compared(config, report, ref_losses, ref_params),
                    "model_config": config.model_config, "options": dict(config.options),
                    "steps": config.steps})
    return out


def refusals(cases: list[tuple[str, str, dict]]) -> list[str]:
    """(strategy, precision, options) that must be refused: each error's message, on every
    rank, before any collective (so the next case still runs)."""
    out = []
    for strategy, precision, options in cases:
        try:
            get_strategy(strategy)(build_model("gpt-tiny", 0), get_precision(precision),
                                   optimizer_spec("adamw", 1e-3), dict(options))
        except ValueError as exc:
            out.append(str(exc))
        else:
            out.append("accepted")
    return out


def checkpoint_refusal() -> str:
    """Ask the loop to save a checkpoint of a DeepSpeed run: the message it refuses with."""
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        # the same folder name on every rank, as a shared file system would give
        folder_list = [folder]
        dist.broadcast_object_list(folder_list, src=0)
        try:
            train_worker(TrainConfig(strategy="deepspeed-zero2", world=dist.get_world_size(),
                                     steps=1, save_every=1, checkpoint_dir=folder_list[0],
                                     measure_memory=False, record_ledger=False))
        except ValueError as exc:
            return str(exc)
    return "saved"


def suite(cases: list[TrainConfig], refused: list[tuple[str, str, dict]]) -> dict:
    return {"parity": parity_cases(cases), "refusals": refusals(refused),
            "checkpoint": checkpoint_refusal()}
