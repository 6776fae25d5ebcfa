"""HSDP, hybrid sharding: shard within a group of S ranks, replicate across the N/S groups.

Past one node, FSDP over all N ranks sends every all-gather and every reduce-scatter
over the slow links between nodes. HSDP puts the S ranks of one node in a *shard group*
and the N/S = R ranks that hold the same shard (one per node) in a *replicate group*:

    ranks 0..N-1, S = 2, N = 4:   shard groups  [0, 1] [2, 3]     (inside a node)
                                  replicate     [0, 2] [1, 3]     (across nodes)

Each shard group runs FSDP2's schedule on its own (all-gather before forward and
backward, reduce-scatter the gradients: 3Ψ(S-1)/S per rank and step, inside the node);
then each rank all-reduces its reduced gradient shard (Ψ/S elements) with its replicate
group: 2(R-1)/R·Ψ/S per rank and step, the only bytes that cross nodes. Model states per
rank are those of FSDP over S ranks: (2 + 2 + K)Ψ/S in place of /N.

`hsdp` is the course's `fully_shard` given both groups (`shardlab.fsdp`); `torch-hsdp`
is PyTorch's `fully_shard` on a 2-D `DeviceMesh` of shape (R, S), dims named
("replicate", "shard"). Both label their groups' links ("intra-node", "inter-node",
`shardlab.comm.links`) so that the ledger splits the bytes by link. Option
`shard_group` = S, a divisor of the world size, besides FSDP2's options.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from shardlab.comm.links import INTER, INTRA, label_link
from shardlab.fsdp.strategies import (FSDP2_OPTIONS, check_fsdp2_options, fully_shard_on,
                                      torch_fully_shard_on)
from shardlab.launch.devices import rank_device
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import Precision
from shardlab.strategy import Wrapped, check_options

HSDP_OPTIONS = {**FSDP2_OPTIONS, "shard_group": None}


def check_shard_group(strategy: str, options: dict, world: int) -> dict:
    """The options merged with their defaults, or a one-line refusal: S must be a whole
    number >= 1 that divides the world size (every group holds S ranks); FSDP2's options
    are checked over the S ranks of a shard group, with N/S replicas."""
    options = check_options(strategy, options, HSDP_OPTIONS)
    size = options["shard_group"]
    if size is None:
        raise ValueError(f"strategy {strategy!r} needs option shard_group=S, the ranks that "
                         f"share the shards (e.g. the GPUs of a node): a divisor of the "
                         f"world size {world}, e.g. options={{'shard_group': "
                         f"{_a_divisor(world)}}}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"strategy {strategy!r}: shard_group must be a whole number >= 1 "
                         f"that divides the world size {world}, got {size!r}; use one of "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}")
    fsdp2 = {k: v for k, v in options.items() if k != "shard_group"}
    return {**check_fsdp2_options(strategy, fsdp2, size, world // size), "shard_group": size}


def _a_divisor(world: int) -> int:
    return next((d for d in range(2, world) if world % d == 0), world)


def check_options_before_launch(strategy: str, options: dict, world: int) -> None:
    """The cards' `launch_check` of `hsdp` and `torch-hsdp`: called by
    `shardlab.config.TrainConfig.validate`, before any process starts."""
    check_shard_group(strategy, options, world)


def hsdp_rank_lists(world: int, shard_group: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups) as lists of ranks: consecutive ranks share shards
    (a launcher numbers a node's ranks consecutively), every S-th rank is a replica."""
    shard = [list(range(g * shard_group, (g + 1) * shard_group))
             for g in range(world // shard_group)]
    replicate = [list(range(r, world, shard_group)) for r in range(shard_group)]
    return shard, replicate


def hsdp_groups(shard_group: int):
    """This rank's (shard group, replicate group), each labelled with the link it crosses.
    Every rank creates every group, in the same order, as `dist.new_group` requires."""
    shard_lists, replicate_lists = hsdp_rank_lists(dist.get_world_size(), shard_group)
    shard, _ = dist.new_subgroups_by_enumeration(shard_lists)
    replicate, _ = dist.new_subgroups_by_enumeration(replicate_lists)
    label_link(shard, INTRA)
    label_link(replicate, INTER)
    return shard, replicate


def wrap_hsdp(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
              options: dict) -> Wrapped:
    """Ours: the course's `fully_shard` over the shard group, each reduced gradient shard
    all-reduced over the replicate group. options: shard_group (S), and FSDP2's."""
    options = check_shard_group("hsdp", options, dist.get_world_size())
    size = options.pop("shard_group")
    shard, replicate = hsdp_groups(size)
    # one replica (S = N) is FSDP: no all-reduce of a group of one
    return fully_shard_on(model, precision, optimizer, options, group=shard,
                          replicate_group=replicate if dist.get_world_size() > size else None)


def wrap_torch_hsdp(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                    options: dict) -> Wrapped:
    """The reference: PyTorch's `fully_shard` on a 2-D mesh (R, S) named ("replicate",
    "shard"), the same options mapped to PyTorch's policies."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    options = check_shard_group("torch-hsdp", options, world)
    size = options.pop("shard_group")
    mesh = init_device_mesh(rank_device().type, (world // size, size),
                            mesh_dim_names=("replicate", "shard"))
    label_link(mesh.get_group("shard"), INTRA)
    label_link(mesh.get_group("replicate"), INTER)
    return torch_fully_shard_on(mesh, model, precision, optimizer, options)
