"""The disk tier: one rank's states in files, moved through buffers by threads.

ZeRO-Infinity keeps what does not fit in a GPU's memory on NVMe drives, each GPU reading
and writing only its own 1/N (Rajbhandari et al., 2021). On a CPU machine the tiers shift
by one: the process's memory plays the GPU's part and a disk plays NVMe's. This module is
the disk's side of it, and knows nothing of models:

* a *state file* holds one tensor of this rank (a unit's shard of Adam's m, say), whole
  4 KiB blocks of it, so that any chunk of a multiple of 4 KiB starts on a block;
* reads and writes run on a few threads (`os.preadv` / `os.pwritev` release the GIL), so a
  read is in flight while the main thread computes; `read` and `write` return a future,
  `wait` ends it;
* with `direct_io` (the default) the files are opened with O_DIRECT, as DeepSpeed's
  async-I/O op opens them (`csrc/aio/common/deepspeed_aio_utils.cpp`): the bytes cross to
  the disk, not to the kernel's page cache, which would keep the "offloaded" states in
  memory after all. O_DIRECT wants buffers, offsets and lengths in whole blocks:
  `aligned_buffer` gives such buffers;
* every byte moved is counted, by way (read, written) and what for ("setup", "gathers",
  "step");
* the files are unlinked as soon as they are open (unless kept on request): the kernel
  frees them when the process ends, however it ends (a killed rank leaves nothing), and
  nothing can ever read a half-written one;
* every failure of the disk (full, unwritable, a file truncated under the running job)
  is one line, `DiskTierError`, naming the folder and what to do.

`disk_bandwidth` measures reads and writes through this same path: the β of the disk in
the chapter's step-time model, as α-β measures the network's.
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

BLOCK = 4096            # bytes: the unit of O_DIRECT transfers (a page; most disks' sector)
IO_THREADS = 2          # one read and one write in flight at once
# what a transfer is for: the files' first writes, the all-gathers' parameter reads, the
# optimizer step's reads and writes
KINDS = ("setup", "gathers", "step")


class DiskTierError(RuntimeError):
    """A failure of the disk tier, said in one line: the folder and what to do."""


def blocks(nbytes: int) -> int:
    """`nbytes` rounded up to whole blocks: what a transfer of them moves."""
    return -(-nbytes // BLOCK) * BLOCK


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` (whole blocks) of uint8 whose first byte sits on a block boundary, as
    O_DIRECT requires (PyTorch's CPU allocator aligns to 64 bytes only)."""
    raw = torch.empty(blocks(nbytes) + BLOCK, dtype=torch.uint8, device="cpu")  # host I/O
    skip = -raw.data_ptr() % BLOCK
    return raw[skip:skip + blocks(nbytes)]


class StateFile:
    """One tensor of this rank on disk: `nbytes` (whole blocks) at `path`, open as `fd`."""

    def __init__(self, folder: "DiskFolder", name: str, nbytes: int):
        self.folder, self.name = folder, name
        self.nbytes = blocks(nbytes)
        self.path = folder.path / name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if folder.direct_io else 0)
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise folder.failure(exc, "creating", self.path) from None
        try:
            # Reserve the blocks now: a disk without room says so before the first step,
            # and the run's writes later overwrite blocks it already owns.
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.ftruncate(self.fd, self.nbytes)  # a file system that cannot reserve
            else:
                os.close(self.fd)
                self.path.unlink(missing_ok=True)  # never leave a half-made file behind
                raise folder.failure(exc, f"reserving {_mib(self.nbytes)} for",
                                     self.path) from None

    def on_disk(self) -> int:
        """The bytes the file system gave this file (its blocks)."""
        return os.fstat(self.fd).st_blocks * 512


