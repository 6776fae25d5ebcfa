"""Diagrams of one rank's memory through a step: DDP against ZeRO-3 side by side, and
ZeRO-3 unit by unit as an animation.

The bytes are `shardlab.memory`'s formulas (model states of each unit at its stage,
activations per layer, gathered units) laid along the course's schedule
(`shardlab.sharded`: gather before a unit's forward and backward, free after,
reduce-scatter its gradients after its backward).
"""

from __future__ import annotations

import dataclasses

from shardlab import memory
from shardlab.diagrams.draw import (COLORS, SMALLEST_PT, TITLE_PT, cell, figure,
                                    legend_patches, pyplot, size_text)

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
    height = 1.45 + 1.75 * len(runs)
    fig, axes = figure(height, nrows=len(runs), sharey=True)
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
    fig.subplots_adjust(left=0.1, right=0.98, top=1 - 0.75 / height, bottom=0.7 / height,
                        hspace=0.5)
    return fig


def zero3_step_animation(model="llama-2-7b", world: int = 8, layers: int | None = 4,
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


__all__ = ["MEMORY_PARTS", "MEMORY_COLORS", "step_memory_data", "compute_events",
           "step_memory_figure", "zero3_step_animation"]
