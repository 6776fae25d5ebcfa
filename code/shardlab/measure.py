"""What a run really holds: bytes by category from live tensors, and a step's peak.

`shardlab.memory` predicts bytes; this module counts them, so a notebook can put the two
side by side. Two rules make the count honest:

* each storage is counted once, whole: a parameter that is a view into a flat buffer
  counts the buffer (padding included), and two tensors sharing a storage (tied weights,
  gradients that are views of a bucket) count it once;
* a tensor's category is decided by who holds it: a module's parameters are "params",
  their `.grad` "grads", its buffers "buffers"; an optimizer's states (and any tensor
  it steps that is not a module's parameter: fp32 master copies, flat shards) are
  "optimizer". A strategy object that knows better declares its tensors itself with a
  `state_tensors() -> {"params": [...], "grads": [...], "optimizer": [...]}` method.

One holder keeps memory that no Python tensor reaches: PyTorch's DistributedDataParallel,
whose C++ Reducer holds flat buckets for all the gradients it all-reduces
(`torch/nn/parallel/distributed.py`, `gradient_as_bucket_view`). With the default
`gradient_as_bucket_view=False` they are a second copy of the gradients beside the
parameters' `.grad`; with True the `.grad` are views into them. Their bytes, as the Reducer
reports them (`ddp_bucket_bytes`), count as "grads" wherever no `.grad` already reaches
them.

    >>> sizes = state_bytes(model, optimizer)   # after backward and step
    >>> with track_peak(model, optimizer) as peak:
    ...     loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
    >>> peak.bytes, peak.by_category
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch import nn

CATEGORIES = ("params", "grads", "optimizer", "buffers")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    if callable(to_local) and type(t).__name__ == "DTensor":
        with torch.no_grad():
            return to_local()
    return t


def storage_key_and_bytes(t: torch.Tensor) -> tuple[tuple, int] | None:
    """(a key unique to the tensor's storage, the storage's bytes), or None for a tensor
    that holds no memory (meta, or empty)."""
    t = local_tensor(t)
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return None
    return (t.device, storage.data_ptr()), nbytes


def is_optimizer_like(obj: Any) -> bool:
    """A torch optimizer, or a wrapper that exposes its `param_groups` and `state`."""
    return isinstance(obj, torch.optim.Optimizer) or (
        hasattr(obj, "param_groups") and hasattr(obj, "state"))


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def categorized_tensors(*holders: Any) -> list[tuple[str, torch.Tensor]]:
    """(category, tensor) for everything the holders keep, in a deterministic order.

    An object with `state_tensors()` is taken at its word and comes first; then modules,
    so that a tensor that is both a module's parameter and in an optimizer's param_groups
    is a parameter; then optimizers.
    """
    declared, modules, optimizers = [], [], []
    for h in holders:
        if callable(getattr(h, "state_tensors", None)):
            declared.append(h)
        elif isinstance(h, nn.Module):
            modules.append(h)
        elif is_optimizer_like(h):
            optimizers.append(h)
        else:
            raise TypeError(f"cannot count the memory of a {type(h).__name__}: pass "
                            f"nn.Module, torch.optim.Optimizer, or an object with a "
                            f"state_tensors() method returning {{category: [tensors]}} "
                            f"with categories {list(CATEGORIES)}")
    found: list[tuple[str, torch.Tensor]] = []
    module_params: set[int] = set()
    for holder in declared:
        tensors = holder.state_tensors()
        bad = set(tensors) - set(CATEGORIES)
        if bad:
            raise ValueError(f"{type(holder).__name__}.state_tensors() returned unknown "
                             f"categories {sorted(bad)}; use {list(CATEGORIES)}")
        for category in CATEGORIES:
            found += [(category, t) for t in tensors.get(category, []) if t is not None]
    for module in modules:
        for p in module.parameters():
            module_params.add(id(p))
            found.append(("params", p))
            if p.grad is not None:
                found.append(("grads", p.grad))
        found += [("buffers", b) for b in module.buffers()]
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in module_params:  # master copies, flat shards
                    found.append(("optimizer", p))
                    if p.grad is not None:
                        found.append(("grads", p.grad))
        for per_param in opt.state.values():
            found += [("optimizer", t) for t in _tensors_in(per_param)]
    return found


def unique_storages(*holders: Any) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(category, tensor, bytes of its storage) for each storage the holders hold, once:
    the first holder and category to reach a storage own it."""
    seen: set[tuple] = set()
    for category, t in categorized_tensors(*holders):
        key_bytes = storage_key_and_bytes(t)
        if key_bytes is None or key_bytes[0] in seen:
            continue
        seen.add(key_bytes[0])
        yield category, t, key_bytes[1]


