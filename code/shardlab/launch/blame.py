"""Which rank ended a launch: the cause, not the first echo of it.

When one rank fails, its peers soon fail too (their collectives lose a peer), and which
end the launcher learns of first is a matter of timing: on a busy machine it often sees an
echo first. Measured before this rule, a rank killed from outside on a loaded 2-core
machine was named in 1 of 3 trials, a peer whose collective then failed in the others.
Apart from the launcher because it is a rule of its own, read from the run folder and the
ranks' exit codes alone.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from shardlab.launch.errors import RankFailed
from shardlab.launch.hygiene import RankProcess


# What a collective raises when a peer is gone (gloo, NCCL): an echo of another failure.
LOST_PEER = ("closed by peer", "reset by peer", "Broken pipe", "remote worker",
             "communicator was aborted", "Connection refused")
ECHO_GRACE = 2.0  # seconds to wait, after an echo, for the rank that caused it to end


FAULT_MARK = "Fatal Python error: "  # how faulthandler begins its report
FAULT_LINES = 40  # enough for the crashing thread's stack and the others' first frames


def fault_report(run_dir: Path, rank: int) -> str:
    """What Python's faulthandler wrote in rank `rank`'s stderr file when native code
    crashed it (the launcher enables it in every rank): "" when it wrote nothing."""
    try:
        text = (run_dir / f"rank{rank}.err").read_text(errors="replace")
    except OSError:
        return ""
    at = text.rfind(FAULT_MARK)
    if at < 0:
        return ""
    lines = text[at:].rstrip().splitlines()
    more = len(lines) - FAULT_LINES
    return "\n".join(lines[:FAULT_LINES] + ([f"... ({more} more lines in the rank's "
                                                f"stderr)"] if more > 0 else []))


def _ended_silently(ranks: list[RankProcess], run_dir: Path) -> list[RankProcess]:
    """Ranks that ended without an error written and without a result: killed by a
    signal, or exited without a word."""
    return [r for r in ranks if r.process.exitcode is not None
            and not (run_dir / f"rank{r.rank}.error").exists()
            and (r.process.exitcode != 0 or not (run_dir / f"rank{r.rank}.result").exists())]


def how_it_ended(code: int, crashed: bool) -> str:
    """A silent end, from the rank's exit code, said after "rank R ": a signal (from
    outside, or a crash in native code, which `crashed` says) or an exit without a word."""
    if code >= 0:
        return f"exited with code {code} without a result or an error"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = str(-code)
    if crashed:
        return f"crashed in native code (signal {name})"
    return f"was killed by signal {name} (from outside, or by the kernel for lack of memory?)"


def the_cause(ranks: list[RankProcess], run_dir: Path) -> RankFailed:
    """The rank whose failure ended the launch, whatever order the launcher learnt of
    the ends in.

    When one rank fails, its peers soon fail too (their collectives lose a peer), and
    which end the launcher sees first is a matter of timing: on a busy machine it often
    sees an echo first. So the order of arrival decides nothing. A rank that ended
    without writing an error (killed by a signal, or exiting without a word) is the cause:
    it cannot be an echo, since an echo is a collective that fails and says so. Its end
    may reach this process a moment after the echo (its sockets close before the kernel
    lets its parent read its exit), so an echo waits up to `ECHO_GRACE` for it. Only among
    ranks that wrote an error is the first one written the cause (a rank that raises
    writes before its peers can notice it is gone).

    A rank that died is named with how, in the last line of `rank_traceback` (the line
    a command line prints), and every rank that died is in the error's `died`."""
    errors = sorted(run_dir.glob("rank*.error"), key=lambda p: p.stat().st_mtime_ns)
    silent = _ended_silently(ranks, run_dir)
    if not silent and errors and any(m in errors[0].read_text() for m in LOST_PEER):
        # A peer lost: the rank that broke it ends within moments (its sockets close a
        # little before the kernel lets its parent read its end). Wait for that, briefly.
        deadline = time.monotonic() + ECHO_GRACE
        while not silent and time.monotonic() < deadline and any(
                r.process.exitcode is None for r in ranks):
            time.sleep(0.02)
            silent = _ended_silently(ranks, run_dir)
    if not silent:
        first = errors[0]
        return RankFailed(int(first.name[4:-6]), first.read_text())
    faults = {r.rank: fault_report(run_dir, r.rank) for r in silent}
    died = {r.rank: how_it_ended(r.process.exitcode, bool(faults[r.rank])) for r in silent}
    cause = silent[0].rank
    echoes = sorted(int(p.name[4:-6]) for p in run_dir.glob("rank*.error"))
    after = ("" if not echoes else
             f"; rank {echoes[0]} then failed in its collectives" if len(echoes) == 1 else
             f"; ranks {', '.join(map(str, echoes))} then failed in their collectives")
    said = f"rank {cause} {died[cause]}{after}"
    if faults[cause]:
        said = (f"where rank {cause}'s threads were, from Python's faulthandler:\n"
                f"{faults[cause]}\n{said}")
    failed = RankFailed(cause, said)
    failed.died = died
    return failed
