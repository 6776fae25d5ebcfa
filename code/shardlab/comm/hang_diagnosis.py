"""What the ranks' flight recorders say about a hang, in one paragraph.

A collective completes only when every rank of its group has called it with the same
kind, size and type. So a hang is found by laying the ranks' recorded collectives side
by side, numbered within their group (`seq`), and asking two questions, in this order:

1. *Where do the ranks disagree?* At the first `seq` that differs: another kind, another
   size or type, the same two collectives in opposite order, the same collective issued
   from other code (one rank is in `generate`, the others in the training step), or from
   another step (one rank skipped a collective, and its next one paired with the
   others' previous one). A rank that disagrees is the one to look at: with three ranks
   or more, the one that differs from the majority.
2. *Who is behind?* If the ranks agree on every collective they share, the rank whose
   last collective has the lowest `seq` never called the one the others wait in.

If every rank waits in the same collective, the program's paths agree: look at the
network, or at a peer's process that died or was stopped.

A rank that *died* (killed by a signal, crashed in native code: the launcher knows, from
its exit) is neither: it is the cause, and the others only waited for it. So where the
recorders show no disagreement, a death is said first, with where the dead rank was and
what the others waited in, and no advice about diverging code; where they do show one (gloo
aborts a rank on a size mismatch), the disagreement comes first and the death after it.

PyTorch's trace analyser (`torch.distributed.flight_recorder`, the `fr_trace` command)
asks the same questions of its own recorder's dumps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from shardlab.comm.flight import FlightDump, FlightEntry

CAUSES = ("order", "kind", "size", "dtype", "path", "step", "died", "behind", "together",
          "none")


@dataclass
class HangDiagnosis:
    """cause: one of CAUSES. ranks: the ranks to look at (the one behind, the ones that
    disagree, the ones that died). seq and group: the collective where it shows. sides:
    each rank's entry at that collective (or, for "behind" and "died", its last one).
    text: the paragraph."""

    cause: str
    ranks: list[int]
    seq: int
    group: str
    sides: dict[int, FlightEntry | None] = field(default_factory=dict)
    text: str = ""

    def __str__(self) -> str:
        return self.text


def _signature(entry: FlightEntry) -> tuple:
    return entry.op, entry.numel, entry.dtype


def _odd_ones(values: dict[int, object]) -> list[int]:
    """The ranks whose value differs from the majority's (from rank 0's on a tie)."""
    counts = Counter(values.values())
    top = max(counts.values())
    first = next(iter(values.values()))
    majority = first if counts[first] == top else counts.most_common(1)[0][0]
    return sorted(r for r, v in values.items() if v != majority)


def _how(dump: FlightDump) -> str:
    if dump.state == "returned":
        return "returned"
    if dump.state == "raised":
        return f"raised {dump.error}"
    return "was stopped inside a collective (or its process ended there)"


def _from(entry: FlightEntry) -> str:
    where = f" from {entry.issuer}" if entry.issuer else ""
    state = "finished" if entry.finished else "never finished"
    step = f"step {entry.step}, " if entry.step >= 0 else ""
    return f"{entry.describe()}{where} ({step}{state})"


def _disagreement(group: str, seq: int, at: dict[int, FlightEntry],
                  nxt: dict[int, FlightEntry]) -> HangDiagnosis | None:
    signatures = {r: _signature(e) for r, e in at.items()}
    checks = [("kind", {r: e.op for r, e in at.items()}),
              ("size", {r: e.numel for r, e in at.items()}),
              ("dtype", {r: e.dtype for r, e in at.items()}),
              # the issuer and the step where the recorder knows them (PyTorch's knows
              # neither for a collective no rank waits in)
              ("path", {r: e.issuer for r, e in at.items() if e.issuer}),
              ("step", {r: e.step for r, e in at.items() if e.step >= 0})]
    if len(set(signatures.values())) > 1:
        for a in at:
            for b in at:
                if a < b and a in nxt and b in nxt and \
                        signatures[a] == _signature(nxt[b]) and \
                        signatures[b] == _signature(nxt[a]) and signatures[a] != signatures[b]:
                    text = (f"The ranks call two collectives in opposite order in group "
                            f"{group!r}: at seq {seq} rank {a} calls {_from(at[a])} and rank "
                            f"{b} calls {_from(at[b])}; at seq {seq + 1} each calls the "
                            f"other's. Each waits for a partner that is in the other "
                            f"collective. Issue them in one order on every rank (sorted "
                            f"names, not a set's or a dict's order built from the rank's "
                            f"own data).")
                    pairs = {r: (signatures[r], _signature(nxt[r]))
                             for r in at if r in nxt}
                    return HangDiagnosis("order", _odd_ones(pairs), seq, group, dict(at),
                                         text)
    for cause, values in checks:
        if len(set(values.values())) < 2:
            continue
        odd = _odd_ones(values)
        sides = "; ".join(f"rank {r} calls {_from(e)}" for r, e in sorted(at.items()))
        advice = {
            "kind": "the ranks took different paths: one is in another collective",
            "size": "a size computed from something only this rank holds (its own batch "
                    "or shard): agree on the size first, or pad to it",
            "dtype": "a tensor cast on some ranks only",
            "path": "the same kind of collective, issued from other code: one rank runs "
                    "code the others skip (a generate() or a full state dict on one "
                    "rank only), and its collectives pair with the others' next ones",
            "step": "the ranks are in different steps: the rank ahead skipped a "
                    "collective of the earlier step (a filtered sample, a skipped "
                    "backward), and its next collective paired with the others' "
                    "previous one",
        }[cause]
        text = (f"The ranks disagree at seq {seq} of group {group!r} ({cause} mismatch): "
                f"{sides}. Look at rank(s) {odd}: {advice}.")
        return HangDiagnosis(cause, odd, seq, group, dict(at), text)
    return None


def _disagreement_in(group: str, dumps: dict[int, FlightDump]) -> HangDiagnosis | None:
    """The first seq of `group` at which the ranks that recorded it disagree."""
    by_rank = {r: {e.seq: e for e in d.entries if e.group == group} for r, d in dumps.items()}
    for seq in sorted({s for entries in by_rank.values() for s in entries}):
        at = {r: m[seq] for r, m in by_rank.items() if seq in m}
        nxt = {r: m[seq + 1] for r, m in by_rank.items() if seq + 1 in m}
        if len(at) > 1:
            found = _disagreement(group, seq, at, nxt)
            if found is not None:
                return found
    return None


def _behind_or_together(group: str, dumps: dict[int, FlightDump]) -> HangDiagnosis | None:
    by_rank = {r: {e.seq: e for e in d.entries if e.group == group} for r, d in dumps.items()}
    last = {r: max(m, default=-1) for r, m in by_rank.items()}
    top = max(last.values(), default=-1)
    behind = sorted(r for r, s in last.items() if s < top)
    if behind:
        lag = min(last[r] for r in behind)
        # the next collective after the laggard's last (numbers start at 0 in the course's
        # recorder, at 1 in PyTorch's)
        following = min(s for m in by_rank.values() for s in m if s > lag)
        waiting = {r: m[following] for r, m in by_rank.items() if following in m}
        their_last = "; ".join(
            f"rank {r}'s last is seq {last[r]}, {_from(by_rank[r][last[r]])}, and then "
            f"it {_how(dumps[r])}" if last[r] >= 0 else
            f"rank {r} called none, and {_how(dumps[r])}" for r in behind)
        waits = "; ".join(f"rank {r} waits in {_from(e)}" for r, e in sorted(waiting.items()))
        if all(dumps[r].state == "raised" for r in behind):
            advice = (f"Rank(s) {behind} raised before calling it: their error is the cause, "
                      f"and the others waited for ranks that had stopped.")
        else:
            advice = (f"Rank(s) {behind} never called it: look for a branch their code took "
                      f"and the others' did not (a decision taken from a value only some "
                      f"ranks hold, an uneven number of batches, a skipped sample).")
        text = (f"Rank(s) {behind} are behind in group {group!r}: {their_last}. At seq "
                f"{following}, {waits}. {advice}")
        sides = {r: (by_rank[r].get(last[r]) if r in behind else waiting.get(r))
                 for r in by_rank}
        return HangDiagnosis("behind", behind, following, group, sides, text)
    open_ = {r: m[top] for r, m in by_rank.items() if top in m and not m[top].finished}
    everyone_left = all(d.state == "returned" for d in dumps.values())
    if top >= 0 and len(open_) == len(by_rank) and not everyone_left:
        entry = next(iter(open_.values()))
        text = (f"Every rank waits in the same collective, seq {top} of group {group!r}: "
                f"{_from(entry)}. The ranks' paths agree; look at the network, or at a "
                f"peer's process that died or was stopped.")
        return HangDiagnosis("together", sorted(by_rank), top, group, dict(open_), text)
    return None


def _last(dump: FlightDump | None) -> FlightEntry | None:
    return max(dump.entries, key=lambda e: e.index) if dump and dump.entries else None


def _death(dumps: dict[int, FlightDump], died: dict[int, str]) -> HangDiagnosis:
    """The ranks that died, first, where each was; then what the others waited in."""
    dead = sorted(died)
    said = []
    for r in dead:
        entry = _last(dumps.get(r))
        if r not in dumps:
            where = ("; its recorder went with it (PyTorch's is read from a living rank), "
                     "so where it was is not known")
        elif entry is None:
            where = ", before its first collective"
        else:
            where = (f", {'inside' if not entry.finished else 'after'} seq {entry.seq} of "
                     f"group {entry.group!r}: {_from(entry)}")
        said.append(f"rank {r} {died[r]}{where}")
    others = []
    for r, dump in sorted(dumps.items()):
        entry = _last(dump)
        if r in died:
            continue
        if entry is None:
            others.append(f"rank {r} had called none")
        elif not entry.finished:
            others.append(f"rank {r} waited in seq {entry.seq} of group {entry.group!r}, "
                          f"{_from(entry)}")
        else:
            others.append(f"rank {r}'s last was seq {entry.seq} of group {entry.group!r}, "
                          f"{_from(entry)}, and then it {_how(dump)}")
    first = _last(dumps.get(dead[0]))
    text = (f"{'; '.join(said)[0].upper()}{'; '.join(said)[1:]}. "
            + (f"Then {'; '.join(others)}. " if others else "")
            + f"The recorded collectives show no disagreement between the ranks' code: the "
              f"cause is what ended rank(s) {dead}, and the others only waited for it.")
    sides = {r: _last(d) for r, d in dumps.items()}
    return HangDiagnosis("died", dead, first.seq if first else -1,
                         first.group if first else "", sides, text)


def diagnose(dumps: dict[int, FlightDump], died: dict[int, str] | None = None,
             world: int | None = None) -> HangDiagnosis:
    """Compare the ranks' flight recorders (`shardlab.comm.read_flight`); say what
    happened in one paragraph (`str()` of the result). died: the ranks that died, each
    with how ("was killed by signal SIGKILL", from the launcher, which saw them end);
    world: the number of ranks, where some wrote no recorder."""
    died = dict(died or {})
    if not dumps and not died:
        return HangDiagnosis("none", [], -1, "", {}, "No rank wrote a flight recorder file.")
    world = max([d.world for d in dumps.values()] + [world or 0, max(died, default=-1) + 1])
    missing = sorted(set(range(world)) - set(dumps) - set(died))
    groups: list[str] = []
    for dump in dumps.values():
        for entry in dump.entries:
            if entry.group not in groups:
                groups.append(entry.group)
    # a group with a collective that never finished first: that is where the ranks wait
    groups.sort(key=lambda g: all(e.finished for d in dumps.values() for e in d.entries
                                  if e.group == g))
    found = None
    for group in groups:
        found = _disagreement_in(group, dumps)
        if found is None and not died:
            found = _behind_or_together(group, dumps)
        if found is not None:
            break
    if found is not None and died:
        found.text += " " + " ".join(f"Rank {r} then {how}." for r, how in sorted(died.items()))
    elif died:
        found = _death(dumps, died)
    if found is not None:
        if missing:
            found.text += f" Rank(s) {missing} wrote no flight file."
        return found
    text = ("The ranks agree on every collective they recorded, and each finished them "
            "all: no hang shows in the recorded collectives.")
    return HangDiagnosis("none", missing, -1, "", {}, text)


__all__ = ["HangDiagnosis", "diagnose", "CAUSES"]
