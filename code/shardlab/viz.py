"""Figures of the course: matplotlib for what a static page shows, ipywidgets for what a
live kernel can explore.

Every figure takes numbers (from `shardlab.memory` or a run's report) and only draws
them, so a figure never computes something the text did not.
"""

from __future__ import annotations

import re

from typing import Sequence

from shardlab import memory
from shardlab.units import GB, GiB

COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868",
          "buffers": "#8172B3", "other": "#937860"}
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
          "buffers": "buffers", "other": "other"}
STAGE_NAMES = ["stage 0\n(DDP)", "stage 1\n(P_os)", "stage 2\n(P_os+g)", "stage 3\n(P_os+g+p)"]
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": GB, "GiB": GiB}
# The book's text column is about 690 px wide at a 1280 px window. A figure drawn at DPI
# and at most MAX_WIDTH_IN wide shows at its own size there, so text of SMALLEST_PT points
# stays SMALLEST_PT * DPI / 72 = 11 px on the screen; a wider one is scaled down, its
# text with it.
DPI = 90
MAX_WIDTH_IN = 7.5
SMALLEST_PT = 9


def _pyplot():
    import matplotlib.pyplot as plt
    return plt


def stacked_bars(ax, labels: Sequence[str], rows: Sequence[dict], unit: str = "GB",
                 categories: Sequence[str] = ("params", "grads", "optimizer"),
                 highlight: int | None = None, legend: bool = True, width: float = 0.7,
                 positions: Sequence[float] | None = None, hatched: Sequence[int] = ()):
    """One bar per row, stacked by category; `highlight` fades every other bar and the
    bars whose index is in `hatched` are drawn hatched."""
    div = UNITS[unit]
    positions = list(range(len(rows))) if positions is None else list(positions)
    bottoms = [0.0] * len(rows)
    for category in categories:
        heights = [row.get(category, 0) / div for row in rows]
        bars = ax.bar(positions, heights, width, bottom=bottoms, color=COLORS[category],
                      label=LABELS[category], edgecolor="white", linewidth=0.5)
        for i, bar in enumerate(bars):
            if highlight is not None:
                bar.set_alpha(1.0 if i == highlight else 0.25)
            if i in hatched:
                bar.set_hatch("//")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(positions)
    ax.set_xticklabels(labels)
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.spines[["top", "right"]].set_visible(False)
    if legend:
        ax.legend(frameon=False, loc="upper right")
    return bottoms


def draw_stages(ax, psi, world: int, stage: int | None = None, precision: str = "bf16-mixed",
                optimizer: str = "adamw", unit: str = "GB", gpu_memory=None,
                title: str | None = None):
    """Per-rank model states of the four stages for one N; the current stage highlighted."""
    rows = [memory.model_states(psi, world, s, precision, optimizer).as_dict()
            for s in memory.STAGES]
    tops = stacked_bars(ax, STAGE_NAMES, rows, unit, highlight=stage, legend=False)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=COLORS[c], label=LABELS[c])
                       for c in ("optimizer", "grads", "params")],
              frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for s, top in enumerate(tops):
        ax.text(s, top, f"{top:,.1f}", ha="center", va="bottom", fontsize=SMALLEST_PT,
                alpha=1.0 if stage in (None, s) else 0.4)
    ymax = rows[0]["params"] + rows[0]["grads"] + rows[0]["optimizer"]
    if gpu_memory is not None:
        ax.axhline(gpu_memory / UNITS[unit], color="black", linestyle="--", linewidth=1)
        ax.text(3.45, gpu_memory / UNITS[unit], "GPU memory", ha="right", va="bottom",
                fontsize=SMALLEST_PT, backgroundcolor="white")
        ymax = max(ymax, gpu_memory)
    ax.set_ylim(0, 1.12 * ymax / UNITS[unit])
    if title is None:
        title = f"N = {world}" + ("" if stage is None else
                                  f", stage {stage}: {tops[stage]:,.1f} {unit} per rank")
    ax.set_title(title)


