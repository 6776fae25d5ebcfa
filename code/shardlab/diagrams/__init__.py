"""Diagrams of the course's mechanisms, drawn from the package's own layout and schedule
code, so that a picture cannot drift from what the code does.

Each diagram is a `..._data()` function that computes what it shows from the package,
and a `..._figure()` (or `..._animation()`) that draws only that: the figures are
matplotlib figures as wide as the book's column (`viz.MAX_WIDTH_IN` at `viz.DPI`, no
text under `viz.SMALLEST_PT`); the animations play on a static page through
`viz.player_html`. A file per kind of picture:

    draw.py         the page's sizes, a colour per rank, cells and grids
    ring.py         a ring's rounds: who sends which chunk to whom (figure, animation)
    stages.py       one ZeRO-1 step, who holds what at each ZeRO stage and which
                    collective runs when, HSDP's mesh of groups
    layouts.py      the three cuts of a unit (flat, per parameter, dim 0), a flat range
                    as a checkpoint's rectangles, what TP/PP/CP/EP cut
    step_memory.py  memory through a step: DDP against ZeRO-3, and ZeRO-3 unit by unit
                    (an animation)
    timelines.py    a straggler's steps and a hang's last collectives, from a run's
                    reports and flight recorders

    from shardlab import diagrams, viz
    diagrams.ring_figure(4)                                 # a figure
    HTML(viz.player_html(diagrams.ring_animation(4)))       # an animation
"""

from shardlab.diagrams.layouts import *  # noqa: F401,F403
from shardlab.diagrams.layouts import __all__ as _layouts
from shardlab.diagrams.ring import *  # noqa: F401,F403
from shardlab.diagrams.ring import __all__ as _ring
from shardlab.diagrams.stages import *  # noqa: F401,F403
from shardlab.diagrams.stages import __all__ as _stages
from shardlab.diagrams.step_memory import *  # noqa: F401,F403
from shardlab.diagrams.step_memory import __all__ as _step_memory
from shardlab.diagrams.timelines import *  # noqa: F401,F403
from shardlab.diagrams.timelines import __all__ as _timelines

__all__ = [*_ring, *_stages, *_layouts, *_step_memory, *_timelines]
