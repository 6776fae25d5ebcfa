"""What every diagram shares: the page's width, DPI and smallest type (`shardlab.viz`'s),
one colour per rank, and cells drawn in data coordinates.

A diagram draws on axes whose units are cells (one chunk, one element, one rank), with
the axes themselves hidden, so that a grid of cells reads as the buffer it stands for.
"""

from __future__ import annotations

from shardlab.viz import COLORS, DPI, LABELS, MAX_WIDTH_IN, SMALLEST_PT

# seaborn's "deep" palette, whose first five colours `viz.COLORS` also uses
RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860",
               "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")
TITLE_PT = 10


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def pyplot():
    import matplotlib.pyplot as plt
    return plt


# The notebook's inline backend saves a figure cropped to what it draws, plus this much
# padding on each side (matplotlib's `savefig.pad_inches`): the image the page receives is
# that wide, so a figure drawn to its edges must leave room for it.
SAVE_PAD_IN = 0.1


def figure(height: float, width: float = MAX_WIDTH_IN - 2 * SAVE_PAD_IN, **subplots):
    """A figure whose saved image is as wide as the book's column (`viz.MAX_WIDTH_IN` at
    `viz.DPI`, padding included), so that text of `SMALLEST_PT` shows at its own size."""
    return pyplot().subplots(figsize=(width, height), dpi=DPI, **subplots)


def bare(ax, width: float, height: float, flip: bool = True) -> None:
    """Axes in cell units, x in [0, width], y in [0, height] (row 0 on top if `flip`),
    no frame, equal aspect."""
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0) if flip else ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.set_axis_off()


def cell(ax, x: float, y: float, color: str, w: float = 1.0, h: float = 1.0,
         text: str = "", alpha: float = 1.0, hatch: str | None = None,
         edge: str = "white", linewidth: float = 0.8, fontsize: float = SMALLEST_PT,
         text_color: str = "black"):
    """A rectangle with its top-left corner at (x, y) in a flipped cell grid."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, alpha=alpha, hatch=hatch,
                           edgecolor=edge, linewidth=linewidth))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
                color=text_color)


def grid(ax, colors, x0: float = 0.0, y0: float = 0.0, alpha: float = 1.0,
         linewidth: float = 0.6) -> None:
    """A grid of cells, `colors[row][col]`, with its top-left corner at (x0, y0) of a
    flipped cell grid: one image and its white lines, not a patch per cell (a figure
    of a few thousand cells draws in a blink)."""
    import numpy as np
    from matplotlib.colors import to_rgba

    rows, cols = len(colors), len(colors[0])
    image = np.array([[to_rgba(c, alpha) for c in row] for row in colors])
    ax.imshow(image, extent=(x0, x0 + cols, y0 + rows, y0), origin="upper",
              interpolation="nearest", aspect="auto", zorder=1)
    ax.hlines([y0 + i for i in range(1, rows)], x0, x0 + cols, colors="white",
              linewidth=linewidth, zorder=2)
    ax.vlines([x0 + j for j in range(1, cols)], y0, y0 + rows, colors="white",
              linewidth=linewidth, zorder=2)


def size_text(nbytes: float) -> str:
    """Bytes in the largest unit (of 10**3 steps, `memory.GB`'s) that keeps the number
    at 1 or more, with 3 significant figures: "3.37 GB", "24.0 kB", "96 B"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            value = nbytes / scale
            digits = 0 if value >= 100 else 1 if value >= 10 else 2
            return f"{value:,.{digits}f} {unit}"
    return f"{nbytes:,.0f} B"


def legend_patches(items):
    """Legend handles from (label, colour) or (label, colour, hatch) tuples."""
    from matplotlib.patches import Patch

    return [Patch(facecolor=i[1], edgecolor="gray" if len(i) > 2 else i[1],
                  hatch=i[2] if len(i) > 2 else None, label=i[0]) for i in items]


__all__ = ["COLORS", "LABELS", "DPI", "MAX_WIDTH_IN", "SMALLEST_PT", "TITLE_PT",
           "RANK_COLORS", "rank_color", "size_text", "grid", "pyplot", "figure",
           "bare", "cell", "legend_patches"]
