"""Diagrams of what a run recorded, rank by rank: a straggler's steps (who waits for
whom) and a hang's last collectives (where each rank waits).

They take a run's own records, `report.RunReport`s and the flight recorders'
`FlightDump`s (`comm.read_flight`), so a chapter draws its own run; `report.rank_spans`
says when a rank sat idle and `comm.diagnose` where the ranks part ways.
"""

from __future__ import annotations

import textwrap

from shardlab import report
from shardlab.comm.hang_diagnosis import diagnose
from shardlab.diagrams.draw import SMALLEST_PT, TITLE_PT, figure, legend_patches, pyplot
from shardlab.viz import COLLECTIVE_COLORS, PHASE_COLORS

# ----------------------------------------------------------------------------- straggler


def straggler_data(reports, steps=None) -> list[dict]:
    """Each rank's drawn steps from its `RunReport` (pass every rank's): the loop's
    phases and the spans it sat idle, waiting in a collective for the last rank to
    arrive (`report.rank_spans`), in ms from rank 0's start of the first step drawn, on
    rank 0's clock (each report's `clock_offset`). `steps`: the steps' indices in the
    reports (default: all but the first, warm-up, and the last, memory tracking)."""
    reports = list(reports)
    if not reports or any(not r.step_starts for r in reports):
        raise ValueError("pass every rank's RunReport of a run that recorded its ledger "
                         "(TrainConfig(record_ledger=True), the default)")
    count = len(reports[0].step_starts)
    steps = list(steps) if steps is not None else list(range(1, count - 1)) or [0]
    if any(not 0 <= s < count for s in steps):
        raise ValueError(f"steps must be indices of the {count} recorded steps")
    spans = report.rank_spans(reports)
    t0 = reports[0].step_starts[steps[0]] - reports[0].clock_offset
    out = []
    for rep, span in zip(reports, spans):
        begin, end = rep.step_starts[steps[0]], rep.step_starts[steps[-1]] + \
            rep.step_times[steps[-1]]

        def ms(a, b):
            shift = rep.clock_offset + t0
            return 1e3 * (a - shift), 1e3 * (b - shift)

        phases = [(what, *ms(a, b)) for s in steps for what, a, b in rep.phases[s]
                  if what in PHASE_COLORS]
        idle = [ms(max(a, begin), min(b, end)) for a, b in (span or {}).get("idle", [])
                if b > begin and a < end]
        out.append({"rank": rep.rank, "phases": phases, "idle": idle,
                    "idle_ms": sum(b - a for a, b in idle),
                    "step_starts": [ms(rep.step_starts[s], 0)[0] for s in steps]})
    return out


def straggler_figure(reports, steps=None, title: str = ""):
    """`straggler_data` drawn: a lane per rank, time to the right, what each computed
    and, in black beneath, when it waited for the others. The rank that never waits is
    the one the others wait for."""
    data = straggler_data(reports, steps)
    slowest = min(data, key=lambda d: d["idle_ms"])["rank"]
    fig, ax = figure(1.3 + 0.55 * len(data))
    for i, d in enumerate(data):
        y = len(data) - 1 - i
        for what, a, b in d["phases"]:
            ax.broken_barh([(a, b - a)], (y, 0.6), color=PHASE_COLORS[what])
        ax.broken_barh([(a, b - a) for a, b in d["idle"]], (y - 0.25, 0.2), color="black")
        for start in d["step_starts"]:
            ax.plot([start, start], [y - 0.3, y + 0.7], color="gray", lw=0.6)
    ax.set_yticks([len(data) - 1 - i + 0.3 for i in range(len(data))],
                  [f"rank {d['rank']}: waited {d['idle_ms']:,.0f} ms" for d in data],
                  fontsize=SMALLEST_PT)
    for label, d in zip(ax.get_yticklabels(), data):
        if d["rank"] == slowest:
            label.set_color("#C44E52")
            label.set_weight("bold")
    ax.set_xlabel("ms on rank 0's clock (grey ticks: each rank's step starts)",
                  fontsize=SMALLEST_PT)
    ax.spines[["top", "right", "left"]].set_visible(False)
    used = {w for d in data for w, *_ in d["phases"]}
    ax.legend(handles=legend_patches([(w, c) for w, c in PHASE_COLORS.items() if w in used]
                                     + [("waits for another rank", "black")]),
              loc="upper center", bbox_to_anchor=(0.45, -0.3 if len(data) < 4 else -0.22),
              ncol=3, frameon=False, fontsize=SMALLEST_PT)
    ax.set_title(title or f"Rank {slowest} waits least: the others wait for it",
                 loc="left", fontsize=TITLE_PT)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- hang


