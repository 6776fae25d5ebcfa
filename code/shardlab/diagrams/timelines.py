"""Diagrams over time: memory through one step (DDP against ZeRO-3, and ZeRO-3 unit by
unit as an animation), a straggler's steps and a hang's last collectives, rank by rank.

Memory comes from `shardlab.memory`'s formulas laid along the course's schedule
(`shardlab.sharded`: gather before a unit's forward and backward, free after, reduce-scatter
its gradients after its backward); the straggler's and the hang's timelines from what a
run recorded (`report.RunReport`s, flight recorders' `FlightDump`s), so a chapter passes
its own run.
"""

from __future__ import annotations

import dataclasses
import textwrap

from shardlab import memory, report
from shardlab.comm import diagnose
from shardlab.diagrams.draw import (COLORS, SMALLEST_PT, TITLE_PT, cell, figure,
                                    legend_patches, pyplot, size_text)
from shardlab.viz import COLLECTIVE_COLORS, PHASE_COLORS

# ----------------------------------------------------------------------------- memory

# stacked from the bottom: what persists, then what comes and goes
MEMORY_PARTS = ("params", "optimizer", "activations", "grads", "gathered")
MEMORY_COLORS = {**{c: COLORS[c] for c in ("params", "grads", "optimizer")},
                 "gathered": "#64B5CD", "activations": "#CCB974"}
MEMORY_LABELS = {"params": "parameters (kept)", "optimizer": "optimizer states",
                 "grads": "gradients", "gathered": "gathered units (full parameters)",
                 "activations": "activations"}
PHASE_SHADES = {"forward": "#EEF3FA", "backward": "#EEF7F0", "step": "#F3F0F8"}


def step_memory_data(model="llama-2-7b", world: int = 8, stage: int = 3, batch: int = 1,
                     seq: int = 4096, precision: str = "bf16-mixed",
                     optimizer: str = "adamw", checkpointing: str = "none") -> dict:
    """One rank's memory through one step, event by event, with one unit per layer and
    the rest of the model (embeddings, final norm, head) as the root unit.

    Persistent: the parameters and optimizer states of each unit, whole or its 1/N
    (`memory.model_states` of the unit's Ψ at `stage`). Forward adds each layer's
    activations (`memory.activations`, under `checkpointing`) and the head's; backward
    releases them, and each unit's full gradients appear in its backward; from stage 2
    the unit's reduce-scatter leaves its 1/N. At stage 3 a unit is all-gathered before its
    forward and its backward and freed after (the root gathers first and frees last,
    around the layers), as `shardlab.sharded` schedules it without prefetch. Left out:
    buckets, temporaries, the allocator's rounding.

    Returns {"events": [{"phase", "label", "computing", "gathered", "full_grads",
    "bytes": {part: bytes}}], "units": [(name, Ψ_unit)], and the arguments}."""
    cfg = memory.as_config(model)
    n, stage = memory.check_world(world), memory.check_stage(stage)
    per = memory.bytes_per_param(precision, optimizer)
    units = [("root", cfg.root_params())] + [(f"layer {i}", cfg.layer_params())
                                             for i in range(cfg.layers)]
    size = dict(units)
    acts = memory.activations(cfg, batch, seq, checkpointing)
    per_layer = acts.layers // cfg.layers

    def kept(psi):
        return memory.model_states(psi, n, stage, precision, optimizer)

    state = {"params": sum(kept(p).params for _, p in units),
             "optimizer": sum(kept(p).optimizer for _, p in units),
             "grads": 0, "gathered": 0, "activations": 0}
    gathered: list[str] = []
    full_grads: list[str] = []
    events: list[dict] = []

    def emit(phase, label, computing=None):
        events.append({"phase": phase, "label": label, "computing": computing,
                       "gathered": list(gathered), "full_grads": list(full_grads),
                       "bytes": dict(state)})

    def gather(phase, unit):
        if stage == 3:
            state["gathered"] += memory.gathered_unit_bytes(size[unit], precision)
            gathered.append(unit)
            emit(phase, f"all-gather {unit}")

    def free(phase, unit):
        if stage == 3:
            state["gathered"] -= memory.gathered_unit_bytes(size[unit], precision)
            gathered.remove(unit)
            emit(phase, f"free {unit}")

    def backward_done(unit):
        full_grads.remove(unit)
        if stage >= 2:  # the full gradients reduce-scattered into this rank's 1/N
            state["grads"] += kept(size[unit]).grads - per.grads * size[unit]
            emit("backward", f"reduce-scatter {unit}")

    emit("forward", "start of the step")
    gather("forward", "root")
    for unit, _ in units[1:]:
        gather("forward", unit)
        state["activations"] += per_layer
        emit("forward", f"forward {unit}", unit)
        free("forward", unit)
    state["activations"] += acts.output
    emit("forward", "forward: head and loss", "root")
    free("forward", "root")
    gather("backward", "root")
    state["activations"] -= acts.output
    state["grads"] += per.grads * size["root"]
    full_grads.append("root")
    emit("backward", "backward: loss and head", "root")
    for unit, _ in reversed(units[1:]):
        gather("backward", unit)
        state["activations"] += acts.recompute
        state["grads"] += per.grads * size[unit]
        full_grads.append(unit)
        emit("backward", f"backward {unit}", unit)
        state["activations"] -= per_layer + acts.recompute
        backward_done(unit)
        free("backward", unit)
    emit("backward", "backward: embeddings", "root")
    backward_done("root")
    free("backward", "root")
    emit("step", "optimizer step")
    state["grads"] = 0
    emit("step", "zero_grad")
    return {"events": events, "units": units, "model": cfg.name, "world": n,
            "stage": stage, "batch": batch, "seq": seq, "precision": precision,
            "optimizer": optimizer, "checkpointing": checkpointing}


