"""What every grader shares: launch the check on N ranks, agree on the first failure, say it
in one line (which rank, which step, which bytes), and why, when it is a known mistake.

A grader's check runs on every rank and compares as it goes. At each comparison the ranks
exchange what they found (`agree`), so that all of them stop at the same place when one
finds a difference: a rank that stopped alone would leave its peers waiting in a collective.

At the first difference, the ranks also run the catalogue of typical mistakes
(`graders/wrong.py`) on the inputs your code had: if your output equals one mistake's on
every rank, the line ends with that mistake's hint ("the sum over 2 ranks, not the mean").

Your code's sends and receives go over a process group of their own whose timeout is
`RECV_PATIENCE` seconds: a ring in which every rank receives before it sends waits that long,
not the launch's two minutes, and the ranks then tell each other where they waited, so the
line can say "every rank is waiting in recv". The timeout breaks that group only; each
candidate gets a fresh one. An exception in your code names the line of your cell it came
from, and a rank that leaves the check alone (its code raised) is met by the others at their
next comparison, so it is named rather than left to the launch's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import sysconfig
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

import shardlab
from shardlab.launch import LaunchTimeout, RankFailed, launch

PASS = "passes"
RECV_PATIENCE = 10.0  # seconds a receive in the graded code waits before the ranks compare


class Wrong(Exception):
    """What is wrong with the graded code, on this rank, in one line."""


@dataclass(frozen=True)
class Outcome:
    """How the check of one candidate ended on one rank, as the ranks tell each other: its
    problem's line, or the call that waited in a receive (`waited`), for which rank
    (`source`, None if unknown), and how many messages its code had sent to and received
    from each peer."""
    rank: int
    problem: str | None = None
    waited: str | None = None
    source: int | None = None
    sent: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)


class Waiting(Wrong):
    """This rank's graded code waited in a receive as long as the grader is patient."""

    def __init__(self, outcome: Outcome):
        super().__init__(f"rank {outcome.rank}, {outcome.waited}: waited in recv")
        self.outcome = outcome


class _Left(Wrong):
    """A peer left the check while this rank agreed: every rank's outcome, as gathered."""

    def __init__(self, outcomes: list[Outcome]):
        super().__init__("a peer left the check")
        self.outcomes = outcomes


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
    if any(isinstance(f, Outcome) for f in found):
        # a peer left its check (its code raised, or waited in recv) and gathered in
        # `run_each` with this one: the check is over, on every rank, with these outcomes
        raise _Left(_as_outcomes(found))
    for rank, message in enumerate(found):
        if message is not None:
            hint = which_mistake(got, mistakes, rerun, atol, rtol) if mistakes else None
            raise Wrong(f"rank {rank}, {message}" + (f"; {hint}" if hint else ""))


def _as_outcomes(found: list[Any]) -> list[Outcome]:
    """What one gather brought: the outcomes of ranks that left their check (`run_each`),
    and the problems (or None) of ranks that were comparing (`agree`), as outcomes."""
    return [f if isinstance(f, Outcome) else Outcome(rank, problem=f and f"rank {rank}, {f}")
            for rank, f in enumerate(found)]


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
    """Call the code being graded; what it raises becomes a one-line problem that names
    the line of your cell it came from, not a traceback. Its sends and receives go over
    the candidate's own group (`run_each`): a receive that outlives the group's patience
    ends the call as `Waiting`, and the ranks then say together where each waited.
    (If it raises on some ranks only, while the others wait in a collective, the
    grader's timeout says so.)"""
    traffic = _Traffic()
    try:
        with _point_to_point_over(_graded_group, traffic):
            return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the reader's code may raise anything
        rank = dist.get_rank()
        if _gave_up(exc):
            raise Waiting(Outcome(rank, waited=what, source=traffic.waiting_for,
                                  sent=dict(traffic.sent),
                                  received=dict(traffic.received))) from None
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise Wrong(f"rank {rank}, {what} raised {type(exc).__name__}"
                    + (f": {message}" if message else "") + _where(exc)) from None


# --- the graded code's sends and receives ----------------------------------------------

_graded_group: dist.ProcessGroup | None = None  # the candidate's group, set by run_each

# gloo's words when a receive outlived the group's timeout, or when a peer that gave up
# closed the connection to this rank
_GAVE_UP = ("Timed out waiting", "Connection closed by peer", "pair closure")


def _gave_up(exc: Exception) -> bool:
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in _GAVE_UP)


class _Traffic:
    """What the graded code sent and received on this rank, by peer, and the peer it is
    waiting for in a receive (None when it is not)."""

    def __init__(self):
        self.sent: Counter = Counter()
        self.received: Counter = Counter()
        self.waiting_for: int | None = None