def hang_data(dumps, diagnosis=None) -> dict:
    """The ranks' flight-recorder entries (`comm.read_flight`) of the process group
    where the diagnosis (`comm.diagnose`, computed if not given) points, each rank's in
    the order it called them (`seq`), and how each rank's recorded code ended."""
    if not dumps:
        raise ValueError("no flight recorder files: pass comm.read_flight(folder) of a "
                         "run that kept them")
    diagnosis = diagnosis if diagnosis is not None else diagnose(dumps)
    group = diagnosis.group or next((e.group for d in dumps.values() for e in d.entries),
                                    "")
    ranks = {}
    for r, dump in sorted(dumps.items()):
        entries = sorted((e for e in dump.entries if e.group == group), key=lambda e: e.seq)
        ranks[r] = {"state": dump.state, "error": dump.error,
                    "entries": [{"seq": e.seq, "op": e.op, "numel": e.numel,
                                 "dtype": e.dtype, "step": e.step, "issuer": e.issuer,
                                 "finished": e.finished} for e in entries]}
    return {"group": group, "cause": diagnosis.cause, "seq": diagnosis.seq,
            "suspects": list(diagnosis.ranks), "text": diagnosis.text, "ranks": ranks}


_ENDED = {"returned": "left the code", "raised": "raised", "running": "stopped inside"}


def hang_figure(dumps, diagnosis=None, last: int = 6):
    """`hang_data` drawn: a lane per rank, its collectives of the group in the order it
    called them (seq), from the one before the diagnosis's seq or the `last` ones, each
    finished (solid) or never finished (hatched: where the rank waits); the seq where
    the diagnosis points is marked, and the ranks it names are in red."""
    data = hang_data(dumps, diagnosis)
    seqs = [e["seq"] for r in data["ranks"].values() for e in r["entries"]]
    high = max(seqs, default=0)
    low = max(min(seqs, default=0), min(high - last + 1, data["seq"] - 1))
    narrow = high - low + 1 > 5  # long names on two lines, to fit their boxes
    lanes = list(data["ranks"].items())
    fig, ax = figure(2.3 + 0.65 * len(lanes))
    for i, (rank, lane) in enumerate(lanes):
        y = len(lanes) - 1 - i
        shown = [e for e in lane["entries"] if e["seq"] >= low]
        for e in shown:
            color = COLLECTIVE_COLORS[report.op_kind(e["op"])]
            ax.add_patch(pyplot().Rectangle(
                (e["seq"] - 0.45, y + 0.05), 0.9, 0.85, facecolor=color if e["finished"]
                else "white", edgecolor=color, hatch=None if e["finished"] else "///",
                linewidth=1.5))
            name = e["op"].removeprefix("ring_").replace("_", "-")
            if narrow:
                name = name.replace("reduce-", "reduce-\n")
            ax.text(e["seq"], y + 0.47, f"{name}\n{e['numel']:,}\nstep {e['step']}",
                    ha="center", va="center", fontsize=SMALLEST_PT,
                    color="white" if e["finished"] else "black",
                    bbox=None if e["finished"] else {"facecolor": "white", "pad": 0.5,
                                                     "edgecolor": "none"})
        end = max((e["seq"] for e in shown), default=low - 1) + 0.55
        how = _ENDED.get(lane["state"], lane["state"])
        if lane["state"] == "raised" and "imed out" in lane["error"]:
            how = "timed out"
        ax.text(end, y + 0.47, how, ha="left", va="center", fontsize=SMALLEST_PT,
                color="gray")
    ax.axvline(data["seq"], color="#C44E52", ls="--", lw=1, zorder=0)
    ax.set_xlim(low - 0.6, high + 1.7)
    ax.set_ylim(-0.05, len(lanes))
    ax.set_xticks(range(low, high + 1))
    ax.set_xlabel(f"collectives of group {data['group']!r}, in the order each rank called "
                  f"them (seq)", fontsize=SMALLEST_PT)
    ax.set_yticks([len(lanes) - 1 - i + 0.47 for i in range(len(lanes))],
                  [f"rank {r}" for r, _ in lanes], fontsize=SMALLEST_PT)
    for label, (rank, _) in zip(ax.get_yticklabels(), lanes):
        if rank in data["suspects"]:
            label.set_color("#C44E52")
            label.set_weight("bold")
    ax.spines[["top", "right", "left"]].set_visible(False)
    suspects = ", ".join(str(r) for r in data["suspects"])
    ax.set_title(f"The flight recorders: {data['cause']} at seq {data['seq']}, look at "
                 f"rank {suspects} (hatched: called, never finished)", loc="left",
                 fontsize=TITLE_PT)
    lines = textwrap.wrap(data["text"].split(". ")[0] + ".", 100)
    fig.text(0.01, 0.02, "\n".join(lines), ha="left", va="bottom", fontsize=SMALLEST_PT)
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, (0.15 + 0.16 * len(lines)) / height, 1, 1))
    return fig


__all__ = ["straggler_data", "straggler_figure", "hang_data", "hang_figure"]