def stages_figure(psi, world: int, precision: str = "bf16-mixed", optimizer: str = "adamw",
                  unit: str = "GB", gpu_memory=None, title: str | None = None):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 3.8), dpi=DPI)
    draw_stages(ax, psi, world, None, precision, optimizer, unit, gpu_memory, title)
    fig.tight_layout()
    return fig


def stages_animation(psi, worlds: Sequence[int] = (1, 2, 4, 8, 16, 64),
                     precision: str = "bf16-mixed", optimizer: str = "adamw",
                     unit: str = "GB", gpu_memory=None, name: str = "", interval: int = 900):
    """A matplotlib animation whose frames walk through stage 0..3 for each N in turn.

    Exported with `.to_jshtml()` it is a self-contained HTML player (frames, slider and
    buttons in JavaScript) that works on a static page, with no kernel.
    """
    plt = _pyplot()
    from matplotlib.animation import FuncAnimation

    frames = [(n, s) for n in worlds for s in memory.STAGES]
    # the column's width at DPI, so the player shows each frame at its own size
    fig, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 3.8), dpi=DPI)
    # fixed margins: every frame redraws the axes, and all frames must line up
    fig.subplots_adjust(left=0.1, right=0.75, bottom=0.17, top=0.9)

    def draw(i):
        n, s = frames[i]
        ax.clear()
        total = memory.model_states(psi, n, s, precision, optimizer).total / UNITS[unit]
        draw_stages(ax, psi, n, s, precision, optimizer, unit, gpu_memory,
                    title=f"{name}{': ' if name else ''}N = {n}, stage {s}: "
                          f"{total:,.1f} {unit} per rank")
        return []

    anim = FuncAnimation(fig, draw, frames=len(frames), interval=interval,
                                          blit=False)
    plt.close(fig)  # the HTML player shows the frames; no extra static copy
    return anim


def player_html(anim) -> str:
    """The animation as an HTML player that needs nothing from the network.

    matplotlib's player links Font Awesome 4 from a CDN for its button icons; the book's
    theme already ships Font Awesome, which draws the same `fa-*` icons, so the link is
    dropped and the page reads offline."""
    html = anim.to_jshtml(default_mode="once")
    return re.sub(r'<link rel="stylesheet"\s+href="https://[^"]*font-awesome[^"]*">', "", html)


def predicted_vs_measured_figure(rows: Sequence[dict], unit: str = "KB",
                                 categories: Sequence[str] = ("params", "grads", "optimizer")):
    """rows: dicts with "name" (a strategy), "predicted" and "measured" (dicts of bytes by
    category). Draws a pair of stacked bars per strategy, the prediction hatched on the
    left, the strategy's name once under its pair."""
    plt = _pyplot()
    # wide enough for the legend's one row, at most the column
    width = min(MAX_WIDTH_IN, max(5.6, 1.6 + 1.2 * len(rows)))
    fig, ax = plt.subplots(figsize=(width, 3.8), dpi=DPI)
    bars, positions = [], []
    for i, row in enumerate(rows):
        bars += [row["predicted"], row["measured"]]
        positions += [i - 0.2, i + 0.2]
    stacked_bars(ax, [""] * len(bars), bars, unit, categories, positions=positions,
                 width=0.38, legend=False, hatched=range(0, len(bars), 2))
    ax.set_xticks(range(len(rows)))
    # a name wider than its pair of bars goes on two lines, at its first hyphen
    # ("deepspeed" over "zero3"): 10-point characters are about 6 points wide
    room = width * 72 * 0.85 / len(rows) / 6
    names = [row["name"].replace("-", "\n", 1) if len(row["name"]) > room else row["name"]
             for row in rows]
    ax.set_xticklabels(names, fontsize=10 if names == [row["name"] for row in rows]
                       else SMALLEST_PT)
    pad = max(0, 3 - len(rows)) / 2  # few rows: narrow bars in the middle, not wide ones
    ax.set_xlim(-0.6 - pad, len(rows) - 0.4 + pad)
    _legend_above(ax, categories)
    ax.set_title("Per-rank bytes: predicted (hatched, left) and measured (right)",
                 fontsize=11, pad=30)
    fig.tight_layout()
    return fig


