"""Diagrams of who holds what and which collective runs when: one ZeRO-1 step, each
ZeRO stage's holdings and collectives, and HSDP's mesh of groups.

The bytes are `memory.model_states`' and `comm`'s (ring traffic, HSDP's volume per
link); when a collective runs is read off the strategy's card (`shardlab.cards`); the
mesh is `hsdp.hsdp_rank_lists`'.
"""

from __future__ import annotations

from shardlab import comm, memory
from shardlab.cards import OURS, card, names
from shardlab.diagrams.draw import (COLORS, LABELS, MAX_WIDTH_IN, SMALLEST_PT, TITLE_PT,
                                    bare, cell, figure, legend_patches, rank_color,
                                    size_text)
from shardlab.hsdp import hsdp_rank_lists

CATEGORIES = ("params", "grads", "optimizer")

# ----------------------------------------------------------------------------- ZeRO-1


def _phase_words(strategy: str, op: str) -> list[str]:
    """Where a collective runs in a step, from the strategy's card: ["backward", ...]."""
    where = card(strategy).schedule.get(op)
    if where is None:
        return []
    pairs = where if isinstance(where[0], tuple) else (where,)
    return [phase for phase, _ in pairs]


def zero1_step_data(world: int = 4, psi: int | None = None,
                    precision: str = "bf16-mixed", optimizer: str = "adamw") -> dict:
    """One ZeRO-1 step as four moments, each with what every rank holds of each chunk:
    params "old" / "new", grads "local" / "mean" (chunk r reduced onto rank r), and the
    optimizer state of chunk r on rank r alone. The collectives' phases are read from the
    card of `zero1`; with `psi`, the bytes a rank sends in each (`comm.ring_traffic`) and
    holds (`memory.model_states`, stage 1)."""
    n = memory.check_world(world)
    own = [[c == r for c in range(n)] for r in range(n)]
    moments = [
        ("1. backward", "each rank: its own\nfull gradients",
         lambda r, c: ("old", "local")),
        ("2. reduce-scatter", f"in the {_phase_words('zero1', 'reduce_scatter')[0]}: "
                              f"rank r\ngets chunk r's mean",
         lambda r, c: ("old", "mean" if own[r][c] else "local")),
        ("3. step the shard", "rank r steps chunk r\nwith 1/N of the states",
         lambda r, c: ("new" if own[r][c] else "old", "mean" if own[r][c] else "local")),
        ("4. all-gather", f"every chunk to every\nrank, by the next "
                          f"{_phase_words('zero1', 'all_gather')[0]}",
         lambda r, c: ("new", "mean" if own[r][c] else "local")),
    ]
    data = {"world": n, "moments": [], "sent": None, "states": None}
    for title, note, rule in moments:
        holds = [{"params": [rule(r, c)[0] for c in range(n)],
                  "grads": [rule(r, c)[1] for c in range(n)],
                  "optimizer": [own[r][c] for c in range(n)]} for r in range(n)]
        data["moments"].append({"title": title, "note": note, "holds": holds})
    if psi is not None:
        per = memory.bytes_per_param(precision, optimizer)
        data["sent"] = {op: comm.ring_traffic(op, psi, n, getattr(per, category))[0]
                        for op, category in (("reduce_scatter", "grads"),
                                             ("all_gather", "params"))}
        data["states"] = memory.model_states(psi, n, 1, precision, optimizer)
    return data


_SHADES = {"old": (COLORS["params"], 0.35), "new": (COLORS["params"], 1.0),
           "local": (COLORS["grads"], 0.35), "mean": (COLORS["grads"], 1.0)}