class DiskFolder:
    """This rank's state files in `root`, the threads that move them, and the counts.

    The files are named `shardlab-offload-<pid>-rank<r>-...` in a folder of that name;
    unless `keep`, each is unlinked once open and the folder removed, so that the files
    live exactly as long as this process (kept, they stay after the run for a reader to
    look at, and are theirs to remove)."""

    _serial = itertools.count()

    def __init__(self, root: str | os.PathLike, rank: int, *, direct_io: bool = True,
                 keep: bool = False):
        self.root = Path(root)
        self.direct_io, self.keep = direct_io, keep
        self.path = self.root / f"shardlab-offload-{os.getpid()}-rank{rank}-{next(self._serial)}"
        try:
            self.path.mkdir(parents=True)
        except OSError as exc:
            raise self.failure(exc, "creating", self.path) from None
        self.files: list[StateFile] = []
        self.moved = {(way, kind): 0 for way in ("read", "written") for kind in KINDS}
        self.waited = 0.0  # seconds the main thread spent waiting for transfers
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="shardlab-disk")
        # closed when dropped too: a process that wraps several models in turn (a test)
        # gets each one's threads and disk space back
        self._fds: list[int] = []
        self._closer = weakref.finalize(self, _close, self._pool, self._fds)
        if direct_io:
            try:
                self._check_direct_io()
            except DiskTierError:
                self.close()
                shutil.rmtree(self.path, ignore_errors=True)
                raise

    # -------------------------------------------------------------------- files

    def new_file(self, name: str, nbytes: int) -> StateFile:
        try:
            f = StateFile(self, name, nbytes)
        except DiskTierError:
            self.close()
            if not self.keep:
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        self.files.append(f)
        self._fds.append(f.fd)
        if not self.keep:
            os.unlink(f.path)
        return f

    def ready(self) -> None:
        """Every file exists: unless kept, remove the folder (its files are unlinked)."""
        if not self.keep:
            self.path.rmdir()

    def on_disk(self) -> int:
        return sum(f.on_disk() for f in self.files)

    def close(self) -> None:
        """Stop the threads and close the files (unlinked ones are freed now)."""
        self._closer()

    # -------------------------------------------------------------------- transfers

    def submit(self, fn, *args) -> Future:
        """Run `fn(*args)` on an I/O thread (a job of several transfers)."""
        return self._pool.submit(fn, *args)

    def read(self, f: StateFile, offset: int, buffer: torch.Tensor, kind: str) -> Future:
        """Start reading `buffer.numel()` bytes of `f` at `offset` into `buffer` (uint8,
        whole blocks, aligned)."""
        return self._pool.submit(self.transfer, "read", f, offset, buffer, kind)

    def write(self, f: StateFile, offset: int, buffer: torch.Tensor, kind: str) -> Future:
        """Start writing `buffer` (uint8, whole blocks, aligned) into `f` at `offset`."""
        return self._pool.submit(self.transfer, "written", f, offset, buffer, kind)

    def wait(self, futures) -> None:
        """Wait for transfers; their time is what the disk adds to the step."""
        start = time.perf_counter()
        for future in futures:
            future.result()
        self.waited += time.perf_counter() - start

    def transfer(self, way: str, f: StateFile, offset: int, buffer: torch.Tensor,
                 kind: str) -> None:
        """Move `buffer` to or from `f` at `offset`, on this thread, and count it."""
        view = memoryview(buffer.numpy())
        done = 0
        while done < len(view):
            try:
                if way == "read":
                    n = os.preadv(f.fd, [view[done:]], offset + done)
                else:
                    n = os.pwritev(f.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise self.failure(exc, "reading" if way == "read" else "writing",
                                   f.path) from None
            if n == 0:  # the file ends before what this rank wrote there
                raise DiskTierError(
                    f"{f.path} ends at byte {offset + done} of the {f.nbytes} this run "
                    f"wrote (truncated or replaced under the running job): the states in "
                    f"offload_dir {str(self.root)!r} are lost; let nothing else write "
                    f"there, and train again from the start or from a checkpoint")
            done += n
        with self._lock:
            self.moved[(way, kind)] += len(view)

    # -------------------------------------------------------------------- failures

    def failure(self, exc: OSError, doing: str, path: Path) -> DiskTierError:
        """The one line for an OSError of the disk: what failed, where, what to do."""
        where = f"offload_dir {str(self.root)!r}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskTierError(f"{where} is full ({exc.strerror}) {doing} {path.name}: "
                                 f"free space there or choose another offload_dir "
                                 f"(this rank's states need {_mib(self.needed())})")
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
                         errno.ENOTDIR):
            return DiskTierError(f"{where} cannot be written ({exc.strerror}) {doing} "
                                 f"{path}: choose a folder on a disk this user can write")
        return DiskTierError(f"{where}: {exc.strerror} {doing} {path}: check the disk, or "
                             f"choose another offload_dir")

    def needed(self) -> int:
        return sum(f.nbytes for f in self.files)

    def _check_direct_io(self) -> None:
        kind = file_system(self.path)
        if kind in MEMORY_FILE_SYSTEMS:
            raise DiskTierError(
                f"offload_dir {str(self.root)!r} is on a {kind}, which is memory, not disk: "
                f"choose a folder on a disk (or set direct_io=False to keep the states "
                f"there knowingly)")
        probe = self.path / ".direct-io-probe"
        refused = False
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                os.pwritev(fd, [memoryview(aligned_buffer(BLOCK).numpy())], 0)
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise self.failure(exc, "writing", probe) from None
            refused = True
        finally:
            probe.unlink(missing_ok=True)
        if refused:
            raise DiskTierError(
                f"offload_dir {str(self.root)!r} is on a file system ({kind}) that refuses "
                f"direct I/O (O_DIRECT): choose a folder on another disk, or set "
                f"direct_io=False (the kernel's page cache then keeps recently moved "
                f"blocks in memory)")