def _legend_above(ax, categories):
    """The categories and the hatch, in one row between the title and the bars (a legend
    beside the plot would take a third of a figure that must fit the column)."""
    from matplotlib.patches import Patch
    handles = [Patch(color=COLORS[c], label=LABELS[c]) for c in categories]
    handles.append(Patch(facecolor="white", edgecolor="gray", hatch="//",
                         label="predicted (hatched)"))
    ax.legend(handles=handles, frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1.0),
              ncol=len(handles), fontsize=SMALLEST_PT, handlelength=1.4, columnspacing=1.2)


def per_rank_figure(groups: Sequence[dict], unit: str = "KB",
                    categories: Sequence[str] = ("params", "grads", "optimizer")):
    """Predicted beside measured for every rank of every run, stacked by category.

    groups: dicts with "name" (a strategy and its stage, say), "measured" (one dict of
    bytes by category per rank, in rank order) and "predicted" (one dict for all ranks,
    or a list with one per rank). Each rank gets a pair of bars, the prediction hatched
    on the left; the runs follow one another left to right, so the ZeRO stages read as a
    staircase and a rank that differs from its prediction stands out.
    """
    plt = _pyplot()
    bars, positions, centers, rank_labels, group_centers = [], [], [], [], []
    x = 0.0
    for group in groups:
        measured = list(group["measured"])
        predicted = group["predicted"]
        predicted = list(predicted) if isinstance(predicted, (list, tuple)) else \
            [predicted] * len(measured)
        if len(predicted) != len(measured):
            raise ValueError(f"{group['name']}: {len(predicted)} predictions for "
                             f"{len(measured)} ranks; give one per rank, or one dict")
        first = x
        for rank, (p, m) in enumerate(zip(predicted, measured)):
            bars += [p, m]
            positions += [x - 0.21, x + 0.21]
            centers.append(x)
            rank_labels.append(f"r{rank}")
            x += 1.0
        group_centers.append(((first + x - 1.0) / 2, group["name"]))
        x += 0.6  # a gap between runs
    # as wide as the column allows, wider only when a pair of bars would get under 27 px
    slots = len(centers) + 0.6 * (len(groups) - 1)
    width = max(min(MAX_WIDTH_IN, 1.4 + 0.45 * slots), 1.4 + 0.3 * slots)
    fig, ax = plt.subplots(figsize=(width, 4.0), dpi=DPI)
    stacked_bars(ax, [""] * len(bars), bars, unit, categories, positions=positions,
                 width=0.4, legend=False, hatched=range(0, len(bars), 2))
    ax.set_xticks(centers)
    ax.set_xticklabels(rank_labels, fontsize=SMALLEST_PT)
    ax.set_xlim(min(positions) - 0.5, max(positions) + 0.5)
    for center, name in group_centers:
        ax.annotate(name, xy=(center, 0), xycoords=("data", "axes fraction"),
                    xytext=(0, -18), textcoords="offset points", ha="center", va="top",
                    fontsize=SMALLEST_PT)
    _legend_above(ax, categories)
    ax.set_title("Per-rank bytes: predicted (hatched) beside measured, per rank and run",
                 fontsize=11, pad=30)
    fig.tight_layout()
    return fig


