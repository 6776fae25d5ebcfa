"""How a step's cost grows past one machine: a strategy's step on N GPUs in nodes.

The step-time model (`shardlab.steptime`) driven with the course's GPU figures in place
of a measured machine:

    compute      6ΨT / (m · peak): the H100's bf16 datasheet peak (`shardlab.hardware`)
                 times an MFU m the caller states (an assumption: the course has measured
                 no cluster's)
    collectives  each collective the strategy plans (`plans.planned_collectives`),
                 priced on GPUs in nodes (`network.collective_seconds_on_cluster`): a ring
                 inside one node runs on NVLink; across nodes it takes the longer of its
                 NVLink hops and the node's bytes over its NICs; each round pays α
    exposed      the strategy's schedule, from its card (`steptime.predict_step`), with
                 the hiding η the caller states (1 is the bound where overlapped
                 communication costs the compute nothing); each collective costs inside
                 a step what it costs alone (no GPU run has measured what a step adds)

HSDP (`hybrid_step`) shards inside a node and replicates across: PyTorch's FSDP2 schedule
over the node's S GPUs, on NVLink, and per unit an all-reduce of its 1/S gradient shard
over the R = N/S replicas, one GPU per node, every GPU on a NIC of its own. FSDP2 runs
those on a stream of their own, each launched once its unit's reduce-scatter is done and
waited for when backward ends (`comm.hsdp_overlap` names the source): a second lane beside
the node's, and the only bytes that cross nodes.

`crossover_tokens` finds the tokens per GPU from which compute hides all that a schedule
lets it hide: the exposed communication at its floor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from torch import nn

from shardlab import network
from shardlab.hardware import NCCL_ALPHA
from shardlab.network import H100_NODES, Cluster
from shardlab.steptime import (Collective, Machine, StepPrediction, exposed_seconds,
                               gpu_machine, predict_step)

# The GPU counts the chapter drives a model to: one node, then whole nodes.
GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
# The schedule HSDP runs inside a node: PyTorch's fully_shard on a 2-D mesh is its FSDP2.
IN_NODE_SCHEDULE = "torch-fsdp2"


@dataclass(frozen=True)
class OnCluster:
    """Prices one collective on a cluster of nodes (a `Machine`'s `network`): the ring of
    `network.collective_seconds_on_cluster`, `alpha` seconds per round."""

    cluster: Cluster = H100_NODES
    alpha: float = NCCL_ALPHA

    def __call__(self, op: str, nbytes: float, world: int,
                 ranks_per_node: int | None = None) -> float:
        return network.collective_seconds_on_cluster(op, nbytes, world, self.cluster,
                                                     ranks_per_node, alpha=self.alpha)


def cluster_machine(cluster: Cluster = H100_NODES, *, mfu: float, hiding: float,
                    alpha: float = NCCL_ALPHA) -> Machine:
    """A GPU of `cluster` as the step-time model sees it: compute at `mfu` of its peak,
    collectives on the cluster's links. `mfu` and `hiding` are assumptions the
    caller states (no GPU run of the course has measured them at scale)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a share of the datasheet peak, in (0, 1]; got {mfu!r}")
    machine = gpu_machine(mfu * cluster.flops, alpha, cluster.intra_bps, hiding=hiding)
    return replace(machine, network=OnCluster(cluster, alpha))


@dataclass
class ClusterStep:
    """One strategy's step on `gpus` GPUs: the prediction (its compute, collectives and
    exposed seconds) and the bytes that one node sends to the others in it."""

    gpus: int
    prediction: StepPrediction
    leaving_node: float

    @property
    def step_seconds(self) -> float:
        return self.prediction.step_seconds

    @property
    def exposed_seconds(self) -> float:
        return self.prediction.exposed_seconds

    @property
    def efficiency(self) -> float:
        """Compute over the step: each GPU's share of the work it would do were
        communication free (1 where all of it hides)."""
        return self.prediction.compute_seconds / self.prediction.step_seconds


def _on_cluster(machine: Machine) -> OnCluster:
    if not isinstance(machine.network, OnCluster):
        raise ValueError("the machine prices no cluster: build it with "
                         "scaling.cluster_machine(cluster, mfu=..., hiding=...)")
    return machine.network


def _check(gpus: int, tokens: int, cluster: Cluster) -> None:
    per_node = cluster.gpus_per_node
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1 \
            or (gpus > per_node and gpus % per_node):
        raise ValueError(f"gpus must be a whole number of GPUs inside one node (1 to "
                         f"{per_node}) or of whole nodes (a multiple of {per_node}), "
                         f"got {gpus!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens (per GPU and step) must be a whole number >= 1, "
                         f"got {tokens!r}")


def one_group_step(strategy: str, model: nn.Module, gpus: int, tokens: int,
                   machine: Machine, options: dict | None = None,
                   bytes_per_elem: int = 2) -> ClusterStep:
    """`strategy` over all `gpus` GPUs as one group (DDP, ZeRO-1/2/3, FSDP2): every ring
    spans every node, and each leaves a node once (`network.bytes_leaving_node`)."""
    cluster = _on_cluster(machine).cluster
    _check(gpus, tokens, cluster)
    step = predict_step(strategy, model, gpus, options, machine, tokens=tokens,
                        bytes_per_elem=bytes_per_elem)
    leaving = sum(network.bytes_leaving_node(c.op, c.nbytes, gpus, cluster)
                  for c in step.collectives)
    return ClusterStep(gpus, step, leaving)


def hybrid_step(model: nn.Module, gpus: int, tokens: int, machine: Machine,
                options: dict | None = None, bytes_per_elem: int = 2) -> ClusterStep:
    """HSDP on `gpus` GPUs, each node's S GPUs a shard group (S = the node, or all the
    GPUs where there are fewer), the R = N/S GPUs that hold one shard a replicate group.

    Inside the node, FSDP2's step over S (`IN_NODE_SCHEDULE`). Across, per unit, an
    all-reduce of its gradient shard, launched as its reduce-scatter ends, on a lane of
    its own: the backward's tail is then the later of the node's (its reduce-scatters
    past backward, `exposed_seconds`) and the replicas' (theirs past backward, and at
    least the last all-reduce after the last reduce-scatter)."""
    pricing = _on_cluster(machine)
    _check(gpus, tokens, pricing.cluster)
    shard = min(gpus, pricing.cluster.gpus_per_node)
    replicas = gpus // shard
    step = predict_step(IN_NODE_SCHEDULE, model, shard, options, machine, tokens=tokens,
                        bytes_per_elem=bytes_per_elem)
    if replicas == 1:
        return ClusterStep(gpus, replace(step, strategy="hsdp", world=gpus), 0.0)
    scatters = [c for c in step.collectives if c.op == "reduce_scatter"]
    shards = [Collective("all_reduce", c.nbytes // shard, "backward", "produced",
                         pricing("all_reduce", c.nbytes / shard, replicas,
                                 ranks_per_node=1))
              for c in scatters]
    backward = step.compute["backward"]
    node_tail = exposed_seconds(scatters, backward, machine.hiding)
    replica_tail = max(node_tail + shards[-1].seconds,
                       exposed_seconds(shards, backward, machine.hiding))
    exposed = {**step.exposed, "backward": step.exposed["backward"] - node_tail
               + max(node_tail, replica_tail)}
    leaving = sum(network.bytes_leaving_node("all_reduce", c.nbytes / shard, replicas,
                                             pricing.cluster, ranks_per_node=1)
                  for c in scatters)
    return ClusterStep(gpus, StepPrediction("hsdp", gpus, tokens, step.compute, exposed,
                                            step.collectives + shards, machine.hiding),
                       leaving)


Step = Callable[..., ClusterStep]  # (model, gpus, tokens, machine, options) -> ClusterStep

# The six ways the chapter compares, by the names it draws them with: each a schedule of
# a card (`shardlab.cards`), ZeRO-3 as the course's `zero3` runs it (each gather waited
# for), FSDP2 as PyTorch's `fully_shard` does (backward's next gather prefetched).
STRATEGIES: dict[str, Step] = {
    "DDP": partial(one_group_step, "ddp"),
    "ZeRO-1": partial(one_group_step, "zero1"),
    "ZeRO-2": partial(one_group_step, "zero2"),
    "ZeRO-3": partial(one_group_step, "zero3"),
    "FSDP2": partial(one_group_step, "torch-fsdp2"),
    "HSDP": hybrid_step,
}


def crossover_tokens(step: Step, model: nn.Module, gpus: int, machine: Machine,
                     options: dict | None = None, most: int = 10**8) -> int:
    """The fewest tokens per GPU at which the step's exposed communication is at its
    floor: what the schedule never hides (DDP's last bucket, each waited gather), all of
    the rest hidden behind compute. Exposed time falls as tokens grow (compute grows, the
    bytes do not), so a bisection finds it; `most` tokens is taken to be past it."""
    def exposed(tokens):
        return step(model, gpus, tokens, machine, options).exposed_seconds

    floor = exposed(most) * (1 + 1e-12)
    if exposed(1) <= floor:
        return 1
    low, high = 1, most  # exposed(low) above the floor, exposed(high) at it
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if exposed(middle) <= floor else (middle, high)
    return high
