"""The disk tier's costs, as formulas: the bytes that cross the disk in a step, the model
states that stay in memory, and the step time the disk allows (`shardlab.infinity` is the
mechanism; chapter 15 and `benchmarks/bench_infinity.py` set these beside its runs).

What crosses the disk per step and rank, with S the elements of this rank's shards and
the 4 KiB rounding of each chunk aside (`disk_traffic` counts exactly; `tests/test_infinity.py`
checks it against the byte counters of the runs):

                     fp32 (Adam)              bf16-mixed (Adam)
    optimizer        read 8S, write 8S        read 12S, write 12S   (m, v; + master)
    + params         read 4S x 2 + 12S,       read 2S x 2 + 12S,    (gathers in forward
                     write 12S                write 12S + 2S         and backward)

In fp32 the parameter is its own master copy: with the parameters on disk the step reads
and writes it once, as the master. The setup (the first writes of the files) is not a step's.
"""

from __future__ import annotations

from shardlab.disk_tier import BLOCK, blocks
from shardlab.infinity import slot_layout, state_names
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import Precision


def bytes_per_element(precision: Precision, spec: OptimizerSpec, offload: str,
                      gathers: int = 2) -> dict[str, int]:
    """The module's table: bytes that cross the disk per step for each element of this
    rank's shards, by what for (4 KiB rounding aside). `gathers`: all-gathers of each unit
    per step (2 with reshard_after_forward, 1 without)."""
    params = offload == "optimizer+params"
    layout = slot_layout(precision, spec, params)
    moved = sum(dtype.itemsize for name, dtype in layout.items() if name != "param")
    return {"gathers read": gathers * precision.param_dtype.itemsize if params else 0,
            "step read": moved,
            "step written": moved + (layout["param"].itemsize if "param" in layout else 0)}


def disk_traffic(shards: list[tuple[int, bool]], precision: Precision, spec: OptimizerSpec,
                 offload: str, chunk_numel: int, gathers: int = 2) -> dict[str, int]:
    """Bytes that cross the disk in one step of a rank whose flat buffers have
    `shards` = [(elements of its shard, trained), ...], exactly: each chunk's transfer is
    whole 4 KiB blocks of each state it moves, and a parameter read is whole blocks of
    its staging buffer (a slot)."""
    params = offload == "optimizer+params"
    layout = slot_layout(precision, spec, params)
    e_p = precision.param_dtype.itemsize
    staging = max(sum(blocks(chunk_numel * d.itemsize) for d in layout.values()),
                  blocks(chunk_numel * e_p))
    out = {"gathers read": 0, "step read": 0, "step written": 0}
    for numel, trained in shards:
        if params:  # read through a staging slot, `staging` bytes at a time
            whole, rest = divmod(numel * e_p, staging)
            out["gathers read"] += gathers * (whole * staging + blocks(rest))
        if not trained:
            continue
        for a in range(0, numel, chunk_numel):
            n = min(chunk_numel, numel - a)
            for name, dtype in layout.items():
                nbytes = blocks(n * dtype.itemsize)
                out["step written"] += nbytes
                if name != "param":
                    out["step read"] += nbytes
    return out


def resident_states(shards: list[tuple[int, bool]], precision: Precision,
                    spec: OptimizerSpec, offload: str | None, buffers: int = 3,
                    chunk_numel: int = 1 << 20) -> dict[str, int]:
    """The model states a rank holds in memory between steps, by category, in bytes:
    parameter shards (none with the parameters on disk), gradient shards, and the
    optimizer's: its states in memory (Adam's m and v, an fp32 master copy), or with
    the disk tier its slots alone (each with up to 4 KiB of alignment beside it)."""
    e_p = precision.param_dtype.itemsize
    total = sum(n for n, _ in shards)
    trained = sum(n for n, t in shards if t)
    params = offload == "optimizer+params"
    if offload is None:
        master = 4 if precision.master_weights else 0
        per = master + len(state_names(spec)) * (4 if precision.master_weights else e_p)
        optimizer = per * trained
    else:
        layout = slot_layout(precision, spec, params)
        slot = max(sum(blocks(chunk_numel * d.itemsize) for d in layout.values()),
                   blocks(chunk_numel * e_p))
        optimizer = buffers * (slot + BLOCK)
    return {"params": 0 if params else total * e_p, "grads": trained * e_p,
            "optimizer": optimizer}


def step_seconds(compute: float, traffic: dict[str, int], read_bandwidth: float,
                 write_bandwidth: float, first_read: int = 0) -> dict[str, float]:
    """The step time the disk allows, by the chapter's model: the optimizer step's
    transfers are all exposed (the step needs its states before it can run and the next
    forward needs what it writes); the gathers' reads hide behind the forward and backward
    (`compute`, the step without the disk) except what exceeds it, and at least the first
    unit's (`first_read` bytes), which nothing runs before. efficiency = compute /
    (compute + exposed)."""
    step_io = traffic["step read"] / read_bandwidth + traffic["step written"] / write_bandwidth
    gathers = traffic["gathers read"] / read_bandwidth
    exposed_gathers = max(first_read / read_bandwidth, gathers - compute) if gathers else 0.0
    exposed = step_io + exposed_gathers
    return {"compute": compute, "exposed": exposed, "step": compute + exposed,
            "efficiency": compute / (compute + exposed)}
