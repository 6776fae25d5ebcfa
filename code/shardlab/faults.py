"""The faults a run causes on purpose, for the debugging chapter: a slow rank, a memory
limit.

A production run fails in a few typical ways, and each is easier to recognise after it
has been caused on purpose and seen in the run report (`shardlab.report`):

* a *straggler*: one rank is slower (a busy host, a slow data loader, a throttled GPU)
  and every other rank waits for it in the next collective. `straggle(rank, seconds)`
  makes this rank sleep before each forward, so the report's idle time can be checked
  against a known delay;
* *out of memory*: the step crosses what the device holds, at one place in the step (the
  logits' forward, a layer's backward, the optimizer step). `memory_limit(limit)` watches
  the step as PyTorch's `MemTracker` counts it and notes where it first crosses `limit`.
  The usual fix for activations, recomputation, is `shardlab.wrap.recompute_units`.

A mistake with no error at all: *clipping by local norms*. A rank that clips its
gradient shard by the shard's own norm scales it by another factor than its neighbours,
and a sharded model drifts from the single process while its loss still falls;
`TrainConfig(clip_local_norm=True)` rehearses it (`shardlab.clip` holds both ways, and
chapter 10 measures the drift).

The failure with no metric, a *hang*, has its own modules: `shardlab.hangs` causes one
the ways real jobs do (a rank whose code takes another path), and the flight recorder of
`shardlab.comm.flight` names the rank and the collective.

On a GPU the memory limit is real: `torch.cuda.set_per_process_memory_fraction` caps the
caching allocator, and the step raises `torch.OutOfMemoryError` at the allocation that
crosses it, inside the module named here. On a CPU the watch only notes the place; the run
goes on, and the report says where it would have died. `host_memory_cap` makes a CPU
limit real: the kernel refuses the allocation that crosses it (see its docstring for why
the data segment's limit, RLIMIT_DATA, and not the address space's).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator


# ----------------------------------------------------------------------------- a straggler


def straggle(seconds: float) -> None:
    """This rank's share of the slowness: a sleep, as long as asked, where a slow data
    loader or a busy host would cost it (before the forward)."""
    if seconds > 0:
        time.sleep(seconds)


# ----------------------------------------------------------------------------- a memory limit


@dataclass
class LimitCrossing:
    """Where a step first held more than the limit."""

    limit: int            # bytes
    held: int             # bytes held right after the operation that crossed it
    phase: str            # "forward", "backward" or "optimizer step"
    module: str           # the innermost module running then ("" between modules)
    step: int = -1        # filled in by the loop

    def __str__(self) -> str:
        # outside every module: the loss (its backward starts the backward), the batch
        where = (f"{self.phase} of {self.module}" if self.module
                 else f"{self.phase}, outside the model's modules")
        return (f"{where} (step {self.step}): {self.held / 2**20:.2f} MiB held > limit "
                f"{self.limit / 2**20:.2f} MiB")


@dataclass
class LimitWatch:
    """What `memory_limit` hands back: `crossing` is None while the limit holds."""

    limit: int
    crossing: LimitCrossing | None = None


def check_memory_limit(limit: Any) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"memory_limit must be a whole number of bytes >= 1, got {limit!r}")
    return limit


def check_straggler(rank: Any, seconds: Any, world: int) -> None:
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                             or not 0 <= rank < world):
        raise ValueError(f"slow_rank must be a rank of the run (0..{world - 1}) or None, "
                         f"got {rank!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"slow_seconds must be a number of seconds >= 0, got {seconds!r}")


@contextlib.contextmanager
def memory_limit(limit: int) -> Iterator[LimitWatch]:
    """Note where the memory of a block first exceeds `limit` bytes.

    Use it around `shardlab.measure.track_peak`: the tracker (PyTorch's `MemTracker`)
    updates its count of live tensors after every operation, and this watch checks that
    count each time, naming the phase and the innermost module that were running, as
    the traceback of a CUDA out-of-memory error would.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    watch = LimitWatch(check_memory_limit(limit))
    update = MemTracker._update_peak_stats

    def checked(tracker: Any, peak_state: Any) -> None:
        update(tracker, peak_state)
        if watch.crossing is not None:
            return
        held = sum(snap.get("Total", 0) for snap in tracker._curr_mem_snap.values())
        if held > limit:
            watch.crossing = LimitCrossing(limit, int(held), *_where(tracker))

    MemTracker._update_peak_stats = checked
    try:
        yield watch
    finally:
        MemTracker._update_peak_stats = update


def _where(tracker: Any) -> tuple[str, str]:
    modules = tracker._mod_tracker.parents - {"Global"}
    innermost = max(modules, key=lambda name: name.count("."), default="")
    if tracker._in_opt:
        phase = "optimizer step"
    else:
        phase = "backward" if tracker._mod_tracker.is_bw else "forward"
    # MemTracker names modules from the root's class ("GPT.blocks.0"): keep the path
    return phase, innermost.split(".", 1)[1] if "." in innermost else innermost


# ----------------------------------------------------------------------------- a real cap


class OutOfMemory(MemoryError):
    """An allocation the cap refused, in one line: how much, where, the limit."""


def data_segment_bytes() -> int:
    """This process's data segment now (Linux's VmData): the private writable memory it
    has mapped, which RLIMIT_DATA limits."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmData (not Linux?)")


@contextlib.contextmanager
def host_memory_cap(limit: int, above: int, where=lambda: "the step"):
    """Let this process allocate at most `limit` bytes above `above` (its data segment
    when the count starts, `data_segment_bytes()`) inside the block: an allocation past
    it fails, and the block raises `OutOfMemory` saying where (`where()`) and how much.

    Why the data segment (RLIMIT_DATA, Linux >= 4.7) and not the address space
    (RLIMIT_AS): PyTorch, its libraries and every thread reserve address space they never
    touch (gigabytes of it), while RLIMIT_DATA counts only private writable mappings,
    which is where a tensor's storage comes from (glibc's malloc, `mmap` or `brk`). It
    counts what is allocated, touched or not, so it is at least what is resident (VmHWM);
    threads' stacks count too. A cgroup's memory.max would count resident pages, but
    needs a cgroup this process may create, which a notebook or a container often
    cannot. Only the soft limit is lowered, and raised back after the block."""
    import re
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = above + check_memory_limit(limit)
    if data_segment_bytes() > cap:
        raise OutOfMemory(f"out of memory before {where()}: this process holds "
                          f"{(data_segment_bytes() - above) / 2**20:.2f} MiB above its start, "
                          f"over the limit of {limit / 2**20:.2f} MiB")
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    except RuntimeError as exc:
        asked = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", str(exc))
        if asked is None:
            raise
        held = data_segment_bytes() - above
        raise OutOfMemory(f"out of memory in {where()}: {held / 2**20:.2f} MiB held + "
                          f"{int(asked[1]) / 2**20:.2f} MiB asked > limit "
                          f"{limit / 2**20:.2f} MiB") from None
    except OutOfMemory:
        raise
    except MemoryError:  # refused inside C++ code (gloo's buffers: std::bad_alloc)
        held = data_segment_bytes() - above
        raise OutOfMemory(f"out of memory in {where()}: {held / 2**20:.2f} MiB held + an "
                          f"allocation of the collectives > limit "
                          f"{limit / 2**20:.2f} MiB") from None
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


__all__ = ["straggle", "check_straggler", "LimitCrossing", "LimitWatch", "memory_limit",
           "check_memory_limit", "OutOfMemory", "host_memory_cap", "data_segment_bytes"]
