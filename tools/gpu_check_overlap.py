"""The overlap tax, for `tools/gpu_check.py`: a stream of GEMMs alone and beside traffic
(a collective, or a copy inside the GPU), the traffic alone and beside the GEMMs, and the
share of it that compute hides: the `hiding` of `shardlab.steptime.Machine`.

`collective_overlap` runs on ranks (imported by name, as `gpu_check_runs` is);
`overlap` is the check's item. `OVERLAP_METHOD` says why it is measured this way on one
GPU, and goes into the record beside the figures.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardlab.comm.compat import all_gather_into, reduce_scatter_into
from shardlab.launch import launch, rank_device
from shardlab.stepparts import median_seconds
from shardlab.workers import measure_machine, run_all


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_beside(start_traffic, gemm_n: int, repeats: int, device: torch.device,
                barrier=lambda: None) -> dict:
    """A stream of GEMMs alone (C), the traffic alone (M), and both at once (T), each the
    median of `repeats`; the GEMMs' own time beside the traffic, and the traffic's.

    `start_traffic()` starts the traffic without waiting for it and returns a handle with
    `is_completed()` and `wait()` (a collective's work, or a CUDA event's wrapper).
    `hiding` = (C + M - T) / min(C, M), as `shardlab.rates.hiding_fraction` defines it:
    1 where the traffic costs the GEMMs nothing, 0 where nothing overlaps. `gemm_tax` is
    how much longer the GEMMs took beside the traffic, `traffic_tax` the same of it."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(gemm_n, gemm_n, device=device, dtype=dtype)
    b = torch.randn(gemm_n, gemm_n, device=device, dtype=dtype)

    def traffic():
        start_traffic().wait()
        synchronize(device)

    traffic()  # warm-up: the first collective connects and allocates
    barrier()
    comm_alone = median_seconds(traffic, repeats)

    def one_gemm():
        a @ b
        synchronize(device)

    one_gemm()
    # as many GEMMs as the traffic takes, so that neither hides inside the other by size
    count = max(1, round(comm_alone / max(median_seconds(one_gemm, 3), 1e-7)))

    def gemms():
        for _ in range(count):
            a @ b
        synchronize(device)

    barrier()
    gemm_alone = median_seconds(gemms, repeats)
    together, gemm_side, comm_side = [], [], []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        work, done = start_traffic(), None
        if device.type == "cuda":
            first, last = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            first.record()
        for _ in range(count):
            a @ b
            if done is None and work.is_completed():
                done = time.perf_counter()
        gemms_enqueued = time.perf_counter()
        if device.type == "cuda":
            last.record()
        work.wait()
        if done is None:
            done = time.perf_counter()
        synchronize(device)
        end = time.perf_counter()
        together.append(end - start)
        comm_side.append(done - start)
        gemm_side.append(first.elapsed_time(last) / 1e3 if device.type == "cuda"
                         else gemms_enqueued - start)
    both = statistics.median(together)
    beside = statistics.median(gemm_side)
    comm_beside = statistics.median(comm_side)
    hiding = (gemm_alone + comm_alone - both) / min(gemm_alone, comm_alone)
    return {"gemm_n": gemm_n, "gemms": count, "dtype": str(dtype).replace("torch.", ""),
            "gemm_alone_s": gemm_alone, "traffic_alone_s": comm_alone, "both_s": both,
            "gemm_beside_s": beside, "traffic_beside_s": comm_beside,
            "gemm_tax": beside / gemm_alone - 1, "traffic_tax": comm_beside / comm_alone - 1,
            "hiding": min(1.0, max(0.0, hiding)), "hiding_unclipped": hiding}


