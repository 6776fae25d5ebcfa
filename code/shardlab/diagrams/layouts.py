"""Diagrams of where elements live: the three ways to cut a unit, the rectangles a
checkpoint writes for a flat range, and the axes that tensor, pipeline, context and
expert parallelism cut.

The cuts are the package's own rules: ZeRO-3's flat padded buffer (`shardlab.zero3`,
`memory.shard_numel`), FSDP2's rows (`shardlab.fsdp`, `memory.rows_of`), DeepSpeed's
per-parameter partition (its rule, written once below), each turned into every rank's
range of every parameter by `strategy.owned_ranges`, as the strategies' `pieces()` do; the
rectangles are `checkpoint.layout.boxes`'.
"""

from __future__ import annotations

import math

from shardlab import memory
from shardlab.checkpoint.layout import boxes
from shardlab.diagrams.draw import (SMALLEST_PT, TITLE_PT, bare, cell, figure, grid,
                                    legend_patches, rank_color)
from shardlab.strategy import owned_ranges

# A unit of two linear layers (6 -> 4 without bias, 8 -> 6 with one): small enough to
# draw element by element, and on 3 or 4 ranks each cut gives it padding somewhere.
UNIT = (("w1", (4, 6)), ("w2", (6, 8)), ("b2", (6,)))


def _check(shapes, world: int) -> list[tuple[str, tuple[int, ...]]]:
    memory.check_world(world)
    out = [(str(name), tuple(int(d) for d in shape)) for name, shape in shapes]
    if not out or any(not shape or min(shape) < 1 for _, shape in out):
        raise ValueError("shapes must be (name, shape) pairs of parameters with at least "
                         "one dimension and no empty one, e.g. (('w', (4, 6)), ('b', (4,)))")
    return out


def flat_ranges(shapes, world: int) -> list[list[tuple[int, int, int]]]:
    """ZeRO-3's cut (`shardlab.zero3.FlatBuffer`): the parameters back to back in one
    buffer padded to N·S elements, S = ceil(Ψ_unit/N); rank r owns [rS, (r+1)S). Each
    parameter's (rank, start, stop) as `FlatUnit.pieces` computes them."""
    shapes = _check(shapes, world)
    sizes = [math.prod(shape) for _, shape in shapes]
    shard = memory.shard_numel(sum(sizes), world)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [owned_ranges(o, o + n, lambda r: r * shard, world)
            for o, n in zip(offsets, sizes)]