def compute_events(data: dict) -> list[dict]:
    """The events in which something computes (a unit's forward or backward, the
    optimizer step): one slot each, the same slots at every stage, so that stages line
    up; the collectives between them change memory in no time."""
    return [e for e in data["events"] if e["computing"] is not None
            or e["label"] == "optimizer step"]


def _draw_memory(ax, events: list[dict], upto: int | None = None, unit: str = "GB"):
    """The stacked parts of `events` as steps, through event `upto` (all if None), over
    the phases' shading, each phase named under the axis."""
    from shardlab.viz import UNITS

    last = len(events) if upto is None else upto + 1
    centers, names = [], []
    for phase, shade in PHASE_SHADES.items():
        xs = [i for i, e in enumerate(events) if e["phase"] == phase]
        ax.axvspan(min(xs) - 0.5, max(xs) + 0.5, color=shade, zorder=0, lw=0)
        centers.append((min(xs) + max(xs)) / 2)
        names.append(phase)
    xs = list(range(last))
    bottom = [0.0] * last
    for part in MEMORY_PARTS:
        top = [b + events[i]["bytes"][part] / UNITS[unit] for i, b in enumerate(bottom)]
        if any(t > b for t, b in zip(top, bottom)):
            ax.fill_between(xs, bottom, top, step="mid", color=MEMORY_COLORS[part], lw=0)
        bottom = top
    ax.set_xlim(-0.5, len(events) - 0.5)
    ax.set_xticks(centers, names, fontsize=SMALLEST_PT)
    ax.tick_params(axis="x", length=0)
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.spines[["top", "right"]].set_visible(False)


def _total(event) -> float:
    return sum(event["bytes"].values())


