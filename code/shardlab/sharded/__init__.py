"""Sharded units: the gather / free / reduce-scatter schedule that ZeRO-3 and FSDP2 share.

A *unit* is a module (a transformer block, or the model itself for what is left) whose
parameters live sharded across the N ranks of a group. Its parameters are in one of two
states, named as in PyTorch's FSDP2:

    SHARDED     only this rank's 1/N shard exists; the full parameters are freed
    UNSHARDED   the full parameters exist (all-gathered) and the module computes with them

(and, between forward and backward under an integer `reshard_after_forward` R,
SHARDED_POST_FORWARD: a 1/R piece kept, so that backward gathers among R ranks)

and one schedule moves them between the states during a step:

    pre-forward     unshard: all-gather the unit          (Ψ_unit bytes on the wire, logically)
    post-forward    reshard: free the full parameters     (only if reshard_after_forward)
    pre-backward    unshard again (if it was resharded)   (Ψ_unit again)
    post-backward   reduce_scatter_grads into this rank's shard, then reshard  (Ψ_unit)
                    (under gradient accumulation: each knob may skip the reduction or
                    the reshard for the micro-batches before the last)

so a step moves 3Ψ with resharding after forward and 2Ψ without. Each unit does ONE
all-gather and ONE reduce-scatter per phase, over a flat buffer holding all its
parameters: a few large collectives cost far less than many small ones.

ZeRO-3 and FSDP2 differ only in the *layout* of that flat buffer, so the schedule lives
here and each layout in a module of its own, a subclass of `ShardedUnit`:

* `shardlab.zero3.FlatUnit` (ZeRO-3, FSDP1): the unit's parameters concatenated into one
  padded 1-D buffer cut into N equal pieces;
* `shardlab.fsdp.PerParamUnit` (FSDP2): every parameter cut along dim 0 into N chunks.

The schedule is two files:

    unit.py    one unit: its two states, its hooks, its collectives (`ShardedUnit`)
    model.py   the whole model: its units in forward order, the end of backward,
               prefetching, gradient accumulation, and building the units (`shard_units`)
"""

from shardlab.sharded.model import (ParamSlot, ShardedModel, assign_slots, collect_named,
                                    collect_slots, shard_units)
from shardlab.sharded.unit import (RegisterPostBackward, ShardedState, ShardedUnit,
                                   gather_shard, set_param)

__all__ = ["ShardedState", "ShardedUnit", "ShardedModel", "ParamSlot", "RegisterPostBackward",
           "set_param", "gather_shard", "collect_slots", "assign_slots",
           "shard_units", "collect_named"]
