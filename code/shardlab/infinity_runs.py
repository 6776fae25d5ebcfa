"""The runs of ZeRO-Infinity's chapter, lab and tests: several trainings in one launch,
each measured for what the disk tier changes.

`disk_runs` trains each case of a list on every rank, one after the other, and returns
what each rank saw: the global-batch losses; per step its time, the bytes that crossed
the disk by what for (`shardlab.disk_tier` counts them) and the seconds the rank waited
for them; the model states it held after the last step; its peak resident memory during
the steps above what it held before the model was built (VmHWM, `peak_above_start`; the
build's own peak apart, as every rank builds the whole model before sharding it); with
`limit`, whether it ran out under a real cap on what it may allocate
(`shardlab.faults.host_memory_cap`) and the line that says where; and how far its
parameters are from an earlier case's (`same_as`).

A case that fails (out of memory, a fault of the disk) stops on every rank together: each
step ends with one all-reduce of a flag, so no rank goes on into collectives the others
never reach.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from shardlab.disk_tier import DiskTierError, disk_bandwidth
from shardlab.faults import OutOfMemory, data_segment_bytes, host_memory_cap
from shardlab.launch.devices import rank_device
from shardlab.measure import host_peak_bytes, host_rss_bytes, reset_host_peak
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.step import HeldAfterStep, train_step
from shardlab.strategy import get_strategy

# glibc's malloc keeps freed memory below its threshold for reuse, and raises the
# threshold as large blocks are freed (up to 32 MiB): a run's freed tensors then stay
# resident, and the next case in the same process starts above its true baseline.
# A fixed threshold sends every block from 128 KiB up to mmap, returned to the system
# when freed (glibc's mallopt(3): M_MMAP_THRESHOLD, and M_TRIM_THRESHOLD for the heap).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def return_freed_memory() -> None:
    """Make this process give freed blocks back to the system (see above)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 128 << 10)
    libc.mallopt(M_TRIM_THRESHOLD, 128 << 10)


class PhaseWatch(HeldAfterStep):
    """Which phase of the step runs (for the out-of-memory line) and how long each took,
    and the model states held after the optimizer step."""

    def __init__(self, wrapped, step: int):
        super().__init__(wrapped)
        self.step, self.now = step, "forward"
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, what: str):
        self.now = what
        start = time.perf_counter()
        yield
        self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - start

    def where(self) -> str:
        return f"the {self.now} of step {self.step}"


def disk_runs(cases: list[dict[str, Any]], steps: int = 3, bandwidth: dict | None = None
              ) -> dict[str, Any]:
    """Worker: train each case on this rank; return {"runs": [...], "bandwidth": ...}.

    A case: strategy ("zero3", or "deepspeed-zero3" for DeepSpeed's ZeRO-Infinity), model
    (and model_config), precision, optimizer, lr, batch_size, seq_len, options (the
    strategy's), limit (bytes this rank may allocate above what it held before its
    model was built, from its first step on; None: no cap), same_as (the index of an
    earlier case whose parameters to compare with), fault ({"what": "truncate" or
    "kill", "rank": r, "step": s}: `rehearse` it on rank r before step s), name.
    `bandwidth`: the arguments of `shardlab.disk_tier.disk_bandwidth`, measured on every
    rank at once (the ranks share the disk, as they do when they train) before the
    cases."""
    return_freed_memory()
    rank, world = dist.get_rank(), dist.get_world_size()
    measured = None
    if bandwidth is not None:
        dist.barrier()
        measured = disk_bandwidth(**bandwidth)
    runs, kept = [], {}
    for i, case in enumerate(cases):
        compared = "same_as" in case or any(c.get("same_as") == i for c in cases[i + 1:])
        result, params = _one_case(case, steps, rank, world, compared)
        if "same_as" in case and params is not None and case["same_as"] in kept:
            ref_losses, ref_params = kept[case["same_as"]]
            result["same_losses"] = result["losses"] == ref_losses
            result["param_diff"] = max((params[k] - ref_params[k]).abs().max().item()
                                       for k in ref_params)
        if params is not None and compared:
            kept[i] = (result["losses"], params)
        runs.append(result)
    return {"runs": runs, "bandwidth": measured}


