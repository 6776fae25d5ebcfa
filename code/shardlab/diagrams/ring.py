"""Diagrams of a ring collective: who sends which chunk to whom in each round of a
reduce-scatter and then an all-gather, as a figure and as an animation.

The rounds follow the rule of `shardlab.comm.ring` (a test traces the ring collectives
themselves and compares) and number what `comm.ring_traffic` counts; the bytes of a round
are `comm.ring_traffic`'s.
"""

from __future__ import annotations

from shardlab import comm, memory
from shardlab.diagrams.draw import (MAX_WIDTH_IN, SMALLEST_PT, TITLE_PT, bare, cell,
                                    figure, pyplot, rank_color, size_text)

RING_OPS = ("reduce_scatter", "all_gather", "all_reduce")

def ring_sends(op: str, world: int) -> list[list[tuple[int, int, int]]]:
    """Every round of a ring collective, as `shardlab.comm.ring` runs it: per round, one
    (sender, receiver, chunk) per rank. In round s rank r sends to r+1: in a
    reduce-scatter its partial sum of chunk (r-s-1) mod N, in an all-gather chunk
    (r-s) mod N; an all-reduce is the one, then the other. As many rounds as
    `comm.ring_traffic` counts."""
    if op not in RING_OPS:
        raise ValueError(f"unknown ring collective {op!r}; use one of {list(RING_OPS)}")
    n = memory.check_world(world)
    rounds = comm.ring_traffic(op, n, n, 1)[2]
    out = []
    for i in range(rounds):
        gather = op == "all_gather" or (op == "all_reduce" and i >= n - 1)
        s = i % (n - 1)
        out.append([(r, (r + 1) % n, (r - s) % n if gather else (r - s - 1) % n)
                    for r in range(n)])
    return out


def ring_states(op: str, world: int) -> list[list[list[frozenset]]]:
    """What each rank holds of each chunk before the first round and after every round:
    `states[k][rank][chunk]` is the set of ranks whose contributions that copy sums (all
    N: the chunk is complete; empty: not there). A reduce-scatter adds what arrives to
    its own partial sum; an all-gather overwrites with it."""
    n = memory.check_world(world)
    everyone = frozenset(range(n))
    if op == "all_gather":  # each rank starts with its own complete chunk
        held = [[everyone if c == r else frozenset() for c in range(n)] for r in range(n)]
    else:
        held = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    states = [held]
    for i, sends in enumerate(ring_sends(op, n)):
        adds = op == "reduce_scatter" or (op == "all_reduce" and i < n - 1)
        new = [row[:] for row in held]
        for sender, receiver, chunk in sends:
            arriving = held[sender][chunk]
            new[receiver][chunk] = held[receiver][chunk] | arriving if adds else arriving
        held = new
        states.append(held)
    return states


def _draw_ring_grid(ax, held, sends, n, x0, title):
    """One rank per row, one chunk per column; a chunk's colour is that of the rank that
    ends with it, its depth how many contributions it sums; the chunks that just arrived
    are outlined."""
    arrived = {(receiver, chunk) for _, receiver, chunk in sends}
    for r in range(n):
        for c in range(n):
            k = len(held[r][c])
            cell(ax, x0 + c, r, rank_color(c) if k else "white", alpha=0.15 + 0.85 * k / n
                 if k else 1.0, text=str(k) if k else "", edge="#DDDDDD")
            if (r, c) in arrived:
                cell(ax, x0 + c + 0.06, r + 0.06, "none", w=0.88, h=0.88, edge="black",
                     linewidth=1.6)
    ax.text(x0 + n / 2, -0.25, title, ha="center", va="bottom", fontsize=SMALLEST_PT)


MAX_DRAWN = 8  # ranks a ring diagram draws: past 8 its cells get too small for their digits


def _check_drawn(world: int) -> int:
    n = memory.check_world(world)
    if not 2 <= n <= MAX_DRAWN:
        raise ValueError(f"a ring diagram draws 2 to {MAX_DRAWN} ranks, got world={world}; "
                         f"the rule is the same on any ring")
    return n


def ring_figure(world: int = 4, numel: int | None = None, elem_size: int = 2):
    """An all-reduce on a ring of `world` ranks, round by round: the reduce-scatter on
    the first row, the all-gather on the second (past 4 ranks, rounds 1, 2 and the last
    of each). With `numel`, the title gives the bytes each rank sends per round
    (`comm.ring_traffic`)."""
    n = _check_drawn(world)
    states, sends = ring_states("all_reduce", n), ring_sends("all_reduce", n)
    shown = [0] + (list(range(1, n)) if n <= 4 else [1, 2, n - 1])
    gap, left = 1.0, 2.2
    width = left + len(shown) * (n + gap) - gap
    rows = n + 2.8  # the grid and, above it, its name, its rule and the panels' titles
    inch = min(0.98 * MAX_WIDTH_IN / width, 0.4)  # one cell, in inches
    per = ""
    if numel is not None:
        sent, _, rounds, round_bytes = comm.ring_traffic("reduce_scatter", numel, n, elem_size)
        per = (f"\nΨ = {numel:,} elements of {elem_size} B: each round a rank sends one "
               f"chunk, {size_text(round_bytes)}; {size_text(sent)} per half")
    top, bottom = (0.75 if per else 0.5), 0.3
    height = top + bottom + 2 * rows * inch + 0.25
    fig, axes = figure(height, nrows=2)
    halves = [("reduce-scatter", 0, "round k: rank r sends its partial sum of chunk "
                                    "(r−k) mod N to rank r+1, which adds it to its own"),
              ("all-gather", n - 1, "round k: rank r sends the complete chunk (r−k+1) mod N "
                                    "to rank r+1, which keeps it")]
    for ax, (name, first, rule) in zip(axes, halves):
        bare(ax, width, n)
        ax.set_ylim(n + 0.1, -2.7)
        ax.set_anchor("W")  # a small ring: the grids at the left, under their rules
        for i, k in enumerate(shown):  # the state before the half, then after rounds
            index = first + k
            title = ("start" if index == 0 else "after the reduce-scatter" if k == 0
                     else f"round {k}")
            _draw_ring_grid(ax, states[index], sends[index - 1] if k else [], n,
                            left + i * (n + gap), title)
        for r in range(n):
            ax.text(left - 0.2, r + 0.5, f"rank {r}", ha="right", va="center",
                    fontsize=SMALLEST_PT)
        ax.text(0, -2.7, name, ha="left", va="top", fontsize=TITLE_PT, weight="bold")
        ax.text(0, -1.75, rule, ha="left", va="top", fontsize=SMALLEST_PT)
    rounds = f"{n - 1} round{'s' if n > 2 else ''}"
    fig.suptitle(f"All-reduce on a ring of {n} = reduce-scatter ({rounds}), then "
                 f"all-gather ({rounds}){per}", fontsize=TITLE_PT)
    fig.text(0.5, 0.01, "columns: chunks 0 to N−1; number and depth: how many ranks' "
             "contributions a chunk sums; outlined: just arrived", ha="center",
             fontsize=SMALLEST_PT)
    fig.subplots_adjust(left=0.01, right=0.99, top=1 - top / height,
                        bottom=bottom / height, hspace=0.1)
    return fig