def step_memory_figure(model="llama-2-7b", world: int = 8, stages=(0, 3), batch: int = 1,
                       seq: int = 4096, precision: str = "bf16-mixed",
                       optimizer: str = "adamw", checkpointing: str = "none",
                       unit: str = "GB"):
    """`step_memory_data` of each stage (DDP and ZeRO-3 by default), one panel each on a
    shared scale: the parts stacked through forward, backward and the optimizer step
    (one slot per compute, `compute_events`), each panel's peak marked."""
    from shardlab.viz import UNITS

    runs = [step_memory_data(model, world, s, batch, seq, precision, optimizer,
                             checkpointing) for s in stages]
    fig, axes = figure(1.2 + 1.75 * len(runs), nrows=len(runs), sharey=True)
    axes = list(axes) if len(runs) > 1 else [axes]
    top = max(_total(e) for r in runs for e in r["events"]) / UNITS[unit]
    for ax, data in zip(axes, runs):
        events = compute_events(data)
        _draw_memory(ax, events, unit=unit)
        peak = max(range(len(events)), key=lambda i: _total(events[i]))
        value = _total(events[peak]) / UNITS[unit]
        ax.axhline(value, color="black", ls="--", lw=0.8)
        ax.text(peak, value, f" peak {value:,.1f} {unit}, in {events[peak]['label']} ",
                ha="left" if peak < len(events) / 2 else "right", va="bottom",
                fontsize=SMALLEST_PT)
        states = sum(events[-1]["bytes"][p] for p in ("params", "grads", "optimizer"))
        name = "DDP" if data["stage"] == 0 else f"ZeRO-{data['stage']}"
        ax.set_title(f"{name}: model states {states / UNITS[unit]:,.1f} {unit} after "
                     f"backward", loc="left", fontsize=TITLE_PT)
        ax.set_ylim(0, 1.15 * top)
    fig.legend(handles=legend_patches([(MEMORY_LABELS[p], MEMORY_COLORS[p])
                                       for p in MEMORY_PARTS]),
               loc="lower center", ncol=3, frameon=False, fontsize=SMALLEST_PT)
    data = runs[0]
    fig.suptitle(f"One rank's memory through one step, a slot per layer's compute: "
                 f"{data['model']}, N = {data['world']},\n{data['batch']} × "
                 f"{data['seq']:,} tokens, {data['precision']}, recomputation "
                 f"{data['checkpointing']}", fontsize=TITLE_PT)
    fig.subplots_adjust(left=0.1, right=0.98, top=0.84, bottom=0.17, hspace=0.45)
    return fig