def zero1_step_figure(world: int = 4, psi: int | None = None,
                      precision: str = "bf16-mixed", optimizer: str = "adamw"):
    """`zero1_step_data` drawn: four panels left to right, each rank a block of three
    rows of N chunks (parameters, gradients, optimizer state)."""
    data = zero1_step_data(world, psi, precision, optimizer)
    n = data["world"]
    fig, axes = figure(1.9 + 0.62 * n, ncols=4)
    for ax, moment in zip(axes, data["moments"]):
        bare(ax, n + 0.2, 4 * n)
        ax.set_ylim(4 * n, -3.4)
        for r, holds in enumerate(moment["holds"]):
            y = 4 * r
            for c in range(n):
                for row, category in enumerate(CATEGORIES):
                    value = holds[category][c]
                    if category == "optimizer":
                        color, alpha = (COLORS["optimizer"], 1.0) if value else ("white", 1)
                    else:
                        color, alpha = _SHADES[value]
                    cell(ax, 0.1 + c, y + row, color, alpha=alpha, edge="#CCCCCC",
                         linewidth=0.5)
            ax.text(-0.15, y + 1.5, f"r{r}", ha="right", va="center", fontsize=SMALLEST_PT)
        ax.text(n / 2 + 0.1, -3.4, moment["title"], ha="center", va="top",
                fontsize=TITLE_PT, weight="bold")
        ax.text(n / 2 + 0.1, -2.2, moment["note"], ha="center", va="top",
                fontsize=SMALLEST_PT)
    handles = legend_patches([
        ("parameter, old", (*_rgb(COLORS["params"], 0.35),)), ("parameter, updated",
                                                               COLORS["params"]),
        ("own gradient", (*_rgb(COLORS["grads"], 0.35),)), ("mean gradient",
                                                             COLORS["grads"]),
        ("optimizer state", COLORS["optimizer"])])
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False,
               fontsize=SMALLEST_PT, handlelength=1.2, columnspacing=1.0)
    if data["sent"] is not None:
        mb = {op: size_text(b) for op, b in data["sent"].items()}
        fig.suptitle(f"One ZeRO-1 step, N = {n}, Ψ = {psi:,}: each rank sends "
                     f"{mb['reduce_scatter']} in the reduce-scatter\nand "
                     f"{mb['all_gather']} in the all-gather; it holds "
                     f"{size_text(data['states'].total)} of model states "
                     f"(rows per rank: parameters, gradients, optimizer)", fontsize=SMALLEST_PT)
    else:
        fig.suptitle(f"One ZeRO-1 step on {n} ranks: reduce-scatter, step the shard, "
                     f"all-gather\n(rows per rank: parameters, gradients, optimizer)",
                     fontsize=TITLE_PT)
    fig.subplots_adjust(left=0.04, right=0.99, top=0.88, bottom=0.09, wspace=0.25)
    return fig


def _rgb(color: str, alpha: float) -> tuple:
    """A colour blended with white, as a solid colour (for legends of faded cells)."""
    from matplotlib.colors import to_rgb

    return tuple(1 - alpha + alpha * v for v in to_rgb(color))


# ----------------------------------------------------------------------------- stages


def stage_strategy(stage: int) -> str:
    """The course's strategy of a ZeRO stage, from the cards (stage 0 is DDP)."""
    memory.check_stage(stage)
    return "ddp" if stage == 0 else names(family=OURS, zero_stage=stage)[0]


def holdings_data(psi: int, world: int = 4, precision: str = "bf16-mixed",
                optimizer: str = "adamw") -> list[dict]:
    """For each stage: its strategy, the bytes per rank (`memory.model_states`), which
    chunks of each category rank r holds (all N where the formula keeps the full Ψ, its
    own where it keeps Ψ/N), and its collectives by phase, read off the card."""
    n = memory.check_world(world)
    per = memory.bytes_per_param(precision, optimizer).as_dict()
    out = []
    for stage in memory.STAGES:
        strategy = stage_strategy(stage)
        states = memory.model_states(psi, n, stage, precision, optimizer)
        sharded = {c: getattr(states, c) < per[c] * psi for c in CATEGORIES}
        chunks = [{c: [r] if sharded[c] else list(range(n)) for c in CATEGORIES}
                  for r in range(n)]
        phases = {"forward": [], "backward": [], "step": []}
        for op in card(strategy).schedule:
            for phase in _phase_words(strategy, op):
                phases[phase].append(op)
        out.append({"stage": stage, "strategy": strategy, "states": states,
                    "chunks": chunks, "phases": phases})
    return out