def explorer(default_model: str = "llama-2-7b"):
    """Controls for model, precision, optimizer, N and stage, redrawing the stage figure.
    Needs a live kernel (ipywidgets); on a static page use `stages_animation`. Returns
    the widget: make it a cell's last expression to show it."""
    import ipywidgets as W

    plt = _pyplot()
    model = W.Dropdown(options=list(memory.MODELS), value=default_model, description="model")
    precision = W.Dropdown(options=list(memory.PRECISIONS), value="bf16-mixed",
                           description="precision")
    optimizer = W.Dropdown(options=list(memory.OPTIMIZERS), value="adamw",
                           description="optimizer")
    world = W.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], value=8,
                              description="N")
    stage = W.IntSlider(min=0, max=3, value=0, description="stage")
    gpu = W.FloatText(value=80.0, description="GPU (GB)")
    out = W.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            psi = memory.num_params(model.value)
            fig, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 3.8), dpi=DPI)
            draw_stages(ax, psi, world.value, stage.value, precision.value, optimizer.value,
                        gpu_memory=gpu.value * GB,
                        title=f"{model.value} (psi = {psi / 1e9:.2f}B), N = {world.value}, "
                              f"stage {stage.value}")
            fig.tight_layout()
            plt.show()

    for w in (model, precision, optimizer, world, stage, gpu):
        w.observe(redraw, names="value")
    box = W.VBox([W.HBox([model, precision, optimizer]), W.HBox([world, stage, gpu]), out])
    redraw()
    return box


__all__ = ["stacked_bars", "draw_stages", "stages_figure", "stages_animation",
           "predicted_vs_measured_figure", "per_rank_figure", "explorer"]


# The loop's phases (`shardlab.clock`) and the collectives' kinds (`report.op_kind`), one
# colour each in every timeline of the course.
PHASE_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "optimizer step": "#8172B3",
                "injected delay": "#BBBBBB"}
COLLECTIVE_COLORS = {"all_gather": "#DD8452", "reduce_scatter": "#C44E52",
                     "all_reduce": "#937860", "other": "#DA8BC3"}