def ring_animation(world: int = 4, numel: int | None = None, elem_size: int = 2,
                   interval: int = 1200):
    """The same all-reduce as a ring of ranks, one frame per round: an arrow from each
    rank to the next carries the chunk it sends. Show it with `viz.player_html`."""
    import math

    from matplotlib.animation import FuncAnimation

    n = _check_drawn(world)
    states, sends = ring_states("all_reduce", n), ring_sends("all_reduce", n)
    bytes_text = ""
    if numel is not None:
        _, _, _, round_bytes = comm.ring_traffic("all_reduce", numel, n, elem_size)
        bytes_text = f", {size_text(round_bytes)}"
    fig, ax = figure(4.6)
    fig.subplots_adjust(left=0, right=1, top=0.88, bottom=0.02)
    w = min(0.9, 3.6 / n)  # a chunk's width: a rank's strip at most 3.6 wide
    # an ellipse, wider than tall: each rank is a strip of N chunks
    at = [(4.4 * math.sin(2 * math.pi * r / n), 3.1 * math.cos(2 * math.pi * r / n))
          for r in range(n)]

    def edge(r):
        """Where an arrow leaves or meets rank r's strip: its side that faces the middle."""
        x, y = at[r]
        length = math.hypot(x, y)
        dx, dy = -x / length, -y / length
        t = min((n * w / 2 + 0.15) / abs(dx) if dx else math.inf,
                0.65 / abs(dy) if dy else math.inf)
        return x + t * dx, y + t * dy

    def draw(k):
        ax.clear()
        ax.set_xlim(-7.5, 7.5)
        ax.set_ylim(-4.4, 4.6)
        ax.set_aspect("equal")
        ax.set_axis_off()
        held = states[k]
        moving = sends[k - 1] if k else []
        arrived = {(receiver, chunk) for _, receiver, chunk in moving}
        for r, (x, y) in enumerate(at):
            x0 = x - n * w / 2
            for c in range(n):
                count = len(held[r][c])
                cell(ax, x0 + w * c, y - 0.45, rank_color(c) if count else "white",
                     w=w, h=0.9, alpha=0.15 + 0.85 * count / n if count else 1.0,
                     text=str(count) if count else "", edge="#BBBBBB")
                if (r, c) in arrived:
                    cell(ax, x0 + w * c + 0.05, y - 0.4, "none", w=w - 0.1, h=0.8,
                         edge="black", linewidth=1.8)
            below = y < -0.5  # the label on the outer side, away from the arrows
            ax.text(x, y - 0.55 if below else y + 0.55, f"rank {r}", ha="center",
                    va="top" if below else "bottom", fontsize=SMALLEST_PT)
        for sender, receiver, chunk in moving:
            (x1, y1), (x2, y2) = edge(sender), edge(receiver)
            ax.annotate("", xy=(x2, y2), xytext=(x1, y1),
                        arrowprops={"arrowstyle": "-|>", "color": rank_color(chunk),
                                    "lw": 2, "shrinkA": 3, "shrinkB": 3,
                                    "connectionstyle": "arc3,rad=0.25"})
            ax.text((x1 + x2) * 0.42, (y1 + y2) * 0.42, f"chunk {chunk}", ha="center",
                    va="center", fontsize=SMALLEST_PT, color=rank_color(chunk),
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
        if k == 0:
            title = "start: each rank holds its own tensor, cut into N chunks (chunk 0 left)"
        elif k < n:
            title = (f"reduce-scatter, round {k} of {n - 1}: each rank adds the chunk that "
                     f"arrives to its own copy")
        else:
            title = (f"all-gather, round {k - n + 1} of {n - 1}: each rank passes on the "
                     f"complete chunk it received last")
        ax.set_title(f"{title}\nthe number: how many ranks' contributions a chunk sums; "
                     f"each arrow: one chunk{bytes_text}", fontsize=TITLE_PT)
        return []

    anim = FuncAnimation(fig, draw, frames=len(states), interval=interval, blit=False)
    pyplot().close(fig)
    return anim


__all__ = ["RING_OPS", "ring_sends", "ring_states", "ring_figure", "ring_animation"]
