"""What one rank of N really holds and sends, measured on the strategy's own code.

`measure_one_rank(strategy, world)` builds the model, wraps it with the strategy as rank
r of a fake world of N ranks (`shardlab.many_ranks.fake`), and runs one step of the
course's loop (`shardlab.step.train_step`) with the ledger open: the model states it
holds after the optimizer step are counted from its live tensors
(`shardlab.measure.state_bytes`, the tracker every run uses), the bytes it sends from the
collectives it called, at the sizes it called them (`shardlab.comm.Ledger`). Nothing is
assumed about the layout: a strategy that padded differently, or gathered twice where the
formula says once, would show here. `shardlab.many_ranks.formulas` says what to expect.

The values are meaningless (the fake group moves nothing); the bytes are those of N real
ranks. Where N does not divide a parameter's rows, the ranks of a dim-0 split differ in
the rows that hold data, not in what they store: the course's FSDP2 pads every rank's
storage (and its optimizer states) to ⌈d0/N⌉ rows, so any rank measures the same.
"""

from __future__ import annotations

from shardlab.comm.ledger import Ledger
from shardlab.comm.links import per_link
from shardlab.many_ranks.fake import one_rank_of
from shardlab.many_ranks.formulas import ALL, RankBytes, ideal, predicted
from shardlab.models import build_model, get_batch
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.step import HeldAfterStep, train_step
from shardlab.strategy import get_strategy


def measure_one_rank(strategy: str, world: int, rank: int = 0, model: str = "gpt-tiny",
                     model_config: dict | None = None, options: dict | None = None,
                     seq_len: int = 16) -> RankBytes:
    """Rank `rank`'s model states after one optimizer step and the bytes it sent in that
    step (by link: "all" for a strategy with one group, "intra-node" and "inter-node"
    for HSDP's), fp32 AdamW, one row of `seq_len` tokens a rank. Any strategy of the
    registry that runs on the course's process groups (PyTorch's `fully_shard` too)."""
    built = build_model(model, 0, model_config)
    with one_rank_of(world, rank):
        wrapped = get_strategy(strategy)(built, get_precision("fp32"),
                                         optimizer_spec("adamw", 1e-3), dict(options or {}))
        watch = HeldAfterStep(wrapped)
        x, y = get_batch(0, rank, world, world, seq_len)
        with Ledger() as ledger:
            train_step(wrapped, [(x, y)], watch=watch)
    held = watch.held
    sent = {ALL if link == "unlabelled" else link: totals["sent_bytes"]
            for link, totals in per_link(ledger.records).items()}
    return RankBytes(held["params"], held["grads"], held["optimizer"], sent)


def sweep(strategies, worlds, model: str = "gpt-tiny", model_config: dict | None = None,
          options: dict[str, dict] | None = None, measure=None) -> list[dict]:
    """For each strategy and world size: the course's formula (`ideal`), the formula with
    the padding (`predicted`) and, for the world sizes in `measure` (all of `worlds` when
    None), one rank measured (`measure_one_rank`; None elsewhere). `options` maps a
    strategy to its options. The rows `figure.bytes_against_world` draws."""
    shapes = build_model(model, 0, model_config)
    measured_worlds = set(worlds if measure is None else measure)
    rows = []
    for strategy in strategies:
        opts = dict((options or {}).get(strategy, {}))
        for world in worlds:
            rows.append({
                "strategy": strategy, "world": world,
                "ideal": ideal(strategy, shapes, world, opts),
                "predicted": predicted(strategy, shapes, world, opts),
                "measured": (measure_one_rank(strategy, world, model=model,
                                              model_config=model_config, options=opts)
                             if world in measured_worlds else None)})
    return rows
