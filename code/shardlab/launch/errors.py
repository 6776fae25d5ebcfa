"""What a launch raises: one error type a caller can catch, and two that say what happened.

A module of its own because every part of `shardlab.launch` raises them and a caller
(the CLI, the loop, a lab) catches them without caring where they come from.
"""

from __future__ import annotations


class LaunchError(RuntimeError):
    """A launch that could not start, or whose ranks did not all finish."""


class RankFailed(LaunchError):
    """One rank raised; `rank` names it and `rank_traceback` is its traceback."""

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
