"""What a launch raises: one error type a caller can catch, and two that say what happened.

A module of its own because every part of `shardlab.launch` raises them and a caller
(the CLI, the loop, a lab) catches them without caring where they come from.
"""

from __future__ import annotations

from typing import Any


class LaunchError(RuntimeError):
    """A launch that could not start, or whose ranks did not all finish.

    When the ranks' flight recorders say something about a failed launch, `hang` holds
    their diagnosis (a `shardlab.comm.HangDiagnosis`) and the message ends with it;
    `died` names the ranks that died, each with how ("was killed by signal SIGKILL")."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.hang: Any = None
        self.died: dict[int, str] = {}
        self._bare = str(self)

    def explain(self, diagnosis: Any) -> None:
        """End the message with what the recorders say, replacing what an earlier
        recorder said (the course's own, where the function kept one, says more than
        PyTorch's)."""
        self.hang = diagnosis
        self.args = (f"{self._bare}\n\nWhat the flight recorders say: {diagnosis}",)


class RankFailed(LaunchError):
    """One rank raised or died; `rank` names it and `rank_traceback` is its traceback
    (for a rank that died, what the launcher saw of its end, said last)."""

    def __init__(self, rank: int, rank_traceback: str):
        self.rank = rank
        self.rank_traceback = rank_traceback
        super().__init__(f"rank {rank} failed; the other ranks were stopped.\n"
                         f"--- traceback of rank {rank} ---\n{rank_traceback}")


class LaunchTimeout(LaunchError):
    """The timeout passed while some ranks were still running."""

    def __init__(self, timeout: float, unfinished: list[int]):
        self.unfinished = unfinished
        super().__init__(f"timed out after {timeout:g} s; ranks {unfinished} had not finished "
                         f"and were stopped. Raise `timeout=` if the job is just slow, or look "
                         f"for a collective that only some ranks call.")


def refusal_of(failed: RankFailed) -> ValueError | None:
    """The bad input a rank refused before training (a bad option, a model that differs
    across ranks, a checkpoint that does not fit), as the one-line ValueError it is; None
    for any other failure."""
    last = failed.rank_traceback.strip().splitlines()[-1]
    kind, _, message = last.partition(": ")
    if kind.rsplit(".", 1)[-1] in ("ValueError", "CheckpointError"):
        return ValueError(message)
    return None