def holdings_figure(psi: int, world: int = 4, precision: str = "bf16-mixed",
                  optimizer: str = "adamw", unit: str = "GB"):
    """`holdings_data` drawn: a column per stage, each rank a block of three rows of N
    chunks (filled where it holds them), the bytes per rank above, and below, which
    collectives run in forward, backward and the optimizer step."""
    from shardlab.viz import UNITS

    rows = holdings_data(psi, world, precision, optimizer)
    n = memory.check_world(world)
    fig, axes = figure(2.6 + 0.62 * n, ncols=4)
    for ax, row in zip(axes, rows):
        bare(ax, n + 0.2, 4 * n + 5.3)
        ax.set_ylim(4 * n + 5.3, -2.4)
        for r, chunks in enumerate(row["chunks"]):
            for k, category in enumerate(CATEGORIES):
                for c in range(n):
                    held = c in chunks[category]
                    cell(ax, 0.1 + c, 4 * r + k, COLORS[category] if held else "white",
                         edge="#CCCCCC", linewidth=0.5)
            ax.text(-0.15, 4 * r + 1.5, f"r{r}", ha="right", va="center",
                    fontsize=SMALLEST_PT)
        total = row["states"].total / UNITS[unit]
        ax.text(n / 2 + 0.1, -2.3, f"stage {row['stage']} ({row['strategy']})",
                ha="center", va="top", fontsize=TITLE_PT, weight="bold")
        ax.text(n / 2 + 0.1, -1.2, f"{total:,.1f} {unit} per rank", ha="center", va="top",
                fontsize=SMALLEST_PT)
        y = 4 * n + 0.3
        for phase, ops in row["phases"].items():
            words = [op.replace("_", "-") for op in ops] or ["–"]
            lines = [f"{phase}: {words[0]}"] + [f"    + {w}" for w in words[1:]]
            for line in lines:
                ax.text(-0.6, y, line, ha="left", va="top", fontsize=SMALLEST_PT,
                        color="black" if ops else "gray")
                y += 1.2
    fig.legend(handles=legend_patches([(LABELS[c], COLORS[c]) for c in CATEGORIES]
                                      + [("not held", "white", "")]),
               loc="lower center", ncol=4, frameon=False, fontsize=SMALLEST_PT)
    fig.suptitle(f"Who holds what: Ψ = {psi:,}, N = {n}, {precision}, {optimizer}",
                 fontsize=TITLE_PT)
    fig.subplots_adjust(left=0.04, right=0.99, top=0.92, bottom=0.07, wspace=0.3)
    return fig


# ----------------------------------------------------------------------------- HSDP


def hsdp_mesh_data(world: int = 8, shard_group: int = 4, psi: int | None = None,
                   bytes_per_elem: int = 2) -> dict:
    """HSDP's ranks as a grid: row i is shard group i (a node), column j replicate group
    j, from `hsdp.hsdp_rank_lists`; with `psi`, the bytes one rank sends per step on each
    link (`comm.hsdp_volume_per_link`)."""
    n = memory.check_world(world)
    if shard_group < 1 or n % shard_group:
        raise ValueError(f"shard_group must divide world {n}, got {shard_group!r}; use one "
                         f"of {[d for d in range(1, n + 1) if n % d == 0]}")
    shard, replicate = hsdp_rank_lists(n, shard_group)
    volumes = (comm.hsdp_volume_per_link(psi, n, shard_group, bytes_per_elem)
               if psi is not None else None)
    return {"grid": shard, "shard_groups": shard, "replicate_groups": replicate,
            "volumes": volumes, "collectives": card("hsdp").collectives}


