"""SIMULATION: a training run of the course's loop with its ranks as threads of this
process (`shardlab.many_ranks.threads`): `shardlab.train.run`, at N = 64 on two cores.

The same checks before any rank starts (the config, the checkpoint to resume, one writer
per checkpoint folder), the same loop on every rank (`shardlab.train.train_rank`), the
same reports back. What differs is what the simulation says it does not model: time and
each rank's own memory (see `threads`); a run's step times and peaks here say nothing of
N GPUs, its losses, parameters, checkpoints and bytes do.
"""

from __future__ import annotations

from dataclasses import replace

from shardlab.cards import card
from shardlab.config import TrainConfig, checkpoint_folders_locked
from shardlab.launch.errors import RankFailed, refusal_of
from shardlab.many_ranks.threads import DEFAULT_TIMEOUT, launch_threads
from shardlab.report import RunReport
from shardlab.train import train_many, train_rank


def run_on_threads(config: TrainConfig, timeout: float = DEFAULT_TIMEOUT) -> list[RunReport]:
    """Train `config` on `config.world` ranks that are threads; the ranks' reports in rank
    order. A bad option or a checkpoint that cannot be resumed is refused in one line
    (ValueError), before training or from the ranks, as `shardlab.train.run` refuses it."""
    if card(config.strategy).one_process:
        config = replace(config, world=1)
    config.validate()
    with checkpoint_folders_locked(config):
        config.check_resume()
        return _refused_in_one_line(lambda: launch_threads(train_rank, config.world, config,
                                                           timeout=timeout))


def train_many_on_threads(configs: list[TrainConfig],
                          timeout: float = DEFAULT_TIMEOUT) -> list[list[RunReport]]:
    """Several runs of one world size, one after the other, on one launch of threads (as
    `shardlab.train.train_many` on processes): per rank, its reports in config order."""
    worlds = {c.world for c in configs}
    if len(worlds) != 1:
        raise ValueError(f"one launch runs one world size; got {sorted(worlds)}")
    for config in configs:
        config.validate()
    return _refused_in_one_line(lambda: launch_threads(train_many, worlds.pop(), configs,
                                                       timeout=timeout))


def _refused_in_one_line(launch):
    try:
        return launch()
    except RankFailed as failed:
        refusal = refusal_of(failed)
        if refusal is not None:
            raise refusal from failed
        raise
