"""Workers for test_resume_many_ranks.py: the loop's runs with the samples each rank read.

`samples_recorded()` wraps the loop's reader of batches (`shardlab.train.get_batch`) so
that every read is written down: the step, the rank, the world, the ids of its samples
(`shardlab.models.sample_ids`) and the rows themselves. A test then checks the data
position of a run resumed on another number of ranks by what it read, not by what it was
told: each sample once, the same rows as the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import threading

import shardlab.train as loop
from shardlab.models import sample_ids
from shardlab.config import TrainConfig
from shardlab.train import train_worker


@contextlib.contextmanager
def samples_recorded():
    """Inside the block, every batch the loop reads (on any thread of this process) is
    appended to the list yielded: (step, rank, world, sample ids, x)."""
    original, seen, lock = loop.get_batch, [], threading.Lock()

    def recording(step, rank, world, batch_size, seq_len, seed=0, micro=0, micro_steps=1,
                  variable_lengths=False):
        x, y = original(step, rank, world, batch_size, seq_len, seed, micro, micro_steps,
                        variable_lengths)
        ids = sample_ids(step, rank, world, batch_size, micro, micro_steps)
        with lock:
            seen.append((step, rank, world, tuple(ids), x.clone()))
        return x, y

    loop.get_batch = recording
    try:
        yield seen
    finally:
        loop.get_batch = original


def train_many_recording(configs: list[TrainConfig]) -> list[tuple]:
    """Worker: each config's run on this rank, with the samples it read."""
    out = []
    for config in configs:
        with samples_recorded() as seen:
            report = train_worker(config)
        out.append((report, list(seen)))
    return out
