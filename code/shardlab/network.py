"""How long a ring collective takes on GPUs grouped in nodes, and how many tokens per GPU
hide it: the one communication model the chapters' GPU arithmetic uses.

A node holds `gpus_per_node` GPUs joined by NVLink (each GPU `intra_bps` each way) and
`nics_per_node` NICs of `nic_bps` each to the other nodes. NCCL orders a ring's ranks node
by node, so of a node's ring hops all but one stay on NVLink, and the one that leaves it
carries what every hop carries: the (N - 1)/N of the tensor (twice that for an all-reduce)
that each rank sends. A node's cross-node bytes are therefore about one GPU's ring
traffic, and NCCL spreads them over the node's NICs (a ring per NIC). When the node holds
one rank of a group (HSDP's replicas, a tensor-parallel group across nodes), each of its
GPUs is in a group of its own and all of them leave the node at once: one NIC per GPU.

    ring bytes      r = f (N - 1)/N · nbytes        (f = 2 for an all-reduce, else 1)
    leaving a node  (G/p) · r                        (p ranks of the group per node)
    time            max(r / intra, (G/p) · r / (nics · nic))   over more than one node

The α term is left out unless given: for the large collectives this arithmetic is about,
bandwidth dominates (chapter 1's problems weigh the two). Each link has its own α when
given (`alpha_intra`, `alpha_inter`): a ring across nodes pays the slower one per round.

FSDP over all GPUs and HSDP (shard inside a node, replicate across) are two ways to put
one step's collectives on those two links (`fsdp_collectives_seconds`,
`hsdp_collectives_seconds`): FSDP's rings cross nodes through every NIC of the node at
once, but only as long as its slowest hop; HSDP runs its gathers and reduce-scatters on
NVLink and all-reduces each unit's 1/S shard with one NIC per GPU, on a stream of its own
beside the next units' NVLink collectives, as PyTorch's FSDP2 runs it
(`comm.hsdp_overlap`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

from shardlab import hardware
from shardlab.comm.volumes import HsdpSeconds, hsdp_overlap

# bytes each rank sends on a ring, as a multiple of (N - 1)/N of the full tensor
RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


@dataclass(frozen=True)
class Cluster:
    """GPUs in nodes: the links the model needs, each rate per direction."""

    gpus_per_node: int
    intra_bps: float     # one GPU to the rest of its node (NVLink)
    nic_bps: float       # one NIC
    nics_per_node: int
    flops: float         # one GPU's peak, for the tokens that hide a collective

    @property
    def node_egress_bps(self) -> float:
        """What can leave a node at once: every NIC together."""
        return self.nic_bps * self.nics_per_node


# An HGX/DGX H100 node: 8 GPUs on NVSwitch, eight 400 Gb/s NICs (400 GB/s leave a node).
H100_NODES = Cluster(gpus_per_node=hardware.GPUS_PER_NODE, intra_bps=hardware.NVLINK,
                     nic_bps=hardware.NIC, nics_per_node=hardware.NICS_PER_NODE,
                     flops=hardware.H100_BF16_FLOPS)


def _check(op: str, world: int, cluster: Cluster, ranks_per_node: int | None) -> int:
    if op not in RING_FACTOR:
        raise ValueError(f"op must be one of {sorted(RING_FACTOR)}, got {op!r}")
    if world < 1 or int(world) != world:
        raise ValueError(f"world must be a positive integer, got {world!r}")
    p = min(world, cluster.gpus_per_node) if ranks_per_node is None else ranks_per_node
    if not 1 <= p <= min(world, cluster.gpus_per_node) or cluster.gpus_per_node % p:
        raise ValueError(f"ranks_per_node must divide gpus_per_node="
                         f"{cluster.gpus_per_node} and be at most world={world}, got {p}")
    return p


def ring_bytes(op: str, nbytes: float, world: int) -> float:
    """Bytes each rank sends in a ring collective over a tensor of `nbytes` (the whole
    tensor: the all-gather's output, the reduce-scatter's and all-reduce's input)."""
    return RING_FACTOR[op] * (world - 1) / world * nbytes


def bytes_leaving_node(op: str, nbytes: float, world: int, cluster: Cluster = H100_NODES,
                       ranks_per_node: int | None = None) -> float:
    """Bytes that leave one node while every GPU of it runs its group's collective.

    `ranks_per_node` (p) is how many ranks of one group share a node: all of the node's
    GPUs (the default, as far as `world` allows) for data parallelism over the whole job,
    1 for a group with one rank per node. The node runs G/p such groups at once; each
    group's ring leaves the node once.
    """
    p = _check(op, world, cluster, ranks_per_node)
    if math.ceil(world / p) == 1:
        return 0.0
    return cluster.gpus_per_node / p * ring_bytes(op, nbytes, world)


def collective_seconds_on_cluster(op: str, nbytes: float, world: int,
                                  cluster: Cluster = H100_NODES,
                                  ranks_per_node: int | None = None,
                                  alpha: float = 0.0) -> float:
    """Time of a ring collective over a tensor of `nbytes` on `world` GPUs.

    Inside one node the ring runs on NVLink. Across nodes it takes the longer of its
    NVLink hops and the node's cross-node bytes over every NIC of the node. With `alpha`
    each of the ring's rounds also pays a fixed latency.
    """
    p = _check(op, world, cluster, ranks_per_node)
    sent = ring_bytes(op, nbytes, world)
    latency = alpha * RING_FACTOR[op] * (world - 1)
    inside = sent / cluster.intra_bps if p > 1 else 0.0
    if math.ceil(world / p) == 1:
        return latency + inside
    across = bytes_leaving_node(op, nbytes, world, cluster, p) / cluster.node_egress_bps
    return latency + max(inside, across)


def fsdp_collectives_seconds(nbytes: float, world: int, cluster: Cluster = H100_NODES,
                             alpha_intra: float = 0.0, alpha_inter: float = 0.0,
                             units: int = 1) -> float:
    """One step of FSDP over all `world` GPUs, its model of `nbytes` in `units` equal
    units: two all-gathers and a reduce-scatter of each, each a ring over every GPU
    (across nodes once `world` is more than a node: the α of each round is then the link
    between nodes'). The units change only the latency: each pays its rounds."""
    _check_units(units)
    alpha = alpha_inter if world > cluster.gpus_per_node else alpha_intra
    return 3 * units * collective_seconds_on_cluster("all_gather", nbytes / units, world,
                                                     cluster, alpha=alpha)


def _check_units(units) -> None:
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise ValueError(f"units must be a whole number >= 1 (the FSDP units: e.g. one "
                         f"per layer and the root), got {units!r}")


def hsdp_collectives_seconds(nbytes: float, world: int, shard_group: int,
                             cluster: Cluster = H100_NODES, alpha_intra: float = 0.0,
                             alpha_inter: float = 0.0, *, units: int) -> HsdpSeconds:
    """One step of HSDP, its model of `nbytes` in `units` equal units: FSDP's three
    collectives of each unit inside a shard group of S GPUs of one node (NVLink), and per
    unit an all-reduce of its Ψ/S gradient shard over the R = N/S replicas, one GPU per
    node, every GPU of the node at once (one NIC each).

    `intra_node` and `inter_node` are each link's busy time; `overlapped` the step's
    communication as PyTorch's FSDP2 runs it, each unit's all-reduce on its own stream
    beside the next units' NVLink collectives (`comm.hsdp_overlap`); `serial` one after
    the other."""
    if not 1 <= shard_group <= cluster.gpus_per_node or world % shard_group \
            or cluster.gpus_per_node % shard_group:
        raise ValueError(f"shard_group must divide world={world} and "
                         f"gpus_per_node={cluster.gpus_per_node}, got {shard_group!r}")
    _check_units(units)
    replicas = world // shard_group
    unit = nbytes / units
    gather = collective_seconds_on_cluster("all_gather", unit, shard_group, cluster,
                                           alpha=alpha_intra)
    reduce = 0.0
    if replicas > 1:
        reduce = collective_seconds_on_cluster("all_reduce", unit / shard_group, replicas,
                                               cluster, ranks_per_node=1, alpha=alpha_inter)
    # a reduce-scatter moves what an all-gather does, over the same ring
    return HsdpSeconds(intra_node=3 * units * gather, inter_node=units * reduce,
                       overlapped=hsdp_overlap([gather] * units,
                                               [(gather, gather, reduce)] * units))


def tokens_to_hide(op: str, world: int, cluster: Cluster = H100_NODES,
                   bytes_per_param: float = 2, flops_per_token: float = 4,
                   collectives: float = 1, flops: float | None = None,
                   ranks_per_node: int | None = None) -> float:
    """Tokens per GPU at which `collectives` collectives over Ψ parameters of
    `bytes_per_param` bytes take no longer than the compute they hide behind,
    `flops_per_token`·Ψ FLOPs per token (4 for a backward, 2 for a forward, 6 for a step)
    at `flops` FLOP/s (the cluster's peak unless given). Ψ cancels:

        T* = collectives · t(collective of b bytes) · F / c

    DDP's gradient all-reduce behind backward: ("all_reduce", c=4); a ZeRO-3/FSDP layer's
    gather behind its forward: ("all_gather", c=2), the same threshold.
    """
    per_param = collective_seconds_on_cluster(op, bytes_per_param, world, cluster,
                                              ranks_per_node)
    return collectives * per_param * (cluster.flops if flops is None else flops) \
        / flops_per_token


def ring_walk_leaving(ring: Iterable[int], node_of: Callable[[int], int],
                      per_hop: float) -> dict[int, float]:
    """Bytes leaving each node on one ring (ranks in ring order), `per_hop` bytes per hop,
    counted hop by hop: the check of `bytes_leaving_node`'s closed form."""
    ring = list(ring)
    out: dict[int, float] = {}
    for a, b in zip(ring, ring[1:] + ring[:1]):
        if node_of(a) != node_of(b):
            out[node_of(a)] = out.get(node_of(a), 0.0) + per_hop
    return out