def step_timeline_figure(timeline: Sequence[dict], title: str = "", ax=None):
    """One step of every rank, drawn from `shardlab.report.step_timeline`: per rank a lane
    of what the loop computed and a lane of the collectives in flight, with the exposed
    communication (the rank waited for it) hatched in red over the collectives and the
    idle part of it (waiting for another rank to arrive) in black beneath them."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    compute, comms = PHASE_COLORS, COLLECTIVE_COLORS
    if ax is None:
        _, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 0.6 + 1.1 * len(timeline)), dpi=DPI)
    labels = []
    for i, rank in enumerate(timeline):
        y = 2 * (len(timeline) - 1 - i)
        for what, a, b in rank["phases"]:
            if what in compute:
                ax.broken_barh([(a, b - a)], (y, 0.8), color=compute[what])
        for kind, a, b in rank["collectives"]:
            ax.broken_barh([(a, b - a)], (y + 0.9, 0.7), color=comms[kind], alpha=0.8)
        ax.broken_barh([(a, b - a) for a, b in rank["exposed"]], (y + 0.9, 0.7),
                       facecolor="none", edgecolor="red", hatch="////", linewidth=0)
        ax.broken_barh([(a, b - a) for a, b in rank["idle"]], (y + 0.82, 0.08),
                       color="black")
        labels.append((y + 0.8, f"rank {rank['rank']}"))
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels])
    ax.set_xlabel("milliseconds from the start of the step")
    ax.spines[["top", "right"]].set_visible(False)
    handles = ([Patch(color=c, label=w) for w, c in compute.items()]
               + [Patch(color=c, label=w.replace("_", "-")) for w, c in comms.items()]
               + [Patch(facecolor="white", edgecolor="red", hatch="////", label="exposed"),
                  Patch(color="black", label="idle")])
    used = {w for r in timeline for w, *_ in r["phases"]} | \
        {k for r in timeline for k, *_ in r["collectives"]} | {"exposed", "idle"}
    ax.legend(handles=[h for h in handles if h.get_label().replace("-", "_") in used
                       or h.get_label() in used],
              frameon=False, fontsize=SMALLEST_PT, ncol=4, loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(timeline) < 3 else -0.2))
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax


__all__ += ["step_timeline_figure", "PHASE_COLORS", "COLLECTIVE_COLORS"]


def profiled_spans(trace_path) -> dict[str, list[tuple[str, float, float]]]:
    """The loop's phases and gloo's/NCCL's collectives of a `torch.profiler` Chrome trace
    (a run's `--profile` folder, `rankR.json`), in ms from the first phase's start:
    {"compute": [(what, begin, end)], "communication": [...]}."""
    import json
    from pathlib import Path

    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    phases = [e for e in spans if e["name"] in ("forward", "backward", "optimizer step")]
    collectives = [e for e in spans if e["name"].startswith(("gloo:", "nccl:"))]
    t0 = min((e["ts"] for e in phases), default=0.0)

    def ms(group):
        return [(e["name"], (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3)
                for e in group]
    return {"compute": ms(phases), "communication": ms(collectives)}


def predicted_beside_profiled(ax, predicted: Sequence[tuple[str, str, float, float]],
                              profiled: dict, title: str = ""):
    """Four lanes: the step-time model's timeline (`StepPrediction.timeline()`, seconds)
    above the profiled step's (`profiled_spans`, ms), compute and communication each."""
    colors = {"forward": "#4C72B0", "backward": "#55A868", "optimizer": "#8172B3",
              "optimizer step": "#8172B3"}
    comm_color = "#C44E52"
    lanes = [("predicted compute", [(w, 1e3 * a, 1e3 * b) for lane, w, a, b in predicted
                                    if lane == "compute"]),
             ("predicted comm", [(w, 1e3 * a, 1e3 * b) for lane, w, a, b in predicted
                                 if lane == "communication"]),
             ("profiled compute", profiled["compute"]),
             ("profiled comm", profiled["communication"])]
    for i, (_, spans) in enumerate(lanes):
        y = len(lanes) - 1 - i
        for what, a, b in spans:
            ax.broken_barh([(a, b - a)], (y, 0.8), color=colors.get(what, comm_color),
                           alpha=0.9, edgecolor="white", linewidth=0.3)
    ax.set_yticks([len(lanes) - 1 - i + 0.4 for i in range(len(lanes))],
                  [name for name, _ in lanes], fontsize=SMALLEST_PT)
    ax.spines[["top", "right"]].set_visible(False)
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax


__all__ += ["profiled_spans", "predicted_beside_profiled"]


def reduction_precision_figure(rows: Sequence, ax=None, title: str = ""):
    """The relative error of a summed gradient against fp64, as a function of the number
    of ranks N, from `shardlab.comm.reduction_precision.reduction_errors`: one line per
    (accumulate, reduce) case, the reduction's dtype by colour, the accumulation's by the
    line (solid fp32, dashed bf16), and each dtype's unit roundoff as a dotted level."""
    plt = _pyplot()
    from shardlab.comm.reduction_precision import UNIT_ROUNDOFF

    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.8), dpi=DPI)
    colors = {"fp32": "#4C72B0", "bf16": "#C44E52"}
    cases = sorted({(r.accumulate, r.reduce) for r in rows}, reverse=True)
    for accumulate, reduce in cases:
        these = sorted((r.ranks, r.error) for r in rows
                       if (r.accumulate, r.reduce) == (accumulate, reduce))
        ax.plot([n for n, _ in these], [e for _, e in these], "o-" if accumulate == "fp32"
                else "s--", color=colors[reduce], markersize=4,
                label=f"reduce in {reduce}, accumulate in {accumulate}")
    for dtype, u in UNIT_ROUNDOFF.items():
        ax.axhline(u, color=colors[dtype], linestyle=":", linewidth=0.8)
        ax.annotate(f"{dtype} unit roundoff", (0.0, u), xycoords=("axes fraction", "data"),
                    xytext=(4, 3), textcoords="offset points", ha="left",
                    fontsize=SMALLEST_PT, color=colors[dtype])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N in the reduction")
    ax.set_ylabel("relative error against fp64")
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(frameon=False, fontsize=SMALLEST_PT, loc="center right")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    return ax


__all__.append("reduction_precision_figure")