def state_bytes(*holders: Any) -> dict[str, int]:
    """Bytes this rank holds by category ("params", "grads", "optimizer", "buffers"),
    each storage counted once across all holders; PyTorch DDP's gradient buckets in
    "grads" (`hidden_bucket_bytes`)."""
    totals = dict.fromkeys(CATEGORIES, 0)
    for category, _, nbytes in unique_storages(*holders):
        totals[category] += nbytes
    totals["grads"] += hidden_bucket_bytes(*holders)
    return totals


def ddp_bucket_bytes(module: Any) -> int:
    """Bytes of the flat gradient buckets PyTorch's DistributedDataParallel keeps in its
    C++ Reducer, as the Reducer reports them (`_get_ddp_logging_data()`: the buckets it
    built, or rebuilt after the first step in the order gradients arrived): one copy of
    every gradient it reduces. 0 for any other holder."""
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return 0
    logged = module._get_ddp_logging_data()
    sizes = logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes") or ""
    return sum(int(size) for size in str(sizes).split(",") if size.strip())


def hidden_bucket_bytes(*holders: Any) -> int:
    """The bytes of DDP's buckets that no `.grad` reaches: all of them with
    `gradient_as_bucket_view=False` (the default: the `.grad` are a copy of their own), and
    with True those of buckets no `.grad` is a view of at the moment (after
    `zero_grad(set_to_none=True)` the buckets stay, the views go)."""
    hidden, seen = 0, set()
    for holder in holders:
        buckets = ddp_bucket_bytes(holder)
        if not buckets or id(holder) in seen:
            continue
        seen.add(id(holder))
        if not holder.gradient_as_bucket_view:
            hidden += buckets
            continue
        bound = dict(key_bytes for p in holder.parameters() if p.grad is not None
                     if (key_bytes := storage_key_and_bytes(p.grad)) is not None)
        hidden += max(0, buckets - sum(bound.values()))
    return hidden


# ----------------------------------------------------------------------------- peak


@dataclass
class Peak:
    """The highest memory of a tracked block; `by_category` splits it into the model
    states (params, grads, optimizer, buffers) and what the step made on the way
    (activations, temporaries, other)."""

    bytes: int = 0
    by_category: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"
    # CUDA only: the caching allocator's peak reserved bytes (what the process took from
    # the device, allocated or cached: what `nvidia-smi` shows, and what runs out).
    reserved: int = 0
    # Call between two forwards of one tracked step (gradient accumulation): PyTorch's
    # MemTracker follows one forward per module unless its module statistics are reset.
    next_forward: Any = lambda: None
    # Gradient accumulation: what is held at those calls, between a micro-batch's backward
    # and the next one's forward, when its activations are freed and what the strategy
    # keeps across micro-batches (full gradients, gathered parameters) is held (on CUDA:
    # allocated bytes, the micro-batch's data included). The least over the step's
    # boundaries, which hold the same in a steady step: a collective's input that gloo's
    # thread has not let go of yet shows at one boundary, not at every one.
    between: int = 0


# MemTracker's names -> ours
_MEMTRACKER_NAMES = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer",
                     "Buffer": "buffers", "Activation": "activations", "Temp": "temporaries",
                     "Other": "other"}


def _device_of(holders: Iterable[Any]) -> torch.device:
    for _, t in categorized_tensors(*holders):
        return local_tensor(t).device
    return torch.device("cpu")


