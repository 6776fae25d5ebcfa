"""The strategy `zeropp`: ZeRO-3 in FSDP2's layout with ZeRO++'s three changes, each an
option of its own.

    qwz   the all-gathers of the weights in int8, a scale per `weight_block` elements
          (`QuantizedAllGather`, as `set_custom_all_gather`)
    hpz   after forward, each rank keeps the weights sharded over its node's `node_size`
          ranks, so backward's all-gather stays in the node: FSDP2's integer
          `reshard_after_forward` (DeepSpeed's `zero_hpz_partition_size`)
    qgz   the gradients in int4, a scale per `gradient_block`, reduced by an all-to-all
          inside the node and one across nodes (`QuantizedReduceScatter`, as
          `set_custom_reduce_scatter`)

DeepSpeed's names are `zero_quantized_weights`, `zero_hpz_partition_size` and
`zero_quantized_gradients` (`deepspeed/runtime/zero/config.py`). With all three off it is
ZeRO-3 on the same groups: the baseline the bytes and the losses are measured against.

The ranks are nodes of `node_size` consecutive ranks (as a launcher numbers them). The
groups are labelled with the link they cross (`shardlab.comm.links`), so the ledger splits
the bytes by link: the group of all ranks, over which the weights are sharded and gathered
in forward, spans the nodes ("inter-node" once there are two); a node's group is
"intra-node"; the group of one rank per node that qgZ's second hop uses is "inter-node".
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from shardlab.comm.links import INTER, INTRA, label_link
from shardlab.fsdp.api import FSDPModule, consecutive_groups
from shardlab.fsdp.strategies import fully_shard_on
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import Precision
from shardlab.strategy import Wrapped, check_options
from shardlab.zeropp.collectives import QuantizedAllGather, QuantizedReduceScatter
from shardlab.zeropp.quantize import check_block

ZEROPP_OPTIONS = {"wrap": "auto", "node_size": None, "qwz": True, "hpz": True, "qgz": True,
                  "weight_block": 2048, "gradient_block": 1024, "reduce_dtype": "fp32"}


def check_zeropp_options(options: dict, world: int) -> dict:
    """The options merged with their defaults, each refused in one line if it cannot run."""
    options = check_options("zeropp", options, ZEROPP_OPTIONS)
    size = options["node_size"]
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    if size is None:
        raise ValueError(f"strategy 'zeropp' needs option node_size, the ranks of one node "
                         f"(hpZ's partition, qgZ's first hop): a divisor of the world size "
                         f"{world}, one of {divisors}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"strategy 'zeropp': node_size must be a whole number that divides "
                         f"the world size {world}, got {size!r}; use one of {divisors}")
    for key in ("qwz", "hpz", "qgz"):
        if not isinstance(options[key], bool):
            raise ValueError(f"strategy 'zeropp': {key} must be True or False, got "
                             f"{options[key]!r}")
    check_block("weight_block", options["weight_block"])
    check_block("gradient_block", options["gradient_block"])
    return options


def check_options_before_launch(strategy: str, options: dict, world: int) -> None:
    """The card's `launch_check`: called before any process starts."""
    check_zeropp_options(options, world)


_groups: dict[tuple[int, int], tuple] = {}


def zeropp_groups(node_size: int):
    """(all ranks, this rank's node, this rank's ranks of the same local index across
    nodes), labelled with their links; made once per node size (every rank makes every
    group, in the same order, as `dist.new_group` asks)."""
    world = dist.get_world_size()
    key = (world, node_size)
    if key not in _groups:
        nodes = world // node_size
        everyone = dist.new_group(list(range(world)))
        node = consecutive_groups(node_size)
        cross, _ = dist.new_subgroups_by_enumeration(
            [[n * node_size + local for n in range(nodes)] for local in range(node_size)])
        label_link(everyone, INTER if nodes > 1 else INTRA)
        label_link(node, INTRA)
        label_link(cross, INTER)
        _groups[key] = (everyone, node, cross)
    return _groups[key]


def wrap_zeropp(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                options: dict) -> Wrapped:
    """Ours: `fully_shard` over all ranks, with hpZ as its integer reshard_after_forward
    and qwZ, qgZ as its custom collectives. options: node_size, qwz, hpz, qgz,
    weight_block, gradient_block, wrap, reduce_dtype (under "bf16-mixed")."""
    options = check_zeropp_options(options, dist.get_world_size())
    everyone, node, cross = zeropp_groups(options["node_size"])
    hpz = options["node_size"] if options["hpz"] else True
    fsdp2 = {"wrap": options["wrap"], "reshard_after_forward": hpz, "prefetch": "backward",
             "offload": False, "reduce_dtype": options["reduce_dtype"],
             "accumulate": "no_sync", "reshard_after_backward": True}
    wrapped = fully_shard_on(model, precision, optimizer, fsdp2, group=everyone)
    for module in wrapped.model.modules():
        if not isinstance(module, FSDPModule) or "_sharded_units" not in module.__dict__:
            continue
        if options["qwz"]:
            module.set_custom_all_gather(QuantizedAllGather(8, options["weight_block"]))
        if options["qgz"]:
            module.set_custom_reduce_scatter(
                QuantizedReduceScatter(node, cross, 4, options["gradient_block"]))
    return wrapped
