"""The ZeRO paper's volumes and the α-β cost model of a ring, as functions.

Past one node there are two links, each with its own (α, β) (`Link`): a ring inside a
node runs on the fast one, a ring that spans nodes at the pace of its slowest hop, the
link between nodes. `fsdp_step_seconds` and `hsdp_step_seconds` put a sharded model's
collectives of one step on those links; `hsdp_overlap` lays HSDP's on two lanes, as
PyTorch's FSDP2 runs them on a GPU.

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


@dataclass(frozen=True)
class HsdpSeconds:
    """One step of HSDP's collectives: the seconds each link is busy, and the step's
    communication with the replicas' all-reduces overlapped as FSDP2 runs them.

    `serial` is `intra_node + inter_node`: a run whose all-reduce blocks until it is done
    before the next collective starts, as the course's `hsdp` and PyTorch's FSDP2 do on a
    CPU (there `dist.all_reduce` returns when it has finished; the streams are no-ops).
    `overlapped` is PyTorch's FSDP2 on GPUs (`hsdp_overlap`)."""

    intra_node: float
    inter_node: float
    overlapped: float

    @property
    def serial(self) -> float:
        return self.intra_node + self.inter_node


def hsdp_overlap(forward_gathers: Iterable[float],
                 backward: Iterable[tuple[float, float, float]]) -> float:
    """Seconds of one step's HSDP collectives as PyTorch's FSDP2 runs them on a GPU.

    FSDP2 launches each unit's all-reduce across the replicas on a stream of its own
    (`FSDPCommContext.all_reduce_stream`, "Run the HSDP all-reduces concurrently with
    all-gather/reduce-scatter since collectives use different network resources",
    `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`): it waits for that unit's
    reduce-scatter (`foreach_reduce` in `_fsdp_collectives.py`: `all_reduce_stream.
    wait_stream(reduce_scatter_stream)`), and nothing in the node waits for it until
    backward ends (`finalize_backward` waits for the last one, before the optimizer
    step). Two lanes, then: the in-node one runs the forward's gathers, then in backward
    each unit's gather and reduce-scatter, the next unit's gather prefetched before this
    one's reduce-scatter (FSDP2's default backward prefetch); the replica lane runs each
    unit's all-reduce once that unit's reduce-scatter and the previous all-reduce are
    done. The step's communication ends with the later lane.

    `forward_gathers`: the seconds of each unit's forward all-gather; `backward`: per
    unit in backward order, (all-gather, reduce-scatter, all-reduce) seconds. Bandwidth
    of each lane alone; contention between the lanes (SMs, memory) is left out."""
    backward = list(backward)
    in_node = sum(forward_gathers)
    if not backward:
        return in_node
    in_node += backward[0][0]               # the first unit's gather
    replicas_done = in_node
    for i, (_, reduce_scatter, all_reduce) in enumerate(backward):
        if i + 1 < len(backward):
            in_node += backward[i + 1][0]   # the next unit's gather, prefetched
        in_node += reduce_scatter
        replicas_done = max(replicas_done, in_node) + all_reduce
    return max(in_node, replicas_done)


