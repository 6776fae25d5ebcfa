"""Bytes per rank against N: the course's formula, the formula with its padding, and one
rank measured, for each strategy. It draws the rows of `measured.sweep`, nothing else."""

from __future__ import annotations

from typing import Sequence

from shardlab.viz import DPI, MAX_WIDTH_IN, SMALLEST_PT, UNITS

COLORS = {"ddp": "#4C72B0", "zero1": "#8172B3", "zero2": "#DD8452", "zero3": "#55A868",
          "fsdp2": "#C44E52", "hsdp": "#937860"}
HEIGHT_IN = 3.4


def bytes_against_world(rows: Sequence[dict], unit: str = "KB", title: str = ""):
    """Two panels, bytes one rank holds (model states after the optimizer step) and bytes
    it sends in a step, against N on a log scale: per strategy a dashed line for the
    course's formula (nothing padded), a solid one for the formula with the padding, and
    a marker where a rank was measured. Returns the figure."""
    import matplotlib.pyplot as plt

    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r}; use one of {list(UNITS)}")
    div = UNITS[unit]
    fig, axes = plt.subplots(1, 2, figsize=(MAX_WIDTH_IN, HEIGHT_IN), dpi=DPI)
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    for ax, what, label in ((axes[0], "held", "held per rank"),
                            (axes[1], "sent", "sent per rank and step")):
        for strategy in strategies:
            mine = sorted((r for r in rows if r["strategy"] == strategy),
                          key=lambda r: r["world"])
            color = COLORS.get(strategy, "black")
            worlds = [r["world"] for r in mine]

            def value(b):
                return (b.held if what == "held" else b.sent_total) / div
            ax.plot(worlds, [value(r["ideal"]) for r in mine], "--", color=color,
                    linewidth=1)
            ax.plot(worlds, [value(r["predicted"]) for r in mine], "-", color=color,
                    linewidth=1.5, label=strategy)
            seen = [r for r in mine if r["measured"] is not None]
            ax.plot([r["world"] for r in seen], [value(r["measured"]) for r in seen], "o",
                    color=color, markersize=4, markerfacecolor="none")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = [n for n in (2, 8, 32, 128, 1024)
                 if min(r["world"] for r in rows) <= n <= max(r["world"] for r in rows)]
        ax.set_xticks(ticks, [f"{n:,}" for n in ticks])
        ax.set_xlabel("N, ranks")
        ax.set_ylabel(f"{label} ({unit})")
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].legend(frameon=False, fontsize=SMALLEST_PT)
    axes[1].plot([], [], "k--", linewidth=1, label="Ψ/N, nothing padded")
    axes[1].plot([], [], "k-", linewidth=1.5, label="with the padding")
    axes[1].plot([], [], "ko", markersize=4, markerfacecolor="none", label="measured")
    handles = axes[1].get_legend_handles_labels()
    keep = [i for i, name in enumerate(handles[1]) if name not in strategies]
    axes[1].legend([handles[0][i] for i in keep], [handles[1][i] for i in keep],
                   frameon=False, fontsize=SMALLEST_PT)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
