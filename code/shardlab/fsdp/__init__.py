"""FSDP2 from scratch (`fully_shard`), its layout, its strategies, and PyTorch's beside it.

    layout.py      FSDP2's per-parameter layout: each parameter cut along dim 0 (`PerParamUnit`)
    api.py         `fully_shard`, `FSDPModule` and its knobs (PyTorch's names), the policies,
                   full <-> sharded helpers
    strategies.py  the strategies `fsdp2` (ours) and `torch-fsdp2` (PyTorch's `fully_shard`),
                   each over any group or mesh (`shardlab.hsdp` builds HSDP on them), the
                   knobs as their options, ZeRO-1 and ZeRO-2 as recipes (`RECIPES`)
    probe.py       `step_probe`, the worker of the chapter and of lab 6

The schedule both FSDP2s share with ZeRO-3 is `shardlab.sharded`.
"""

from shardlab.fsdp.api import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                               fully_shard, gather_full_parameters, load_full_state_dict,
                               model_state)
from shardlab.fsdp.layout import PerParamUnit
from shardlab.fsdp.probe import step_probe
from shardlab.fsdp.strategies import (FSDP2_OPTIONS, RECIPES, apply_fsdp2, dtensor_pieces,
                                      fully_shard_on, gradient_sync_off, torch_fully_shard_on, wrap_fsdp2,
                                      wrap_torch_fsdp2)
from shardlab.sharded.unit import ShardedState

__all__ = ["fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy",
           "gather_full_parameters", "load_full_state_dict", "wrap_fsdp2",
           "wrap_torch_fsdp2", "ShardedState", "PerParamUnit", "model_state",
           "dtensor_pieces", "gradient_sync_off", "FSDP2_OPTIONS", "step_probe",
           "apply_fsdp2", "fully_shard_on", "torch_fully_shard_on", "RECIPES"]