def deepspeed_partition_numel(numel: int, world: int) -> int:
    """DeepSpeed's ZeRO-3 partition of one parameter: its flattened view padded to a
    multiple of N, then cut N ways (deepspeed/runtime/zero/partition_parameters.py,
    `_partition_param`: partition_size = _aligned_size(param) // world; rank r holds
    [r·partition_size, (r+1)·partition_size))."""
    return -(-numel // world)


def per_parameter_ranges(shapes, world: int) -> list[list[tuple[int, int, int]]]:
    """DeepSpeed's cut: each parameter flattened and cut N ways on its own."""
    shapes = _check(shapes, world)
    out = []
    for _, shape in shapes:
        numel = math.prod(shape)
        part = deepspeed_partition_numel(numel, world)
        out.append(owned_ranges(0, numel, lambda r: r * part, world))
    return out


def dim0_ranges(shapes, world: int) -> list[list[tuple[int, int, int]]]:
    """FSDP2's cut (`shardlab.fsdp.PerParamUnit`): each parameter's rows, ceil(d0/N) a
    rank as `torch.chunk` cuts dim 0, the last ranks fewer or none (`memory.rows_of`)."""
    shapes = _check(shapes, world)
    out = []
    for _, shape in shapes:
        cols = math.prod(shape[1:])
        rows = [memory.rows_of(shape[0], world, r) for r in range(world)]
        out.append(owned_ranges(0, math.prod(shape), lambda r: sum(rows[:r]) * cols, world))
    return out


CUTS = {
    "flat": ("one flat buffer, padded and cut N ways (the course's ZeRO-3, FSDP1)",
             flat_ranges),
    "per-parameter": ("each parameter flattened and cut N ways (DeepSpeed's ZeRO-3)",
                      per_parameter_ranges),
    "dim-0": ("each parameter's rows cut N ways (FSDP2)", dim0_ranges),
}


def _slot(cut: str, shape: tuple[int, ...], world: int) -> int:
    """Elements a rank stores for one parameter, padding included (per-parameter cuts)."""
    if cut == "per-parameter":
        return deepspeed_partition_numel(math.prod(shape), world)
    return -(-shape[0] // world) * math.prod(shape[1:])


def cuts_data(shapes=UNIT, world: int = 4) -> dict[str, dict]:
    """For each cut: every parameter's ranges (rank, start, stop), and what each rank
    stores, in order, as (parameter name or None for padding, elements)."""
    shapes = _check(shapes, world)
    out = {}
    for cut, (title, ranges_of) in CUTS.items():
        ranges = ranges_of(shapes, world)
        stored: list[list[tuple[str | None, int]]] = [[] for _ in range(world)]
        for (name, shape), owned in zip(shapes, ranges):
            mine = {r: b - a for r, a, b in owned}
            for r in range(world):
                if mine.get(r):
                    stored[r].append((name, mine[r]))
                if cut != "flat":
                    pad = _slot(cut, shape, world) - mine.get(r, 0)
                    if pad:
                        stored[r].append((None, pad))
        if cut == "flat":
            shard = memory.shard_numel(sum(math.prod(s) for _, s in shapes), world)
            for r in range(world):
                pad = shard - sum(n for _, n in stored[r])
                if pad:
                    stored[r].append((None, pad))
        out[cut] = {"title": title, "ranges": {name: owned for (name, _), owned
                                                in zip(shapes, ranges)},
                    "stored": stored}
    return out


def _grid_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a parameter drawn row-major: dim 0 down, the rest across."""
    return shape[0], math.prod(shape[1:])


def _owner(owned, index: int) -> int | None:
    return next((r for r, a, b in owned if a <= index < b), None)


def _draw_parameters(ax, shapes, ranges, x0: float, y0: float, gap: float = 1.0,
                     alpha: float = 1.0) -> float:
    """Each parameter as a grid of its elements, coloured by the rank that owns each;
    returns the x where the next drawing may start."""
    x = x0
    for name, shape in shapes:
        rows, cols = _grid_shape(shape)
        grid(ax, [[rank_color(_owner(ranges[name], i * cols + j)) for j in range(cols)]
                  for i in range(rows)], x, y0, alpha=alpha)
        ax.text(x + cols / 2, y0 - 0.2, f"{name} {tuple(shape)}", ha="center", va="bottom",
                fontsize=SMALLEST_PT)
        x += cols + gap
    return x


def cuts_figure(shapes=UNIT, world: int = 4):
    """`cuts_data` drawn: for each cut, the unit's parameters element by element coloured
    by owning rank (left), and each rank's storage, in order, padding hatched (right)."""
    shapes = _check(shapes, world)
    data = cuts_data(shapes, world)
    height = max(_grid_shape(s)[0] for _, s in shapes)
    grids = sum(_grid_shape(s)[1] + 1 for _, s in shapes)
    longest = max(sum(n for _, n in row) for d in data.values() for row in d["stored"])
    width = grids + 3.0 + longest
    fig, axes = figure(0.9 + 0.2 * (height + 2.2) * len(CUTS), nrows=len(CUTS))
    for ax, (cut, d) in zip(axes, data.items()):
        bare(ax, width, height)
        ax.set_ylim(height + 0.1, -2.3)
        ax.text(0, -2.3, d["title"], ha="left", va="top", fontsize=TITLE_PT, weight="bold")
        x = _draw_parameters(ax, shapes, d["ranges"], 0, 0)
        x += 2.0
        for r, row in enumerate(d["stored"]):
            ax.text(x - 0.2, r + 0.5, f"r{r}", ha="right", va="center", fontsize=SMALLEST_PT)
            at = x
            for name, n in row:
                cell(ax, at, r, "white" if name is None else rank_color(r), w=n,
                     hatch="///" if name is None else None,
                     edge="gray" if name is None else "white", linewidth=0.6,
                     text=name if name and n >= 2 else "", text_color="white")
                at += n
        ax.text(x + longest / 2, -0.2, "what each rank stores", ha="center", va="bottom",
                fontsize=SMALLEST_PT)
    fig.legend(handles=legend_patches([(f"rank {r}", rank_color(r)) for r in range(world)]
                                      + [("padding", "white", "///")]),
               loc="lower center", ncol=world + 1, frameon=False, fontsize=SMALLEST_PT)
    fig.suptitle(f"Three ways to cut one unit on {world} ranks", fontsize=TITLE_PT)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.93, bottom=0.07, hspace=0.15)
    return fig


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_data(shapes=UNIT, world: int = 3, cut: str = "flat") -> dict[str, list]:
    """For each parameter, each rank's piece as the checkpoint writes it: (rank, start,
    stop, rectangles), the rectangles `checkpoint.layout.boxes` cuts the flat range into
    (offsets, sizes, first flat index), each one chunk of the file."""
    if cut not in CUTS:
        raise ValueError(f"unknown cut {cut!r}; use one of {list(CUTS)}")
    shapes = _check(shapes, world)
    ranges = CUTS[cut][1](shapes, world)
    return {name: [(r, a, b, boxes(shape, a, b)) for r, a, b in owned]
            for (name, shape), owned in zip(shapes, ranges)}


def _box_text(shape, offsets, sizes) -> str:
    """A rectangle as the slice it is: "[1:3, :]", "[3, 0:4]"."""
    return "[" + ", ".join(":" if s == d and len(shape) > 1 else f"{o}" if s == 1
                           else f"{o}:{o + s}"
                           for d, o, s in zip(shape, offsets, sizes)) + "]"


def checkpoint_figure(shapes=UNIT, world: int = 3, cut: str = "flat"):
    """`checkpoint_data` drawn: each parameter element by element, coloured by rank, each
    rectangle outlined, and beside them each rank's rectangles as slices."""
    from matplotlib.patches import Rectangle

    shapes = _check(shapes, world)
    data = checkpoint_data(shapes, world, cut)
    height = max(_grid_shape(s)[0] for _, s in shapes)
    fig, ax = figure(0.8 + 0.3 * height)
    grids = sum(_grid_shape(s)[1] + 1 for _, s in shapes)
    bare(ax, grids + 14.5, height)
    ax.set_ylim(height + 0.2, -1.0)
    ranges = {name: [(r, a, b) for r, a, b, _ in pieces] for name, pieces in data.items()}
    _draw_parameters(ax, shapes, ranges, 0, 0, alpha=0.45)
    lines = []
    x = 0
    for name, shape in shapes:
        rows, cols = _grid_shape(shape)
        for r, a, b, rects in data[name]:
            for offsets, sizes, _ in rects:
                row = offsets[0]
                col = offsets[1] if len(shape) > 1 else 0
                h = sizes[0] if len(shape) > 1 else 1
                w = math.prod(sizes[1:]) if len(shape) > 1 else 1
                if len(shape) == 1:  # a vector is drawn as a column: one box per element run
                    h, w, row, col = sizes[0], 1, offsets[0], 0
                ax.add_patch(Rectangle((x + col + 0.06, row + 0.06), w - 0.12, h - 0.12,
                                       facecolor="none", edgecolor=rank_color(r),
                                       linewidth=2.2, zorder=3))
            lines.append((r, f"{name} [{a}:{b}] → " + " ".join(_box_text(shape, o, s)
                                                               for o, s, _ in rects)))
        x += cols + 1
    for i, (r, text) in enumerate(sorted(lines, key=lambda l: l[0])):
        ax.text(grids + 0.5, i * (height + 0.2) / max(len(lines), 1) + 0.3,
                f"rank {r}: {text}", ha="left", va="center", fontsize=SMALLEST_PT,
                color=rank_color(r))
    ax.set_title(f"Each rank's range of a parameter, written as rectangles\n"
                 f"(the {cut} cut on {world} ranks; a rectangle is one chunk of the file)",
                 fontsize=TITLE_PT)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.8, bottom=0.02)
    return fig