def hsdp_step_seconds(unit_bytes: Iterable[int], world: int, shard_group: int,
                      intra: Link, inter: Link) -> HsdpSeconds:
    """α-β time of HSDP's collectives in one step: FSDP's over the S ranks of a shard
    group on `intra` (per unit, an all-gather in forward and one in backward and a
    reduce-scatter); per unit, one all-reduce of its 1/S shard over the R = N/S replicas
    on `inter`. `unit_bytes` in backward order (the order of the ledger's reduce-scatters,
    `report.unit_sizes`)."""
    unit_bytes = list(unit_bytes)
    if world < 1 or shard_group < 1 or world % shard_group:
        raise ValueError(f"shard_group must divide world, got shard_group={shard_group}, "
                         f"world={world}")
    replicas = world // shard_group

    def on(link: Link, op: str, nbytes: int, ranks: int) -> float:
        return predict_seconds(op, nbytes, ranks, link.alpha, link.beta)

    gathers = [on(intra, "all_gather", b, shard_group) for b in unit_bytes]
    scatters = [on(intra, "reduce_scatter", b, shard_group) for b in unit_bytes]
    reduces = [on(inter, "all_reduce", b // shard_group, replicas) for b in unit_bytes]
    return HsdpSeconds(intra_node=2 * sum(gathers) + sum(scatters),
                       inter_node=sum(reduces),
                       overlapped=hsdp_overlap(gathers, zip(gathers, scatters, reduces)))


# ----------------------------------------------------------------------------- accumulation


def sharded_collectives_per_step(micro_batches: int, reshard_after_forward: bool = True,
                                 reshard_after_backward: bool = True,
                                 accumulate: str = "no_sync") -> dict[str, int]:
    """How many times, in one optimizer step of M micro-batches, FSDP2 all-gathers the
    whole model, reduce-scatters its gradients and (HSDP) all-reduces them across replicas,
    under its knobs (`shardlab.fsdp.strategies`; the micro-batches before the last run
    with `reshard_after_backward` and `accumulate`, the last with every knob on):

        all-gathers      2M with reshard after forward (forward and backward), M without,
                         less M-1 without reshard after backward (the next forward finds
                         the parameters gathered)
        reduce-scatters  1 under "no_sync" (the last micro-batch), M otherwise
        all-reduces      M under "sync", 1 otherwise (HSDP: "no_all_reduce" sums the
                         reduced shards and all-reduces them once)
    """
    m = micro_batches
    if m < 1:
        raise ValueError(f"micro_batches must be >= 1, got {m}")
    if accumulate not in ("no_sync", "sync", "no_all_reduce"):
        raise ValueError(f"accumulate must be 'no_sync', 'sync' or 'no_all_reduce', got "
                         f"{accumulate!r}")
    gathers = (2 * m if reshard_after_forward else m) - (0 if reshard_after_backward else m - 1)
    return {"all_gather": gathers,
            "reduce_scatter": 1 if accumulate == "no_sync" else m,
            "all_reduce": m if accumulate == "sync" else 1}


def fsdp_accumulation_volume(psi: int, world: int, micro_batches: int,
                             bytes_per_elem: float = 1, *, shard_group: int | None = None,
                             **knobs) -> float:
    """Bytes one rank sends in one optimizer step of M micro-batches under FSDP2's knobs
    (`sharded_collectives_per_step`), on rings: each all-gather and reduce-scatter moves
    Ψ(S-1)/S over the S ranks of the shard group (S = N without HSDP), each all-reduce of
    a gradient shard 2(R-1)/R·Ψ/S across the R = N/S replicas."""
    size = world if shard_group is None else shard_group
    if world % size:
        raise ValueError(f"shard_group must divide world, got {size} and {world}")
    counts = sharded_collectives_per_step(micro_batches, **knobs)
    replicas = world // size
    ring = psi * bytes_per_elem * (size - 1) / size
    across = 2 * psi * bytes_per_elem / size * (replicas - 1) / replicas
    return (counts["all_gather"] + counts["reduce_scatter"]) * ring \
        + counts["all_reduce"] * across


def data_parallel_accumulation_volume(strategy: str, psi: int, world: int,
                                      micro_batches: int, bytes_per_elem: float = 1) -> float:
    """Bytes one rank sends in one optimizer step of M micro-batches, on rings, for DDP
    under `no_sync` (one all-reduce, 2Ψ(N-1)/N), ZeRO-1 (its reduce-scatter and all-gather
    both in the step: 2Ψ(N-1)/N) and ZeRO-2 (a reduce-scatter each micro-batch, as its
    backward produces the gradients, and one all-gather: (M+1)Ψ(N-1)/N)."""
    ring = psi * bytes_per_elem * (world - 1) / world
    factors = {"ddp": 2, "zero1": 2, "zero2": micro_batches + 1}
    if strategy not in factors:
        raise ValueError(f"strategy must be one of {list(factors)}, got {strategy!r} (FSDP2's "
                         f"ways: fsdp_accumulation_volume)")
    return factors[strategy] * ring


# ----------------------------------------------------------------------------- ZeRO++


def zeropp_volume_per_link(psi: int, world: int, node_size: int, bytes_per_elem: float = 2,
                           *, qwz: bool = True, hpz: bool = True, qgz: bool = True,
                           reduce_bytes: float | None = None) -> dict[str, float]:
    """Bytes one rank sends per step under ZeRO++ {qwZ, hpZ, qgZ} (the paper's analysis,
    Wang et al. 2023, section 4), by link, on N ranks in nodes of k: the weights are
    gathered over all N ranks, a group that spans the nodes ("inter-node" once there are
    two), in `bytes_per_elem` (the paper's fp16: 2) or int8 under qwZ (1); backward gathers
    them again there, or inside the node under hpZ; the gradients are reduce-scattered
    over all N in `reduce_bytes` (default: `bytes_per_elem`), or under qgZ in int4 (1/2 a
    byte) by an all-to-all inside the node, (k-1)/k·Ψ, then one across nodes, (R-1)/R·Ψ/k.
    Left out: the scales, 4 bytes per block (0.2% of int8's bytes at 2048 elements a
    block, 0.4% of int4's)."""
    if node_size < 1 or world % node_size:
        raise ValueError(f"node_size must divide world, got {node_size} and {world}")
    k, nodes = node_size, world // node_size
    reduce_bytes = bytes_per_elem if reduce_bytes is None else reduce_bytes
    across = "inter-node" if nodes > 1 else "intra-node"
    weight = 1 if qwz else bytes_per_elem
    ring_all, ring_node = psi * (world - 1) / world, psi * (k - 1) / k
    out = {"intra-node": 0.0, "inter-node": 0.0}
    out[across] += ring_all * weight                       # forward all-gather
    if hpz:
        out["intra-node"] += ring_node * weight           # backward, inside the node
    else:
        out[across] += ring_all * weight
    if qgz:
        out["intra-node"] += ring_node * 0.5              # hop 1: all-to-all in the node
        out["inter-node"] += psi / k * (nodes - 1) / nodes * 0.5   # hop 2: across
    else:
        out[across] += ring_all * reduce_bytes
    return out


def zeropp_bytes_leaving_node(psi: int, world: int, node_size: int,
                              bytes_per_elem: float = 2, *, qwz: bool = True,
                              hpz: bool = True, qgz: bool = True,
                              reduce_bytes: float | None = None) -> float:
    """Bytes that leave one node per step, the paper's count (its Table 1: ZeRO-3's 3M
    against ZeRO++'s 0.75M, M the model's fp16 bytes, as N grows). A ring over all N ranks
    numbered node by node leaves each node once: one rank's ring bytes, (N-1)/N of the
    tensor. qgZ's second hop leaves from every rank of the node: k × (R-1)/R·Ψ/k in int4.
    So M(N-1)/N each for the gathers in int8 (/2) and bf16, and (R-1)/R·M/4 for qgZ."""
    per_rank = zeropp_volume_per_link(psi, world, node_size, bytes_per_elem, qwz=qwz,
                                      hpz=hpz, qgz=qgz, reduce_bytes=reduce_bytes)
    if world == node_size:
        return 0.0
    hop2 = psi / node_size * (world // node_size - 1) / (world // node_size) * 0.5
    if not qgz:
        return per_rank["inter-node"]
    return per_rank["inter-node"] - hop2 + node_size * hop2
