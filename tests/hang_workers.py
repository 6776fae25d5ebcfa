"""Workers for the hang tests: they must live in an importable module."""

import tempfile

from shardlab.comm import per_step
from shardlab.config import TrainConfig
from shardlab.train import train_worker


def _summary(report) -> dict:
    """What a run reports that does not vary from run to run: losses, model states, and
    each step's collectives (calls and bytes; not their times)."""
    steps = [{op: {k: v for k, v in t.items() if k != "seconds"} for op, t in ops.items()}
             for ops in per_step(report.ledger)]
    return {"losses": report.losses, "state_bytes": report.state_bytes, "steps": steps,
            "psi": report.psi}


def train_with_and_without_recorder(config: TrainConfig) -> tuple[dict, dict]:
    """The same run twice on this rank: without a flight recorder, then with one."""
    plain = train_worker(config)
    with tempfile.TemporaryDirectory() as folder:
        recorded = train_worker(config, None, folder)
    return _summary(plain), _summary(recorded)
