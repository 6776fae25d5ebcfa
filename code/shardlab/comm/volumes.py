"""The ZeRO paper's volumes and the α-β cost model of a ring, as functions.

Past one node there are two links, each with its own (α, β) (`Link`): a ring inside a
node runs on the fast one, a ring that spans nodes at the pace of its slowest hop, the
link between nodes. `fsdp_step_seconds` and `hsdp_step_seconds` put a sharded model's
collectives of one step on those links.

`volume_per_rank` is the analysis (bytes a rank sends per step, by strategy);
`predict_seconds` and `fit_alpha_beta` turn bytes into time and measured records into α
and β. They are formulas over records, apart from the code that takes the records, so a
chapter can use them on a machine where nothing runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from shardlab.cards import CARDS, card
from shardlab.comm.records import CollectiveRecord, ring_traffic


def volume_per_rank(strategy: str, psi: int, world: int, bytes_per_elem: int = 1) -> float:
    """Bytes one rank sends per training step in the ZeRO paper's analysis, on a ring.

    DDP all-reduces Ψ gradients: 2Ψ(N-1)/N. ZeRO-1 and ZeRO-2 reduce-scatter the gradients
    and all-gather the updated parameters: the same 2Ψ(N-1)/N. ZeRO-3 / FSDP all-gather
    the parameters twice (forward and backward) and reduce-scatter the gradients:
    3Ψ(N-1)/N. Multiply by `bytes_per_elem` for bytes (2 for bf16, 4 for fp32). The
    multiple of Ψ(N-1)/N is the strategy's card's `volume_factor`.
    """
    factor = card(strategy).volume_factor
    if factor is None:
        known = sorted(n for n, c in CARDS.items() if c.volume_factor is not None)
        raise ValueError(f"strategy {strategy!r} has no volume factor on its card; use one "
                         f"of {known} (HSDP's bytes by link: hsdp_volume_per_link)")
    if world < 1 or psi < 0:
        raise ValueError(f"need world >= 1 and psi >= 0, got world={world}, psi={psi}")
    return factor * psi * bytes_per_elem * (world - 1) / world


def hsdp_volume_per_link(psi: int, world: int, shard_group: int,
                         bytes_per_elem: int = 1) -> dict[str, float]:
    """Bytes one rank sends per training step under HSDP, by link, on rings.

    Inside its shard group of S ranks ("intra-node"), FSDP's schedule over S: all-gathers
    in forward and backward and a reduce-scatter, 3Ψ(S-1)/S. Across the R = N/S replicas
    ("inter-node"), one all-reduce of its reduced Ψ/S gradient shard, 2(R-1)/R·Ψ/S.
    S = N is FSDP (nothing crosses), S = 1 is DDP (an all-reduce of Ψ across).
    """
    if world < 1 or shard_group < 1 or world % shard_group:
        raise ValueError(f"shard_group must divide world, got shard_group={shard_group}, "
                         f"world={world}")
    replicas = world // shard_group
    size = psi * bytes_per_elem
    return {"intra-node": 3 * size * (shard_group - 1) / shard_group,
            "inter-node": 2 * size / shard_group * (replicas - 1) / replicas}


def predict_seconds(op: str, nbytes: int, world: int, alpha: float, beta: float) -> float:
    """α-β time of a ring collective over a tensor of `nbytes`:

        time = rounds x (α + bytes per round / β)

    α: the fixed cost of one round (latency, s); β: bandwidth (bytes/s).
    """
    _, _, rounds, round_bytes = ring_traffic(op, nbytes, world, 1)
    return rounds * (alpha + round_bytes / beta)


def fit_alpha_beta(records: Iterable[CollectiveRecord]) -> tuple[float, float]:
    """Least-squares (α, β) of `seconds ≈ α·rounds + rounds·round_bytes/β`.

    Rows are weighted by 1/seconds, so a 10 µs and a 10 ms collective count alike (the
    error that matters is relative).
    """
    rows = [r for r in records if r.rounds > 0 and r.seconds > 0]
    if len(rows) < 2:
        raise ValueError("fit_alpha_beta needs at least two timed ring collectives "
                         "(world >= 2) of different sizes")
    x = torch.tensor([[r.rounds, r.rounds * r.round_bytes] for r in rows], dtype=torch.float64,
                     device="cpu")
    y = torch.tensor([r.seconds for r in rows], dtype=torch.float64, device="cpu")
    w = 1.0 / y
    solution = torch.linalg.lstsq(x * w[:, None], (y * w)[:, None]).solution.flatten()
    alpha, inverse_beta = float(solution[0]), float(solution[1])
    return max(alpha, 0.0), (1.0 / inverse_beta if inverse_beta > 0 else math.inf)


@dataclass(frozen=True)
class Link:
    """One link of the α-β model: α seconds per ring round, β bytes per second."""

    alpha: float
    beta: float

    def slowed(self, factor: float) -> "Link":
        """This link `factor` times slower in both terms (the simulated inter-node link of
        the chapter: `factor` x α, β / `factor`)."""
        return Link(self.alpha * factor, self.beta / factor)


def fsdp_step_seconds(unit_bytes: Iterable[int], world: int, link: Link) -> float:
    """α-β time of FSDP's collectives in one step, on rings of `world` ranks over `link`:
    per unit, an all-gather in forward and one in backward and a reduce-scatter, each over
    the unit's `unit_bytes` (the full, padded unit). A ring that spans nodes runs at the
    pace of its hop between nodes: pass the inter-node link then."""
    return sum(2 * predict_seconds("all_gather", b, world, link.alpha, link.beta)
               + predict_seconds("reduce_scatter", b, world, link.alpha, link.beta)
               for b in unit_bytes)


def hsdp_step_seconds(unit_bytes: Iterable[int], world: int, shard_group: int,
                      intra: Link, inter: Link) -> dict[str, float]:
    """α-β time of HSDP's collectives in one step, by link: FSDP's over the S ranks of a
    shard group on `intra`; per unit, one all-reduce of its 1/S shard over the R = N/S
    replicas on `inter`."""
    unit_bytes = list(unit_bytes)
    if world < 1 or shard_group < 1 or world % shard_group:
        raise ValueError(f"shard_group must divide world, got shard_group={shard_group}, "
                         f"world={world}")
    replicas = world // shard_group
    return {"intra-node": fsdp_step_seconds(unit_bytes, shard_group, intra),
            "inter-node": sum(predict_seconds("all_reduce", b // shard_group, replicas,
                                              inter.alpha, inter.beta)
                              for b in unit_bytes)}
