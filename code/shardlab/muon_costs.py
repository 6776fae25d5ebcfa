"""Which Muon design wins, at which world size and model shape: the formulas of
`shardlab.comm.whole_matrix` and `shardlab.memory.whole_matrix` over a transformer's
hidden matrices, turned into the time of one step's orthogonalization, and a figure.

A transformer block has four hidden matrices (as `nn.Linear` weights, out x in): the
attention's qkv (3d x d) and output projection (d x d), the MLP's up (4d x d) and down
(d x 4d) projections. For each design, the slowest rank sets the time:

    seconds = its Newton-Schulz FLOPs / F + its bytes sent / β + its messages x α

with F the rate of its bf16 matmuls, and α, β the network's latency and bandwidth: gather
and owner over FSDP2's dim-0 cut, whole over ZeRO buckets of `bucket_matrices` matrices
laid out whole (its bytes are the padding its buckets' reduce-scatter and all-gather
move, in fp32). A model, not a measurement: the chapter sets it beside runs on this
machine at small N, and states the F, α and β it assumes for a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlab.comm.whole_matrix import muon_messages, muon_sent_bytes, whole_layout_extra_bytes
from shardlab.memory.whole_matrix import muon_gathered_bytes
from shardlab.muon import DESIGNS, dim0_ranges, newton_schulz_flops, owners_by_size


def transformer_matrices(d_model: int, n_layer: int) -> list[tuple[int, int]]:
    """The hidden matrices' shapes of `n_layer` blocks of width `d_model`."""
    d = d_model
    return [shape for _ in range(n_layer) for shape in ((3 * d, d), (d, d), (4 * d, d),
                                                        (d, 4 * d))]


@dataclass(frozen=True)
class DesignCost:
    """One design at one world size: the slowest rank's bytes sent, gathered matrices
    held, Newton-Schulz FLOPs, and the seconds they take together."""

    design: str
    world: int
    sent: int
    held: int
    flops: int
    seconds: float


def design_costs(shapes: list[tuple[int, int]], world: int, flops_per_s: float,
                 alpha: float, beta: float,
                 bucket_matrices: int | None = None) -> dict[str, DesignCost]:
    """{design: its cost} for hidden matrices of `shapes` on `world` ranks."""
    names = [str(i) for i in range(len(shapes))]
    sizes = [math.prod(s) for s in shapes]
    owner = owners_by_size(list(zip(names, sizes)), world)
    owners = [owner[n] for n in names]
    ranges = [dim0_ranges(s, world) for s in shapes]
    out = {}
    for design in DESIGNS:
        if design == "whole":
            per = bucket_matrices or len(shapes)
            buckets = [list(range(i, min(i + per, len(shapes))))
                       for i in range(0, len(shapes), per)]
            on = [0] * world
            for bucket in buckets:
                held_by = owners_by_size([(str(i), sizes[i]) for i in bucket], world)
                for i in bucket:
                    on[held_by[str(i)]] += newton_schulz_flops(shapes[i])
            sent = whole_layout_extra_bytes([[sizes[i] for i in b] for b in buckets], world)
            held, flops, messages = 0, max(on), 0
        else:
            sent = max(muon_sent_bytes(design, ranges, world, r, owners)
                       for r in range(world))
            held = max(muon_gathered_bytes(design, list(zip(shapes, ranges)), world, r,
                                           owners) for r in range(world))
            mine = [[newton_schulz_flops(s) for s, o in zip(shapes, owners)
                     if design == "gather" or o == r] for r in range(world)]
            flops = max(sum(m) for m in mine)
            messages = muon_messages(design, ranges, world, owners)
        out[design] = DesignCost(design, world, sent, held, flops,
                                 flops / flops_per_s + sent / beta + messages * alpha)
    return out


def winners(shapes: list[tuple[int, int]], worlds: list[int], **machine) -> dict[int, str]:
    """{world: the fastest design}."""
    return {n: min(design_costs(shapes, n, **machine).values(),
                   key=lambda c: c.seconds).design for n in worlds}


def design_figure(models: dict[str, tuple[int, int]], worlds: list[int],
                  flops_per_s: float, alpha: float, beta: float):
    """One panel per model (name -> (d_model, n_layer)): each design's predicted seconds
    of orthogonalization per step against the world size."""
    import matplotlib.pyplot as plt

    from shardlab.viz import DPI, MAX_WIDTH_IN, SMALLEST_PT
    colors = {"gather": "#4C72B0", "owner": "#DD8452", "whole": "#55A868"}
    # the book's column: wider, and the page would shrink the text under its smallest size
    fig, axes = plt.subplots(1, len(models), figsize=(MAX_WIDTH_IN, 3.2), dpi=DPI,
                             squeeze=False)
    for ax, (name, (d, layers)) in zip(axes[0], models.items()):
        shapes = transformer_matrices(d, layers)
        costs = [design_costs(shapes, n, flops_per_s, alpha, beta) for n in worlds]
        for design in DESIGNS:
            ax.plot(worlds, [1e3 * c[design].seconds for c in costs], marker="o",
                    markersize=3, color=colors[design], label=design)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{name}\nd={d}, {layers} layers", fontsize=SMALLEST_PT)
        ax.set_xlabel("ranks N")
        ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].set_ylabel("ms per step (slowest rank)")
    axes[0][0].legend(frameon=False, fontsize=SMALLEST_PT)
    fig.tight_layout()
    return fig