def step_animation(model="llama-2-7b", world: int = 8, layers: int | None = 4,
                   batch: int = 1, seq: int = 4096, precision: str = "bf16-mixed",
                   optimizer: str = "adamw", checkpointing: str = "none",
                   unit: str = "GB", interval: int = 700):
    """One ZeRO-3 step unit by unit, a frame per event of `step_memory_data`: on the
    left each unit, its 1/N shard always there, its full parameters while gathered, its
    full gradients until the reduce-scatter; on the right the memory so far. `layers`
    draws the model with that many of its layers (the same layers), so that the frames
    stay few; None keeps them all. Show it with `viz.player_html`."""
    from matplotlib.animation import FuncAnimation

    from shardlab.viz import UNITS

    cfg = memory.as_config(model)
    if layers is not None and layers != cfg.layers:
        layers = memory.check_positive("layers", layers, integer=True)
        cfg = dataclasses.replace(cfg, name=f"{cfg.name}'s layers, {layers} of its "
                                             f"{cfg.layers}", layers=layers)
    data = step_memory_data(cfg, world, 3, batch, seq, precision, optimizer, checkpointing)
    events, units = data["events"], data["units"]
    fig, (left, right) = figure(4.2, ncols=2, gridspec_kw={"width_ratios": [1, 1.7]})
    fig.subplots_adjust(left=0.02, right=0.98, top=0.82, bottom=0.2, wspace=0.22)
    handles = legend_patches([("1/N shard", COLORS["params"]),
                              ("gathered", MEMORY_COLORS["gathered"]),
                              ("full gradients", COLORS["grads"]),
                              ("activations", MEMORY_COLORS["activations"]),
                              ("optimizer", COLORS["optimizer"])])
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False,
               fontsize=SMALLEST_PT, handlelength=1.2, columnspacing=1.0)
    biggest = max(p for _, p in units)

    def draw(k):
        event = events[k]
        left.clear()
        left.set_xlim(-2.4, 6.2)
        left.set_ylim(len(units) + 0.2, -0.4)
        left.set_axis_off()
        for i, (name, psi) in enumerate(units):
            width = 4.0 * psi / biggest
            cell(left, 0, i + 0.1, COLORS["params"], w=width / world, h=0.35)
            if name in event["gathered"]:
                cell(left, 0, i + 0.1, MEMORY_COLORS["gathered"], w=width, h=0.35,
                     alpha=0.8)
            if name in event["full_grads"]:
                cell(left, 0, i + 0.5, COLORS["grads"], w=width, h=0.35)
            color = "black" if name == event["computing"] else "gray"
            left.text(-0.2, i + 0.45, name, ha="right", va="center", fontsize=SMALLEST_PT,
                      color=color, weight="bold" if color == "black" else "normal")
        right.clear()
        _draw_memory(right, events, upto=k, unit=unit)
        right.set_ylim(0, 1.1 * max(_total(e) for e in events) / UNITS[unit])
        right.axvline(k, color="black", lw=0.8)
        total = size_text(_total(event))
        fig.suptitle(f"ZeRO-3, {data['model']}, N = {world}: {event['label']}\n"
                     f"this rank holds {total}", fontsize=TITLE_PT)
        return []

    anim = FuncAnimation(fig, draw, frames=len(events), interval=interval, blit=False)
    pyplot().close(fig)
    return anim


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
    """`hang_data` drawn: a lane per rank, its last `last` collectives of the group in
    the order it called them (seq), each finished (solid) or never finished (hatched:
    where the rank waits); the seq where the diagnosis points is marked, and the ranks
    it names are in red."""
    data = hang_data(dumps, diagnosis)
    seqs = [e["seq"] for r in data["ranks"].values() for e in r["entries"]]
    high = max(seqs, default=0)
    low = max(min(seqs, default=0), high - last + 1)
    lanes = list(data["ranks"].items())
    fig, ax = figure(1.8 + 0.6 * len(lanes))
    for i, (rank, lane) in enumerate(lanes):
        y = len(lanes) - 1 - i
        shown = [e for e in lane["entries"] if e["seq"] >= low]
        for e in shown:
            kind = report.op_kind(e["op"])
            color = COLLECTIVE_COLORS[kind]
            ax.add_patch(pyplot().Rectangle(
                (e["seq"] - 0.45, y + 0.1), 0.9, 0.75, facecolor=color if e["finished"]
                else "white", edgecolor=color, hatch=None if e["finished"] else "///",
                linewidth=1.5))
            ax.text(e["seq"], y + 0.47, f"{kind.replace('_', '-')}\n{e['numel']:,}, "
                    f"step {e['step']}", ha="center", va="center", fontsize=SMALLEST_PT,
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
    ax.set_xlim(low - 0.6, high + 1.6)
    ax.set_ylim(-0.2, len(lanes))
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
    first = data["text"].split(". ")[0] + "."
    suspects = ", ".join(str(r) for r in data["suspects"])
    ax.set_title(f"The flight recorders: {data['cause']} at seq {data['seq']}, look at "
                 f"rank {suspects} (hatched: called, never finished)", loc="left",
                 fontsize=TITLE_PT)
    fig.text(0.01, 0.01, textwrap.fill(first, 118), ha="left", va="bottom",
             fontsize=SMALLEST_PT)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * first.count("\n") + 0.03 * (len(first) // 118),
                           1, 1))
    return fig


__all__ = ["MEMORY_PARTS", "step_memory_data", "compute_events", "step_memory_figure",
           "step_animation",
           "straggler_data", "straggler_figure", "hang_data", "hang_figure"]