# File systems whose files live in memory: a disk tier there is no disk tier.
MEMORY_FILE_SYSTEMS = {"tmpfs", "ramfs"}


def file_system(path: Path) -> str:
    """The type of the file system that holds `path` (Linux's /proc/self/mounts: the
    mount point that is the longest prefix of its real path), or "unknown"."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def disk_bandwidth(root: str | os.PathLike, nbytes: int = 64 << 20,
                   chunk_bytes: int = 4 << 20, direct_io: bool = True,
                   repeats: int = 3) -> dict[str, float]:
    """Bytes per second this machine's disk at `root` writes and reads through the disk
    tier's own path (`chunk_bytes` per transfer, `IO_THREADS` threads, O_DIRECT or not):
    the best of `repeats` passes over a file of `nbytes`, written then read."""
    folder = DiskFolder(root, rank=0, direct_io=direct_io)
    try:
        f = folder.new_file("bandwidth", nbytes)
        folder.ready()
        buffers = [aligned_buffer(chunk_bytes) for _ in range(IO_THREADS)]
        for b in buffers:
            b.fill_(1)
        offsets = range(0, f.nbytes - chunk_bytes + 1, chunk_bytes)
        best = {"write": 0.0, "read": 0.0}
        for _ in range(repeats):
            for way, move in (("write", folder.write), ("read", folder.read)):
                start = time.perf_counter()
                pending = [move(f, off, buffers[i % len(buffers)], "step")
                           for i, off in enumerate(offsets)]
                folder.wait(pending)
                if way == "write":
                    os.fsync(f.fd)
                seconds = time.perf_counter() - start
                best[way] = max(best[way], len(offsets) * chunk_bytes / seconds)
        return best
    finally:
        folder.close()


def _close(pool: ThreadPoolExecutor, fds: list[int]) -> None:
    pool.shutdown(wait=True)
    for fd in fds:
        os.close(fd)
    fds.clear()


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


__all__ = ["BLOCK", "DiskTierError", "DiskFolder", "StateFile", "aligned_buffer", "blocks",
           "disk_bandwidth"]
