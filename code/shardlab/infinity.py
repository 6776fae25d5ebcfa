"""ZeRO-Infinity for the course's ZeRO-3: the optimizer's states, and the parameters if
asked, kept on disk and streamed through a few buffers.

ZeRO-3 leaves each rank 1/N of every model state; ZeRO-Infinity (Rajbhandari et al.,
2021) puts that 1/N on NVMe, so a model whose states per rank exceed the memory still
trains, at the price of moving them every step. On a CPU machine the process's memory
is the GPU's and a disk is the NVMe (`shardlab.disk_tier` moves the bytes). Two tiers of
offload, chosen by `zero3`'s option `offload`:

"optimizer"         the fp32 master copy (where one exists) and the optimizer's states
                    (Adam's m and v) live in files. `StreamedOptimizer` steps them one
                    chunk of `buffer_numel` elements at a time, in a ring of `buffers`
                    slots: while chunk j is stepped, chunk j+1 is being read and chunk j-1
                    written back (`buffers` >= 3; 2 overlaps only a write with the next
                    read). Only the slots stay in memory, whatever the model's size.
"optimizer+params"  the parameter shards too: `ParamsOnDisk` reads a unit's shard just
                    before its all-gather (and frees it once gathered), and reads the next
                    unit's while this one computes: the order of the last step's reads, as
                    the schedule prefetches gathers. The step writes the updated shard.

The gradient shard stays in memory: it is the reduce-scatter's output and the step's
input (ZeRO-Infinity and DeepSpeed also move it to the offload device; here it is the one
model state a rank keeps whole in memory, 1/N of the gradients).

What crosses the disk per step, what stays in memory and the step time the disk allows
are `shardlab.infinity_costs`'s formulas, checked against this module's byte counters.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardlab.clip import GradClip
from shardlab.disk_tier import DiskFolder, aligned_buffer, blocks
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import InnerOptimizerFace, Precision

OFFLOADS = ("optimizer", "optimizer+params")
# The optimizers whose step is elementwise (a chunk steps exactly as the whole would),
# and the states torch.optim keeps for each element, by its own names.
ELEMENTWISE = {torch.optim.AdamW: ("exp_avg", "exp_avg_sq"),
               torch.optim.Adam: ("exp_avg", "exp_avg_sq"),
               torch.optim.SGD: ("momentum_buffer",)}
# Elements per chunk must fill whole 4 KiB blocks in every dtype a file holds (bf16: 2048).
CHUNK_MULTIPLE = 2048
DEFAULTS = {"offload": None, "offload_dir": None, "offload_buffers": 3,
            "offload_buffer_numel": 1 << 20, "direct_io": True, "keep_offload_files": False}


@dataclass(frozen=True)
class DiskOptions:
    """zero3's options of the disk tier, checked."""

    offload: str                 # what lives on disk: one of OFFLOADS
    folder: str                  # offload_dir: a folder on the disk
    buffers: int                 # slots in the ring (each holds one chunk of every state)
    buffer_numel: int            # elements per chunk
    direct_io: bool              # O_DIRECT: bytes to the disk, not the page cache
    keep: bool                   # keep the files after the run (named, in the folder)

    @property
    def params(self) -> bool:
        return self.offload == "optimizer+params"

    @staticmethod
    def from_options(options: dict[str, Any]) -> "DiskOptions | None":
        """None without `offload`; else the checked options, or a one-line ValueError."""
        offload = options["offload"]
        if offload is None:
            set_alone = [k for k in DEFAULTS if k != "offload" and options[k] != DEFAULTS[k]]
            if set_alone:
                raise ValueError(f"option(s) {set_alone} set the disk tier, which is off: "
                                 f"add offload='optimizer' or 'optimizer+params'")
            return None
        if offload not in OFFLOADS:
            raise ValueError(f"option offload takes one of {list(OFFLOADS)} (or None), "
                             f"got {offload!r}")
        if not options["offload_dir"] or not isinstance(options["offload_dir"], (str, bytes)) \
                and not hasattr(options["offload_dir"], "__fspath__"):
            raise ValueError("offload needs offload_dir, a folder on the disk that holds "
                             "the states (DeepSpeed's nvme_path)")
        buffers, numel = options["offload_buffers"], options["offload_buffer_numel"]
        if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 2:
            raise ValueError(f"option offload_buffers takes a whole number >= 2 (one slot "
                             f"being stepped while another is read or written), got "
                             f"{buffers!r}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < CHUNK_MULTIPLE \
                or numel % CHUNK_MULTIPLE:
            raise ValueError(f"option offload_buffer_numel takes a multiple of "
                             f"{CHUNK_MULTIPLE} elements (whole 4 KiB blocks of bf16), got "
                             f"{numel!r}")
        for flag in ("direct_io", "keep_offload_files"):
            if not isinstance(options[flag], bool):
                raise ValueError(f"option {flag} takes True or False, got {options[flag]!r}")
        return DiskOptions(offload, str(options["offload_dir"]), buffers, numel,
                           options["direct_io"], options["keep_offload_files"])


def state_names(spec: OptimizerSpec) -> tuple[str, ...]:
    """The per-element states of the optimizer `spec` builds, or a refusal for one whose
    step is not elementwise (a chunk of a shard would not step as the whole shard)."""
    if spec.cls not in ELEMENTWISE:
        raise ValueError(f"the disk tier steps the optimizer one chunk of the shard at a "
                         f"time, which is the whole step only for an elementwise "
                         f"optimizer ({', '.join(c.__name__ for c in ELEMENTWISE)}); "
                         f"{spec.cls.__name__} is not one of them: train it in memory")
    if spec.cls is torch.optim.SGD and not spec.kwargs.get("momentum"):
        return ()
    names = ELEMENTWISE[spec.cls]
    return names + ("max_exp_avg_sq",) if spec.kwargs.get("amsgrad") else names


class Slots:
    """The fixed buffers every transfer goes through: `count` slots, each one chunk of
    each named state (whole blocks, aligned for O_DIRECT). A parameter read takes a
    whole slot as its staging area from `free` (one per read in flight)."""

    def __init__(self, count: int, numel: int, layout: dict[str, torch.dtype],
                 least_bytes: int):
        self.numel = numel
        self.offsets, total = {}, 0
        for name, dtype in layout.items():
            self.offsets[name] = (total, dtype)
            total += blocks(numel * dtype.itemsize)
        self.nbytes = max(total, blocks(least_bytes))
        self.raw = [aligned_buffer(self.nbytes) for _ in range(count)]
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for raw in self.raw:
            self.free.put(raw)

    def view(self, slot: int, name: str, n: int) -> torch.Tensor:
        """The first `n` elements of state `name` in slot `slot`."""
        offset, dtype = self.offsets[name]
        return self.raw[slot][offset:offset + n * dtype.itemsize].view(dtype)

    def io(self, slot: int, name: str, n: int) -> torch.Tensor:
        """The whole blocks that hold those elements: what a transfer moves."""
        offset, dtype = self.offsets[name]
        return self.raw[slot][offset:offset + blocks(n * dtype.itemsize)]

    @contextlib.contextmanager
    def staging(self):
        raw = self.free.get()
        try:
            yield raw
        finally:
            self.free.put(raw)


def copy_through(folder: DiskFolder, way: str, f, data: torch.Tensor, staging: torch.Tensor,
                 kind: str, offset: int = 0) -> None:
    """Move the bytes of `data` (a contiguous tensor, any alignment) to or from file `f`
    at `offset`, one staging buffer at a time, on this thread. The copies are memmove's,
    not torch's: a torch operation on an I/O thread starts an OpenMP team of that
    thread's own, sized to the machine, whose threads spin on the cores the ranks compute
    on (measured: forward and backward 50% slower). (Nor numpy's: a numpy view of a
    shard would pin its storage, which is freed between gathers.)"""
    nbytes = data.numel() * data.element_size()
    where, staged = data.data_ptr(), staging.data_ptr()
    for start in range(0, nbytes, staging.numel()):
        n = min(staging.numel(), nbytes - start)
        io = staging[:blocks(n)]
        if way == "read":
            folder.transfer("read", f, offset + start, io, kind)
            ctypes.memmove(where + start, staged, n)
        else:
            ctypes.memmove(staged, where + start, n)
            ctypes.memset(staged + n, 0, blocks(n) - n)
            folder.transfer("written", f, offset + start, io, kind)


def slot_layout(precision: Precision, spec: OptimizerSpec, params: bool) -> dict[str, torch.dtype]:
    """What one slot holds for the step, per element: the master copy if it lives on disk
    (an fp32 copy where the precision keeps one; in fp32, with the parameters on disk, the
    parameter itself), the optimizer's states in the master's dtype, and, for bf16
    parameters on disk beside an fp32 master, the updated parameter to write back."""
    master = torch.float32 if precision.master_weights else precision.param_dtype
    layout = {"master": master} if precision.master_weights or params else {}
    layout.update({name: master for name in state_names(spec)})
    if params and precision.master_weights:
        layout["param"] = precision.param_dtype
    return layout


class DiskTier:
    """One rank's disk tier: its folder, its slots, and the files of every flat buffer
    (`buffer.shard`, a 1-D parameter of `shard_numel` elements) it was given."""

    def __init__(self, options: DiskOptions, precision: Precision, spec: OptimizerSpec,
                 rank: int):
        self.options = options
        self.names = state_names(spec)
        # What the optimizer steps: an fp32 copy where the precision keeps one, else the
        # parameter itself (fp32, or bf16 without master weights), in memory or on disk.
        self.param_dtype = precision.param_dtype
        self.master_dtype = torch.float32 if precision.master_weights else self.param_dtype
        self.master_on_disk = precision.master_weights or options.params
        self.folder = DiskFolder(options.folder, rank, direct_io=options.direct_io,
                                 keep=options.keep)
        self.slots = Slots(options.buffers, options.buffer_numel,
                           slot_layout(precision, spec, options.params),
                           least_bytes=options.buffer_numel * self.param_dtype.itemsize)
        self.files: dict[int, dict[str, Any]] = {}  # id(buffer) -> {state: StateFile}

    def add(self, name: str, buffer) -> None:
        """Make the files of one flat buffer (a unit's trainable or frozen shard) and write
        what starts on disk: the parameter shard (then freed in memory) and the master
        copy. The optimizer's states start as zeros, which a new file reads as."""
        shard, numel = buffer.shard.detach(), buffer.shard_numel
        files = {}
        if self.options.params:
            files["param"] = self.folder.new_file(f"{name}.param",
                                                  numel * self.param_dtype.itemsize)
        if buffer.requires_grad:
            if self.master_on_disk:
                files["master"] = (files["param"] if self.master_dtype == self.param_dtype
                                   else self.folder.new_file(f"{name}.master", numel * 4))
            for state in self.names:
                files[state] = self.folder.new_file(f"{name}.{state}",
                                                    numel * self.master_dtype.itemsize)
        with self.slots.staging() as staging:
            if "param" in files:
                copy_through(self.folder, "written", files["param"], shard, staging, "setup")
            if "master" in files and files["master"] is not files.get("param"):
                C = self.options.buffer_numel
                for a in range(0, numel, C):
                    copy_through(self.folder, "written", files["master"],
                                 shard[a:a + C].float(), staging, "setup", offset=4 * a)
        self.files[id(buffer)] = files
        if self.options.params:
            shard.untyped_storage().resize_(0)

    def ready(self) -> None:
        self.folder.ready()


# ----------------------------------------------------------------------------- parameters


class ParamsOnDisk:
    """The parameter shards of every unit on disk, in memory only from just before their
    all-gather until it is done. As a unit asks for its shards, the read of the unit that
    the last step asked for next starts (forward, then backward, in the order they ran),
    so that it is in flight while this unit gathers and computes: the order FSDP2
    prefetches its all-gathers in."""

    def __init__(self, tier: DiskTier | None = None):
        self.tier = tier  # given once the units that ask it exist
        self.pending: dict[int, Any] = {}  # id(unit) -> future of its read
        self.resident: set[int] = set()
        self.asked: list = []              # the units asked for this step, in order
        self.last_asked: list = []         # ... and in the last one

    def bring_in(self, unit, read_ahead: bool = True) -> None:
        """This unit's shards in memory: read now, or the read started ahead waited for."""
        if read_ahead:
            self.asked.append(unit)
            position = len(self.asked)
            if position < len(self.last_asked):
                self.start_read(self.last_asked[position])
        self.start_read(unit)
        future = self.pending.pop(id(unit), None)
        if future is not None:
            self.tier.folder.wait([future])

    def start_read(self, unit) -> None:
        if id(unit) in self.resident:
            return
        self.resident.add(id(unit))
        for b in unit.buffers:  # the storage is allocated here, filled on an I/O thread
            b.shard.untyped_storage().resize_(b.shard_numel * b.shard.element_size())
        self.pending[id(unit)] = self.tier.folder.submit(self._read, unit)

    def _read(self, unit) -> None:
        with self.tier.slots.staging() as staging:
            for b in unit.buffers:
                copy_through(self.tier.folder, "read", self.tier.files[id(b)]["param"],
                             b.shard.detach(), staging, "gathers")

    def release(self, unit) -> None:
        """The gathers have read the shards: free them (the files hold the same values)."""
        if id(unit) in self.pending:
            self.tier.folder.wait([self.pending.pop(id(unit))])
        for b in unit.buffers:
            b.shard.detach().untyped_storage().resize_(0)
        self.resident.discard(id(unit))

    def end_of_step(self) -> None:
        """Every read of this step done (one started ahead for a unit that never asked is
        waited for and freed); the next step reads ahead in this step's order."""
        for uid in list(self.pending):
            self.tier.folder.wait([self.pending.pop(uid)])
        if self.asked:
            self.last_asked, self.asked = self.asked, []

    @contextlib.contextmanager
    def brought_in(self, unit):
        """The unit's shards in memory for the block (a full gather outside the step)."""
        was_resident = id(unit) in self.resident
        self.bring_in(unit, read_ahead=False)
        try:
            yield
        finally:
            if not was_resident:
                self.release(unit)


# ----------------------------------------------------------------------------- the step


class StreamedOptimizer(InnerOptimizerFace):
    """The optimizer step of a rank whose optimizer states are on disk.

    `self.optimizer` is a torch.optim optimizer of the spec's class over one placeholder
    parameter: for every chunk, the placeholder *is* the chunk (its master copy, in a slot
    or in memory), its gradient the chunk of the shard's gradient, and its state the
    chunk's m and v in the slot. The optimizer's own update then runs on the chunk, with
    the hyperparameters of its param_groups (a scheduler sees them as usual)."""

    def __init__(self, tier: DiskTier, buffers: list, spec: OptimizerSpec,
                 params_on_disk: ParamsOnDisk | None = None):
        self.tier, self.buffers = tier, buffers
        self.params_on_disk = params_on_disk
        # the optimizer steps the slots in host memory, where the disk's reads land
        self.placeholder = nn.Parameter(torch.empty(0, dtype=tier.master_dtype, device="cpu"))
        self.optimizer = spec.build([self.placeholder])
        self.clip: GradClip | None = spec.clipper(sharded=True)
        self.steps = {id(b): 0 for b in buffers}  # the optimizer's step count per shard

    def chunks(self) -> list[tuple[Any, int, int]]:
        """(buffer, first element, elements) of every chunk to step, in order."""
        C = self.tier.options.buffer_numel
        return [(b, a, min(C, b.shard_numel - a)) for b in self.buffers
                if b.shard.grad is not None for a in range(0, b.shard_numel, C)]

    @torch.no_grad()
    def step(self) -> None:
        if self.params_on_disk is not None:
            self.params_on_disk.end_of_step()  # no read of the forward/backward in flight
        if self.clip is not None:
            self.clip.clip(b.shard.grad for b in self.buffers)
        chunks, K = self.chunks(), self.tier.options.buffers
        ahead = max(K - 2, 0)  # one slot stepped, one written back, the rest read ahead
        reads: dict[int, list] = {}
        writes: dict[int, list] = {j: [] for j in range(K)}
        for j in range(min(ahead, len(chunks))):
            reads[j] = self._read(j, chunks[j], writes)
        for j, chunk in enumerate(chunks):
            if j + ahead < len(chunks) and j + ahead not in reads:
                reads[j + ahead] = self._read(j + ahead, chunks[j + ahead], writes)
            self.tier.folder.wait(reads.pop(j))
            self._step_chunk(j % K, *chunk)
            writes[j % K] = self._write(j % K, *chunk)
        self.tier.folder.wait([f for pending in writes.values() for f in pending])
        for b in {id(b): b for b, _, _ in chunks}.values():
            self.steps[id(b)] += 1

    def _disk_states(self) -> list[str]:
        return (["master"] if self.tier.master_on_disk else []) + list(self.tier.names)

    def _read(self, j: int, chunk, writes) -> list:
        slot = j % self.tier.options.buffers
        self.tier.folder.wait(writes[slot])  # the slot's last chunk is on disk
        writes[slot] = []
        b, a, n = chunk
        files = self.tier.files[id(b)]
        offset = a * self.tier.master_dtype.itemsize
        return [self.tier.folder.read(files[s], offset, self.tier.slots.io(slot, s, n), "step")
                for s in self._disk_states()]

    def _write(self, slot: int, b, a: int, n: int) -> list:
        files = self.tier.files[id(b)]
        tier = self.tier
        out = [tier.folder.write(files[s], a * tier.master_dtype.itemsize,
                                 tier.slots.io(slot, s, n), "step")
               for s in self._disk_states()]
        if "param" in tier.slots.offsets:  # bf16 parameters apart from the master
            out.append(tier.folder.write(files["param"], a * tier.param_dtype.itemsize,
                                         tier.slots.io(slot, "param", n), "step"))
        return out

    def _step_chunk(self, slot: int, b, a: int, n: int) -> None:
        view = self.tier.slots.view
        shard = b.shard.detach()
        master = view(slot, "master", n) if self.tier.master_on_disk else shard[a:a + n]
        grad = b.shard.grad[a:a + n]
        p = self.placeholder
        p.data = master
        p.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        state = {name: view(slot, name, n) for name in self.tier.names}
        state["step"] = torch.tensor(float(self.steps[id(b)]), dtype=torch.float32,
                                     device="cpu")  # where AdamW keeps its step count
        self.optimizer.state[p] = state
        self.optimizer.step()
        if "param" in self.tier.slots.offsets:
            view(slot, "param", n).copy_(master)
        elif self.tier.master_on_disk and not self.tier.options.params:
            shard[a:a + n].copy_(master)  # the parameter, in memory, from its master
        p.grad = None
        p.data = torch.empty(0, dtype=master.dtype, device=master.device)
        self.optimizer.state.pop(p, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buffers:
            if set_to_none:
                b.shard.grad = None
            elif b.shard.grad is not None:
                b.shard.grad.zero_()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds of the optimizer: the slots (`shardlab.measure`)."""
        return {"optimizer": list(self.tier.slots.raw)}

    def state_dict(self) -> dict:
        raise ValueError(f"the optimizer's states are on disk in {self.tier.options.folder!r}: "
                         f"their state_dict is not built; train without offload to save it")

    load_state_dict = state_dict
