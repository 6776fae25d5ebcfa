"""What every grader shares: launch the check on N ranks, agree on the first failure, say it
in one line (which rank, which step, which bytes), and why, when it is a known mistake.

A grader's check runs on every rank and compares as it goes. At each comparison the ranks
exchange what they found (`agree`), so that all of them stop at the same place when one
finds a difference: a rank that stopped alone would leave its peers waiting in a collective.

At the first difference, the ranks also run the catalogue of typical mistakes
(`graders/wrong.py`) on the inputs your code had: if your output equals one mistake's on
every rank, the line ends with that mistake's hint ("the sum over 2 ranks, not the mean").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shardlab.launch import LaunchTimeout, RankFailed, launch

PASS = "passes"


class Wrong(Exception):
    """What is wrong with the graded code, on this rank, in one line."""


@dataclass(frozen=True)
class Mistake:
    """A wrong answer a reader could write (the same functions or class the exercise asks
    for), and the hint a grader adds when yours gives the same output: `{world}` in it is
    replaced by the number of ranks."""
    answer: Any
    hint: str


def agree(problem: str | None, *, got: Any = None, mistakes: Sequence[Mistake] = (),
          rerun: Callable[[Any], Any] | None = None, atol: float = 0.0,
          rtol: float = 0.0) -> None:
    """Every rank says what it found; if any found a problem, every rank raises the first
    rank's (rank order), so that all stop together.

    With `mistakes`, the ranks first run `rerun(mistake.answer)` for each (the same inputs
    that gave your output `got`): the first mistake whose output equals yours on every rank,
    within `atol` and `rtol`, adds its hint to the line."""
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    for rank, message in enumerate(found):
        if message is not None:
            hint = which_mistake(got, mistakes, rerun, atol, rtol) if mistakes else None
            raise Wrong(f"rank {rank}, {message}" + (f"; {hint}" if hint else ""))


def which_mistake(got: Any, mistakes: Sequence[Mistake], rerun: Callable[[Any], Any],
                  atol: float = 0.0, rtol: float = 0.0) -> str | None:
    """The hint of the first mistake whose output equals `got` on every rank, or None. Every
    rank runs every mistake, in the same order: a mistake calls collectives as an answer
    does, so a rank that skipped one would leave the others waiting."""
    for mistake in mistakes:
        try:
            same = same_output(got, rerun(mistake.answer), atol, rtol)
        except Exception:  # noqa: BLE001 - a mistake that cannot run here is not yours
            same = False
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, same)
        if all(everyone):
            return mistake.hint.format(world=dist.get_world_size())
    return None


def same_output(a: Any, b: Any, atol: float = 0.0, rtol: float = 0.0) -> bool:
    """Whether two outputs are the same: tensors of one shape and dtype whose values agree
    within the tolerances, or dicts, lists and tuples of such, or equal plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and first_difference(a, b, "", atol, rtol) is None)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_output(a[k], b[k], atol, rtol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_output(x, y, atol, rtol) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def call(what: str, fn: Callable, *args: Any) -> Any:
    """Call the code being graded; what it raises becomes a one-line problem, not a traceback.
    (If it raises on some ranks only, the others wait in a collective: the grader's timeout
    then says so.)"""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the reader's code may raise anything
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise Wrong(f"rank {dist.get_rank()}, {what} raised {type(exc).__name__}"
                    + (f": {message}" if message else "")) from None


def first_difference(got: Any, expected: torch.Tensor, reference: str,
                     atol: float = 0.0, rtol: float = 0.0) -> str | None:
    """None if `got` equals `expected` (within the tolerances); else where they first differ,
    down to the bytes of the first wrong element."""
    if not isinstance(got, torch.Tensor):
        return f"returned a {type(got).__name__}, not a tensor"
    if got.shape != expected.shape:
        return (f"returned shape {tuple(got.shape)}, {reference} has "
                f"{tuple(expected.shape)}")
    if got.dtype != expected.dtype:
        return f"returned {got.dtype}, {reference} has {expected.dtype}"
    g, e = got.detach().float().flatten().cpu(), expected.detach().float().flatten().cpu()
    bad = ((g - e).abs() > atol + rtol * e.abs()) | (g.isnan() != e.isnan())
    if not bad.any():
        return None
    i = int(bad.nonzero()[0])
    size = expected.element_size()
    return (f"element {i} (bytes {i * size}-{(i + 1) * size - 1}) is {_value(g[i].item())}, "
            f"{reference} has {_value(e[i].item())} ({int(bad.sum())} of {e.numel()} differ)")


def _value(x: float) -> str:
    """Four significant digits, in powers of ten below 0.01: the line is stored in labs,
    where a long run of decimals reads as a claim to precision the value does not have."""
    return f"{x:.3e}" if 0 < abs(x) < 0.01 else f"{x:.4g}"


def run_each(candidates: list, check_one: Callable, *args: Any) -> list[tuple[str, Any]]:
    """On a rank: grade each candidate in turn: (PASS or the first problem's line, what the
    check hands back for the lab to show, such as a ledger)."""
    verdicts = []
    for candidate in candidates:
        try:
            extra = check_one(candidate, *args)
            agree(None)
            verdicts.append((PASS, extra))
        except Wrong as wrong:
            verdicts.append((str(wrong), None))
        dist.barrier()
    return verdicts


def grade_on_ranks(worker: Callable, world: int, candidates: list, *args: Any,
                   timeout: float = 120.0) -> list[tuple[str, Any]]:
    """Launch `worker(candidates, *args)` on `world` ranks: rank 0's (verdict, extra) per
    candidate. Always gloo on the CPU: a grader compares values, not speed, and the same
    placement on every machine (a laptop, Colab's one GPU, a node of eight) keeps what it
    compares the same."""
    try:
        per_rank = launch(worker, world, candidates, *args, timeout=timeout,
                          backend="gloo", device="cpu")
    except LaunchTimeout as exc:
        return [(f"ranks {exc.unfinished} still running after {timeout:g} s: a rank that "
                 f"waits for a peer that never sends (or skipped a collective the others ran)?",
                 None)] * len(candidates)
    except RankFailed as exc:
        last = exc.rank_traceback.strip().splitlines()[-1]
        return [(f"rank {exc.rank} failed: {last}", None)] * len(candidates)
    return per_rank[0]


def show(exercise: str, verdict: str) -> bool:
    """Print the verdict as the lab shows it; True if it passes."""
    if verdict == PASS:
        print(f"✓ {exercise}: passes")
        return True
    print(f"✗ {exercise}: {verdict}")
    return False