def collective_overlap(numel: int, gemm_n: int, repeats: int) -> dict:
    """Run on every rank: the overlap tax of an all-gather and of a reduce-scatter of
    `numel` fp32 elements (the gathered size) beside a stream of GEMMs on this rank."""
    world, device = dist.get_world_size(), rank_device()
    numel = max(world, numel // world * world)
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // world, device=device)
    starts = {"all_gather": lambda: all_gather_into(full, shard, async_op=True),
              "reduce_scatter": lambda: reduce_scatter_into(shard, full, async_op=True)}
    return {op: {"bytes": numel * 4, **gemm_beside(start, gemm_n, repeats, device,
                                                   barrier=dist.barrier)}
            for op, start in starts.items()}


# Why the overlap tax is measured this way on one GPU (recorded with the result).
OVERLAP_METHOD = (
    "NCCL refuses two ranks on one GPU, and a communicator of one rank crosses no link "
    "(its collectives are local copies at most), so NCCL between GPUs cannot be measured "
    "on one. Measured instead: (1) what the course's one-GPU runs pay: gloo ranks sharing "
    "the GPU with CUDA tensors, each rank's all-gather and reduce-scatter beside its own "
    "stream of GEMMs, and the step-time model's own measurement of the machine there "
    "(shardlab.workers.measure_machine: F, alpha, beta, AdamW, hiding); (2) what moving data "
    "inside the GPU costs a GEMM stream: a device-to-device copy_ and an elementwise "
    "kernel on a second stream, the memory and SM traffic an NCCL kernel adds beside "
    "compute, without its link. hiding = (C + M - T) / min(C, M); gemm_tax = GEMMs' time "
    "beside the traffic / alone - 1.")


TRAFFIC_SECONDS = 0.02  # how long the traffic inside the GPU runs, each time


class _StreamTraffic:
    """Work on a second CUDA stream, started now: what `gemm_beside` waits for."""

    def __init__(self, stream: torch.cuda.Stream, work: Callable[[], None]):
        self.done = torch.cuda.Event()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            work()
            self.done.record(stream)

    def is_completed(self) -> bool:
        return self.done.query()

    def wait(self) -> None:
        self.done.synchronize()


def _median_over_ranks(per_rank: list[dict]) -> dict:
    return {op: {key: statistics.median(r[op][key] for r in per_rank)
                 for key in ("hiding", "gemm_tax", "traffic_tax", "gemm_alone_s",
                             "traffic_alone_s", "both_s")}
            for op in per_rank[0]}


def inside_the_gpu(sizes) -> dict:
    """GEMMs beside a copy on a second CUDA stream, in this process: `copy_` and an
    elementwise kernel, each repeated until it lasts about TRAFFIC_SECONDS."""
    device = torch.device("cuda")
    # bf16 buffers 8 x the collective's bytes: one copy of it is not a mere launch
    src = torch.randn(8 * sizes.overlap_bytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream()
    out: dict[str, Any] = {"bytes_read": src.numel() * 2}
    for name, copy in (("copy_", lambda: dst.copy_(src)),
                       ("elementwise", lambda: torch.mul(src, 1.0, out=dst))):
        copy()
        synchronize(device)
        one = median_seconds(lambda copy=copy: (copy(), synchronize(device)), 3)
        repeats = max(1, round(TRAFFIC_SECONDS / max(one, 1e-7)))

        def work(copy=copy, repeats=repeats):
            for _ in range(repeats):
                copy()

        out[name] = {"copies": repeats, **gemm_beside(
            lambda work=work: _StreamTraffic(side, work), sizes.gemm_n, sizes.repeats,
            device)}
    del src, dst
    torch.cuda.empty_cache()  # the ranks launched next share this GPU
    return out


def overlap(sizes, deadline: float, save: Callable[[Any], None]) -> dict:
    """The overlap tax: a GEMM stream alone and beside traffic, the traffic alone and
    beside the GEMMs, and the `hiding` the step-time model takes (see OVERLAP_METHOD).
    The copy inside the GPU first (seconds, in this process), then the ranks."""
    world = max(sizes.worlds)
    result: dict[str, Any] = {"method": OVERLAP_METHOD}
    result["inside_the_gpu"] = (inside_the_gpu(sizes) if sizes.device == "cuda"
                                else {"skipped": "needs CUDA streams"})
    save(result)
    # no strategy's own work here: the overlap record is about the machine, not a strategy
    machine_call = (measure_machine, ({sizes.model: (sizes.model, None)}, sizes.batch_size,
                                      sizes.seq_len, sizes.repeats, []))
    overlap_call = (collective_overlap, (sizes.overlap_bytes // 4, sizes.gemm_n, sizes.repeats))
    out = launch(run_all, world, [machine_call, overlap_call], backend="gloo",
                 device=sizes.device, timeout=max(1.0, deadline - time.time()))
    machine = dataclasses.asdict(out[0][0][sizes.model])
    per_rank = [rank[1] for rank in out]
    result["gloo_ranks_sharing"] = {"world": world, "device": sizes.device,
                                    "machine": machine, "median_over_ranks":
                                    _median_over_ranks(per_rank), "ranks": per_rank}
    result["hiding_for_steptime"] = machine["hiding"]
    return result