def hsdp_mesh_figure(world: int = 8, shard_group: int = 4, psi: int | None = None,
                     bytes_per_elem: int = 2):
    """`hsdp_mesh_data` drawn: a box per rank, a frame per shard group (a node) and a
    line through each replicate group, each axis labelled with what runs along it."""
    from matplotlib.patches import FancyBboxPatch

    data = hsdp_mesh_data(world, shard_group, psi, bytes_per_elem)
    grid = data["grid"]
    rows, cols = len(grid), len(grid[0])
    if cols > 8:
        raise ValueError(f"the mesh diagram draws shard groups of at most 8 ranks, got "
                         f"{cols}; the rule is the same for any S")
    left = 1.6  # room for the row labels, in cells
    width, depth = left + 1.3 * cols, 1.3 * rows + 0.9
    inch = min(0.98 * MAX_WIDTH_IN / width, 0.75)  # one cell, in inches
    top, bottom = 0.45, 0.95
    height = top + bottom + depth * inch
    fig, ax = figure(height)
    bare(ax, width, depth)
    ax.set_ylim(depth - 0.1, -0.2)
    ax.set_anchor("W")
    for j in range(cols):  # a replicate group: one rank of each node, the same shard
        x = left + 1.3 * j
        ax.add_patch(FancyBboxPatch((x, -0.05), 1.1, 1.3 * rows - 0.15,
                                    boxstyle="round,pad=0.06", facecolor=rank_color(j),
                                    alpha=0.18, edgecolor=rank_color(j), linewidth=1.5))
        ax.text(x + 0.55, 1.3 * rows - 0.05, f"replicate\ngroup {j}", ha="center", va="top",
                fontsize=SMALLEST_PT, color=rank_color(j))
    for i, ranks in enumerate(grid):
        ax.add_patch(FancyBboxPatch((left - 0.1, 1.3 * i), 1.3 * cols - 0.1, 0.9,
                                    boxstyle="round,pad=0.08", facecolor="none",
                                    edgecolor="black", linewidth=1.2))
        ax.text(left - 0.3, 1.3 * i + 0.45, f"node {i}:\nshard\ngroup", ha="right",
                va="center", fontsize=SMALLEST_PT)
        for j, rank in enumerate(ranks):
            cell(ax, left + 1.3 * j + 0.05, 1.3 * i + 0.05, rank_color(j), w=1.0, h=0.8,
                 text=f"rank {rank}\nshard {j}", text_color="white")
    volumes = data["volumes"]
    along = (f"{volumes['intra-node'] / 1e9:,.2f} GB" if volumes else "3Ψ(S−1)/S")
    across = (f"{volumes['inter-node'] / 1e9:,.2f} GB" if volumes else "2Ψ(R−1)/(RS)")
    fig.text(0.01, 0.85 / height,
             f"along a row (inside a node): FSDP over the S = {cols} ranks of the shard "
             f"group, all-gather in\n    forward and backward, reduce-scatter of the "
             f"gradients: {along} a rank and step\n"
             f"down a column (across nodes): all-reduce of each rank's Ψ/S gradient shard "
             f"over the\n    R = {rows} ranks that hold the same shard: {across} a rank and "
             f"step", ha="left", va="top", fontsize=SMALLEST_PT)
    title = f"HSDP on {world} ranks: {rows} shard groups of {cols}, {cols} replicate groups"
    if psi is not None:
        title += f" (Ψ = {psi:,}, {bytes_per_elem} B an element)"
    fig.suptitle(title, fontsize=TITLE_PT, x=0.01, ha="left")
    fig.subplots_adjust(left=0.01, right=0.99, top=1 - top / height, bottom=bottom / height)
    return fig


__all__ = ["CATEGORIES", "zero1_step_data", "zero1_step_figure", "stage_strategy",
           "holdings_data", "holdings_figure", "hsdp_mesh_data", "hsdp_mesh_figure"]
