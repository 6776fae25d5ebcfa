"""What a rank holds between two micro-batches of gradient accumulation, by way.

Between one micro-batch's backward and the next one's forward no activation is alive: a
rank holds its model states and whatever the way keeps across micro-batches, which is
where the ways differ (Ψ parameters, N ranks, S of them sharing shards under HSDP, the
bytes per parameter of `bytes_per_param`):

    DDP (no_sync)          stage 0: every state whole; the gradient accumulates in place
    ZeRO-1                 stage 1: the gradient whole, reduce-scattered by the step
    ZeRO-2                 stage 2: each micro-batch's gradient reduce-scattered into
                           the rank's shard as backward produces it
    FSDP2 (ZeRO-3)         the shards, plus under `set_requires_gradient_sync(False)` the
                           whole gradient (Ψ, unreduced), else the gradient's shard; plus
                           the whole parameters under `set_reshard_after_backward(False)`
    HSDP, all-reduce once  the shards over S, and the sum of the micro-batches' reduced
                           gradient shards (Ψ/S), all-reduced once

`comm.fsdp_accumulation_volume` gives the bytes each way sends per optimizer step.
"""

from __future__ import annotations

from shardlab.memory.states import Breakdown, bytes_per_param, model_states, shard_numel

WAYS = ("ddp", "zero1", "zero2", "fsdp")


def held_between_micro_batches(way: str, psi: int, world: int,
                               precision: str = "fp32", optimizer: str = "adamw", *,
                               shard_group: int | None = None,
                               reshard_after_backward: bool = True,
                               accumulate: str = "no_sync",
                               ddp_bucket_copy: bool = False) -> Breakdown:
    """Bytes of parameters, gradients and optimizer states one rank holds between two
    micro-batches. `way`: "ddp", "zero1", "zero2" (the course's stages) or "fsdp" with
    FSDP2's knobs (`shardlab.fsdp.strategies`; `shard_group` S for HSDP). `ddp_bucket_copy`:
    PyTorch's DDP keeps its buckets, a second gradient (`ddp_bucket_copy_bytes`)."""
    if way not in WAYS:
        raise ValueError(f"way must be one of {list(WAYS)}, got {way!r}")
    per = bytes_per_param(precision, optimizer)
    if way != "fsdp":
        states = model_states(psi, world, {"ddp": 0, "zero1": 1, "zero2": 2}[way], precision,
                              optimizer)
        if ddp_bucket_copy:
            states = Breakdown(states.params, states.grads + per.grads * psi, states.optimizer)
        return states
    size = world if shard_group is None else shard_group
    shard = shard_numel(psi, size)
    # FSDP2 keeps its shards in the parameters' own dtype (fp32 under bf16-mixed: they are
    # the master weights), and gathers in the compute dtype
    master = 4 if precision == "bf16-mixed" else per.params
    params = master * shard + (0 if reshard_after_backward else per.params * psi)
    if accumulate == "no_sync":
        # the whole, unreduced gradient, in the compute dtype as the course keeps it
        # (PyTorch's FSDP2 keeps it in `reduce_dtype`, fp32 under the usual bf16-mixed)
        grads = per.grads * psi
    else:                                  # the reduced shard, or HSDP's sum of them
        grads = master * shard
    optimizer_bytes = (per.optimizer - (4 if precision == "bf16-mixed" else 0)) * shard
    return Breakdown(params, grads, optimizer_bytes)