@contextlib.contextmanager
def _point_to_point_over(group: dist.ProcessGroup | None, traffic: _Traffic) -> Iterator[None]:
    """While the graded code runs: `dist.send`, `recv`, `isend` and `irecv` called without a
    group use `group` (whose timeout is the grader's patience), counted in `traffic`."""
    if group is None:
        yield
        return
    originals = {name: getattr(dist, name) for name in ("send", "recv", "isend", "irecv")}

    def over(name: str) -> Callable:
        real = originals[name]
        signature = inspect.signature(real)
        peer = "dst" if "send" in name else "src"

        def p2p(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            if bound.arguments.get("group") is None:
                bound.arguments["group"] = group
            peer_rank = bound.arguments.get(peer)
            if name in ("send", "isend"):
                traffic.sent[peer_rank] += 1
            elif name == "irecv":   # its wait is the reader's: counted when it is posted
                traffic.received[peer_rank] += 1
            else:
                traffic.waiting_for = peer_rank
                result = real(*bound.args, **bound.kwargs)
                traffic.waiting_for = None
                traffic.received[peer_rank] += 1
                return result
            return real(*bound.args, **bound.kwargs)
        return p2p

    try:
        for name in originals:
            setattr(dist, name, over(name))
        yield
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)


# Code of the reader's is what is not in these folders: the standard library, installed
# packages (torch), the graders, shardlab. A function written in a notebook cell travels
# to the ranks by value, and cloudpickle names its file "<dynamic-code>".
_NOT_YOURS = tuple(str(Path(p).resolve()) for p in (
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
    sysconfig.get_paths()["platlib"], Path(__file__).parent, Path(shardlab.__file__).parent))


def _where(exc: BaseException) -> str:
    """' (line 14 of your cell, in ring_reduce_scatter)': where in the reader's code
    `exc` was raised, the deepest frame of it; '' when none is the reader's."""
    for frame, line in reversed(list(traceback.walk_tb(exc.__traceback__))):
        file = frame.f_code.co_filename
        if file.startswith("<"):   # a notebook cell (or code compiled from a string)
            return f" (line {line} of your cell, in {frame.f_code.co_name})"
        if not str(Path(file).resolve()).startswith(_NOT_YOURS):
            return f" (line {line} of {Path(file).name}, in {frame.f_code.co_name})"
    return ""


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


def values(tensor: torch.Tensor, limit: int = 16) -> str:
    """A small tensor's values as a list, whole numbers without decimals, the first `limit`
    of a longer one: '[-6, 4, 1, 0]'."""
    flat = tensor.detach().flatten().float().cpu().tolist()
    shown = [str(int(x)) if float(x).is_integer() else _value(x) for x in flat[:limit]]
    more = f", ... {len(flat)} in all" if len(flat) > limit else ""
    return f"[{', '.join(shown)}{more}]"


def _value(x: float) -> str:
    """Four significant digits, in powers of ten below 0.01: the line is stored in labs,
    where a long run of decimals reads as a claim to precision the value does not have."""
    return f"{x:.3e}" if 0 < abs(x) < 0.01 else f"{x:.4g}"


def run_each(candidates: list, check_one: Callable, *args: Any,
             patience: float = RECV_PATIENCE) -> list[tuple[str, Any]]:
    """On a rank: grade each candidate in turn: (PASS or the first problem's line, what the
    check hands back for the lab to show, such as a ledger). Each candidate's sends and
    receives get a group of their own, whose receives wait `patience` seconds at most; at
    the end of each candidate, the ranks gather how it ended on every rank (`Outcome`) and
    give the same verdict."""
    global _graded_group
    verdicts = []
    for candidate in candidates:
        _graded_group = dist.new_group(backend="gloo",
                                       timeout=datetime.timedelta(seconds=patience))
        mine, everyone, extra = Outcome(dist.get_rank()), None, None
        try:
            extra = check_one(candidate, *args)
        except _Left as left:          # gathered already, inside an `agree`
            everyone = left.outcomes
        except Waiting as waiting:
            mine = waiting.outcome
        except Wrong as wrong:
            mine = Outcome(dist.get_rank(), problem=str(wrong))
        finally:
            _graded_group = None
        if everyone is None:          # the peers may be in an `agree`: the same gather
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            everyone = _as_outcomes(everyone)
        verdict = verdict_of(everyone, patience)
        verdicts.append((verdict, extra if verdict == PASS else None))
    return verdicts


def verdict_of(outcomes: list[Outcome], patience: float = RECV_PATIENCE) -> str:
    """One line for every rank's outcome of a candidate: the first rank's problem (a wrong
    result, an exception), else where the ranks waited, else PASS."""
    problems = [o.problem for o in outcomes if o.problem]
    if problems:
        return problems[0]
    waits = [o for o in outcomes if o.waited]
    if not waits:
        return PASS
    first = waits[0]
    source = "a peer" if first.source is None else f"rank {first.source}"
    if len(waits) < len(outcomes):
        return (f"rank {first.rank}, {first.waited}: waited {patience:g} s in recv from "
                f"{source}, which sent nothing more: does every rank run the same rounds?")
    unread = any(sent > outcomes[peer].received.get(o.rank, 0)
                 for o in outcomes for peer, sent in o.sent.items()
                 if peer is not None and 0 <= peer < len(outcomes))
    if unread:   # sent, but not to the rank that receives from the sender
        return (f"{first.waited}: every rank is waiting in recv (rank {first.rank} from "
                f"{source}) while what was sent is not received: does each rank receive from "
                f"the rank that sends to it?")
    return f"{first.waited}: every rank is waiting in recv: did each send before it received?"


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