# ----------------------------------------------------------------------------- parallelisms


PARTS = ("the layers\n(a row each)", "a layer's\nweights\n(in × out)",
         "a layer's\nactivations\n(tokens × hidden)")
EVERY_GPU = "#D9D9D9"  # a cell every GPU holds whole


def parallelism_data(model: str = "mixtral-8x7b", degree: int = 4, seq: int = 4096,
                     cells: int = 8) -> dict:
    """What one GPU holds under each parallelism of `degree` GPUs, for a model of
    `memory.get_model`: the model's layers, one layer's weight matrix (hidden in by
    hidden out; for experts, the E experts side by side) and one layer's activations
    (tokens down, hidden units across), each as a grid of `cells` x `cells` blocks (the
    layers: one row a layer) giving the GPU that holds each block, None where every GPU
    holds it. Tensor parallelism cuts each matrix by columns (and the hidden
    activations with it); pipeline parallelism gives each GPU L/P consecutive layers,
    whole; context parallelism cuts the sequence; expert parallelism the experts."""
    cfg = memory.as_config(model)
    degree = memory.check_positive("degree", degree, integer=True)
    L, E = cfg.layers, cfg.experts
    checks = [("layers", L), ("tokens", seq), ("hidden units", cfg.hidden), ("blocks", cells)]
    checks += [("experts", E)] if E > 1 else []
    for what, count in checks:
        if count % degree:
            raise ValueError(f"degree {degree} does not divide the {count} {what} of "
                             f"{cfg.name}: use a divisor of {count}")

    def owners(rows, rule):
        return [[rule(i, j) for j in range(cells)] for i in range(rows)]

    every = owners(cells, lambda i, j: None)
    by_column = owners(cells, lambda i, j: j * degree // cells)
    stage0 = owners(cells, lambda i, j: 0)
    out = {
        "tensor": {"parts": (owners(L, lambda i, j: None), by_column, by_column),
                   "per_gpu": f"1/{degree} of each matrix\n({cfg.hidden // degree:,} of "
                              f"{cfg.hidden:,} columns), in all {L} layers",
                   "sends": "all-reduce of the activations:\n2 a layer in forward, "
                            "2 in backward"},
        "pipeline": {"parts": (owners(L, lambda i, j: i * degree // L), stage0, stage0),
                     "per_gpu": f"{L // degree} of {L} layers, whole\n(drawn: a layer "
                                f"of GPU 0)",
                     "sends": "the activations at each stage\nboundary, per micro-batch"},
        "context": {"parts": (owners(L, lambda i, j: None), every,
                              owners(cells, lambda i, j: i * degree // cells)),
                    "per_gpu": f"{seq // degree:,} of {seq:,} tokens, and\nall the "
                               f"weights",
                    "sends": "keys and values: all-gather,\nreduce-scatter in backward"},
    }
    if E > 1:
        out["expert"] = {"parts": (owners(L, lambda i, j: None),
                                   owners(cells, lambda i, j: (j * E // cells) * degree // E),
                                   every),
                         "per_gpu": f"{E // degree} of the {E} experts of each\nlayer "
                                    f"(weights: experts side by side)",
                         "sends": "all-to-all: each token to its\nexperts' GPUs and back"}
    return {"model": cfg.name, "layers": L, "experts": E, "degree": degree, "seq": seq,
            "parallelisms": out}


def parallelism_figure(model: str = "mixtral-8x7b", degree: int = 4, seq: int = 4096):
    """`parallelism_data` drawn: a row per parallelism, and in it what GPU g holds of the
    layers, of one layer's weights and of its activations (grey: every GPU, whole)."""
    data = parallelism_data(model, degree, seq)
    rows = data["parallelisms"]
    ncol = min(degree + 1, 6)
    top, bottom = 0.95, 0.15 + 0.22 * math.ceil((degree + 1) / ncol)
    height = top + bottom + 1.0 * len(rows)
    fig, axes = figure(height, nrows=len(rows), ncols=5,
                       gridspec_kw={"width_ratios": [1.0, 1, 1, 1, 2.6]})
    for k, (name, d) in enumerate(rows.items()):
        label, *grids, text = axes[k]
        label.set_axis_off()
        label.text(1.0, 0.5, f"{name}\nparallel", ha="right", va="center",
                   fontsize=TITLE_PT, weight="bold", transform=label.transAxes)
        for ax, part, owners in zip(grids, PARTS, d["parts"]):
            n_rows, n_cols = len(owners), len(owners[0])
            bare(ax, n_cols, n_rows)
            ax.set_aspect("auto")
            grid(ax, [[EVERY_GPU if g is None else rank_color(g) for g in row]
                      for row in owners], linewidth=0.3 if n_rows > 16 else 0.6)
            if k == 0:
                ax.set_title(part, fontsize=SMALLEST_PT)
        text.set_axis_off()
        text.text(0.04, 0.5, f"a GPU holds {d['per_gpu']}\nsends: {d['sends']}",
                  ha="left", va="center", fontsize=SMALLEST_PT, transform=text.transAxes)
    fig.legend(handles=legend_patches([(f"GPU {g}", rank_color(g)) for g in range(degree)]
                                      + [("every GPU", EVERY_GPU)]),
               loc="lower center", ncol=ncol, frameon=False, fontsize=SMALLEST_PT)
    experts = f", {data['experts']} experts" if data["experts"] > 1 else ""
    fig.suptitle(f"What each parallelism of degree {degree} cuts: {data['model']} "
                 f"({data['layers']} layers{experts}, {data['seq']:,} tokens)",
                 fontsize=TITLE_PT)
    fig.subplots_adjust(left=0.01, right=0.99, top=1 - top / height,
                        bottom=bottom / height, wspace=0.12, hspace=0.25)
    return fig


__all__ = ["UNIT", "CUTS", "flat_ranges", "deepspeed_partition_numel",
           "per_parameter_ranges", "dim0_ranges", "cuts_data", "cuts_figure",
           "checkpoint_data", "checkpoint_figure", "PARTS", "EVERY_GPU", "parallelism_data",
           "parallelism_figure"]