@contextlib.contextmanager
def track_peak(*holders: Any) -> Iterator[Peak]:
    """Measure the peak memory of the block (one training step, say).

    On CPU, PyTorch's MemTracker follows every storage created or held in the block and
    names its role. On a GPU the CUDA caching allocator's own peak counter is the truth
    (it is what runs out); the model states are counted from the holders at the end and
    the rest of the peak is reported as "activations and temporaries".
    """
    peak = Peak()
    device = _device_of(holders)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

        def held_now() -> None:
            held = int(torch.cuda.memory_allocated(device))
            peak.between = min(peak.between, held) if peak.between else held

        peak.next_forward = held_now
        yield peak
        torch.cuda.synchronize(device)
        peak.device = str(device)
        peak.bytes = int(torch.cuda.max_memory_allocated(device))
        peak.reserved = int(torch.cuda.max_memory_reserved(device))
        states = state_bytes(*holders)
        peak.by_category = {**states, "activations_and_temporaries":
                            max(0, peak.bytes - sum(states.values()))}
        return

    tracker = _frozen_aware_mem_tracker()
    modules = [h for h in holders if isinstance(h, nn.Module)]
    # MemTracker files by storage, and re-files a storage as "Parameter" (or "Gradient")
    # whenever a module's parameter (or its `.grad`) is a view of it. So a declared tensor
    # that shares its storage with a module tensor (ZeRO's flat parameter buffer, whose
    # views the modules hold) is the module's to file; handing it over as well would make
    # it count twice, or move another tensor's bytes into its category (ZeRO-2's gradient
    # shard, nobody's `.grad`, showed up as parameters).
    module_storages = {key for m in modules for t in _module_tensors(m)
                       if (key := _storage_key(t)) is not None}
    # MemTracker knows modules and torch optimizers; the optimizer tensors of any other
    # holder (fp32 master copies, flat shards) are handed to it as one more optimizer's
    # state, and the remaining declared tensors, which it can only file as "Other", are
    # moved back into their category afterwards.
    optimizer_tensors, other, moved = [], [], dict.fromkeys(CATEGORIES, 0)
    for category, t, nbytes in unique_storages(*holders):
        if category == "optimizer":
            optimizer_tensors.append(local_tensor(t))
        elif _storage_key(t) not in module_storages:
            other.append(local_tensor(t))
            moved[category] += nbytes
    tracker.track_external(*modules, _DeclaredState(optimizer_tensors), *other)
    # DDP's buckets live through the whole step in C++, allocated before it and, with
    # gradient_as_bucket_view=True, bound to the `.grad` in C++ too: MemTracker, which
    # follows the tensors Python creates and the gradients autograd accumulates, never
    # meets them (measured on torch 2.13: its peak is the same without them). Add them.
    buckets = sum(ddp_bucket_bytes(m) for m in {id(m): m for m in modules}.values())

    def next_forward() -> None:
        # No activation is alive between micro-batches: what MemTracker files as one here
        # is the data (`models.get_batch` builds its rows from a 1 MB tensor of the corpus
        # that MemTracker never sees freed), not the strategy's.
        held = next(iter(tracker.get_tracker_snapshot("current").values()), {})
        held_bytes = int(held.get("Total", 0)) - int(held.get("Activation", 0)) + buckets
        peak.between = min(peak.between, held_bytes) if peak.between else held_bytes
        tracker.reset_mod_stats()

    peak.next_forward = next_forward
    with tracker:
        yield peak
    snap = tracker.get_tracker_snapshot("peak")
    device_snap = next(iter(snap.values()), {})
    peak.device = str(next(iter(snap), "cpu"))
    peak.bytes = int(device_snap.get("Total", 0)) + buckets
    by = {ours: int(device_snap.get(theirs, 0)) for theirs, ours in _MEMTRACKER_NAMES.items()}
    for category, nbytes in moved.items():
        nbytes = min(nbytes, by["other"])
        by[category] += nbytes
        by["other"] -= nbytes
    by["grads"] += buckets
    peak.by_category = by


def _storage_key(t: torch.Tensor) -> tuple | None:
    key_bytes = storage_key_and_bytes(t)
    return None if key_bytes is None else key_bytes[0]


def _module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """A module's parameters, their `.grad`s and its buffers: what MemTracker files itself."""
    for p in module.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from module.buffers()


class _NoHook:
    def remove(self) -> None:
        pass


def _frozen_aware_mem_tracker():
    """PyTorch's MemTracker, made to accept frozen parameters: it hooks the gradient of
    every parameter it meets, and a tensor that needs no gradient refuses a hook. A
    frozen parameter is given a placeholder "already hooked" entry instead (it never has
    a gradient to follow), so models with frozen layers can be tracked too."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for p in module.parameters():
                if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return FrozenAwareMemTracker()


class _DeclaredState(torch.optim.Optimizer):
    """Only a carrier: MemTracker files the tensors of an optimizer's `state` as optimizer
    states, which is what these are. It is never stepped."""

    def __init__(self, tensors: list[torch.Tensor]):  # noqa: D107 - no super(): no params
        self.state = {i: {"tensor": t} for i, t in enumerate(tensors)}
        self.param_groups = []


# ----------------------------------------------------------------------------- host memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field} (not Linux?)")


def host_allocated_bytes() -> int:
    """Bytes the process's C allocator (glibc's malloc) has handed out and not taken back:
    `mallinfo2()`'s in-use bytes of its arenas plus its mmapped blocks. Every CPU tensor's
    storage comes from there (c10's CPU allocator calls `posix_memalign`), whoever
    allocates it, C++ included, which is how the bytes of a buffer no Python object
    reaches (DDP's Reducer buckets) can be measured. Linux with glibc >= 2.33."""
    import ctypes
    import ctypes.util

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        raise OSError("this C library has no mallinfo2 (glibc >= 2.33 on Linux)")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def host_rss_bytes() -> int:
    """This process's resident host memory now (VmRSS), in bytes (Linux)."""
    return _status_kib("VmRSS") * 1024


def host_peak_bytes() -> int:
    """This process's peak resident host memory (VmHWM) since it started or since
    `reset_host_peak`, in bytes (Linux)."""
    return _status_kib("VmHWM") * 1024


def reset_host_peak() -> None:
    """Start the peak over from the memory resident now (Linux's clear_refs, value 5):
    a forked rank inherits its parent's peak otherwise."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