def _one_case(case: dict, steps: int, rank: int, world: int, keep_params: bool):
    gc.collect()
    reset_host_peak()
    rss_before, data_before = host_rss_bytes(), data_segment_bytes()
    torch.manual_seed(0)
    precision = get_precision(case.get("precision", "fp32"))
    spec = optimizer_spec(case.get("optimizer", "adamw"), case.get("lr", 1e-3))
    batch, seq = case.get("batch_size", 8), case.get("seq_len", 32)
    result: dict[str, Any] = {"case": case, "rank": rank, "losses": [], "step_seconds": [],
                              "moved": [], "waited": [], "error": None}
    failed = None
    try:
        model = build_model(case.get("model", "gpt-tiny"), 0, case.get("model_config"))
        result["psi"] = sum(p.numel() for p in model.parameters())
        wrapped = get_strategy(case.get("strategy", "zero3"))(
            model, precision, spec, dict(case.get("options", {})))
        del model
    except (ValueError, DiskTierError) as exc:  # the disk tier is made after the
        failed = str(exc)                       # wrapping's collectives: agree here
    if _anyone_failed(failed is not None):
        result["error"] = failed or "another rank failed"
        return result, None
    # the build's peak (every rank builds the whole model before sharding it) apart from
    # the training's: from here on the peak is the steps'
    result["build_peak_above_start"] = host_peak_bytes() - rss_before
    gc.collect()
    reset_host_peak()
    tier = getattr(wrapped.optimizer, "tier", None)
    units = getattr(wrapped.extra_state[0], "units", [])  # zero3's; DeepSpeed has its own
    result["shards"] = [(b.shard_numel, b.requires_grad) for u in units for b in u.buffers]
    result["on_disk"] = tier.folder.on_disk() if tier is not None else 0
    result["io"] = []
    limit, fault = case.get("limit"), case.get("fault")
    for step in range(steps):
        if fault and fault["rank"] == rank and fault["step"] == step:
            rehearse(fault["what"], tier)
        watch = PhaseWatch(wrapped, step)
        moved = dict(tier.folder.moved) if tier is not None else {}
        waited = tier.folder.waited if tier is not None else 0.0
        failed = None
        io_before = storage_io()
        start = time.perf_counter()
        try:
            x, y = get_batch(step, rank, world, batch, seq)
            if limit is None:
                loss = _step(wrapped, x, y, watch)
            else:
                with host_memory_cap(limit, data_before, watch.where):
                    loss = _step(wrapped, x, y, watch)
        except (OutOfMemory, DiskTierError) as exc:
            failed = str(exc)
        seconds = time.perf_counter() - start
        if _anyone_failed(failed is not None):
            result["error"] = failed or "another rank failed"
            break
        total = loss.detach().clone()
        dist.all_reduce(total)
        result["losses"].append(float(total) / world)
        result["step_seconds"].append(seconds)
        result["io"].append({k: v - io_before[k] for k, v in storage_io().items()})
        result.setdefault("phase_seconds", []).append(watch.seconds)
        if tier is not None:
            result["moved"].append({f"{way} {kind}": n - moved[(way, kind)]
                                    for (way, kind), n in tier.folder.moved.items()})
            result["waited"].append(tier.folder.waited - waited)
        result["held"] = watch.held
    result["peak_above_start"] = host_peak_bytes() - rss_before
    params = None
    if result["error"] is None and keep_params:
        params = {k: v.float() for k, v in wrapped.full_parameters().items()}
    return result, params


def rehearse(what: str, tier) -> None:
    """A fault of the disk tier on purpose: "truncate" one of this rank's state files to
    nothing under the running job (the last one made, which the optimizer step reads),
    or "kill" this rank (SIGKILL: no Python code of it runs again)."""
    if what == "truncate":
        os.ftruncate(tier.folder.files[-1].fd, 0)
    elif what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise ValueError(f"unknown fault {what!r}; use 'truncate' or 'kill'")


def storage_io() -> dict[str, int]:
    """Bytes this process (all its threads) has read from and written to storage so far,
    as the kernel counts them (/proc/self/io's read_bytes and write_bytes): the same count
    for the course's disk tier and for DeepSpeed's libaio, whichever code moved them."""
    fields = {}
    with open("/proc/self/io") as io:
        for line in io:
            name, _, value = line.partition(":")
            fields[name] = int(value)
    return {"read": fields["read_bytes"], "written": fields["write_bytes"]}


def _step(wrapped, x, y, watch) -> torch.Tensor:
    return train_step(wrapped, [(x, y)], loss_fn, watch)


def _anyone_failed(failed: bool) -> bool:
    flag = torch.tensor([1.0 if failed else 0.0], device=rank_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
