"""Why a save failed, in one line: a full disk, a permission lost, a folder removed.

A save that fails halfway loses nothing (the folder keeps its `.tmp` name until the last
step renames it), but what PyTorch raises rarely says why. A full disk reaches DCP as a
short write inside `torch.save`'s zip writer (`[enforce fail at inline_container.cc:672]
. unexpected pos 704 vs 598`), wrapped in a `CheckpointException` that carries each rank's
traceback; a read-only remount or a removed folder as an `OSError` somewhere in that
chain. So the cause is read from both: the errno of any `OSError` in the chain, and the
state of the folder after the failure (gone, full, no longer writable). The line names
the folder, the step and the newest complete checkpoint, which is where a resume starts.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from shardlab.manifest import CheckpointError


# Below this, a write that failed is taken to have failed for space: a checkpoint shard
# is rarely smaller, and a file system this full fails the next save anyway.
NEARLY_FULL_BYTES = 1 << 20
# What torch's zip writer raises when the disk fills: it wrote fewer bytes than it asked.
SHORT_WRITE = "unexpected pos"
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_NO_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}


def causes(exc: BaseException) -> list[BaseException]:
    """`exc` and everything behind it: DCP's per-rank failures, `__cause__`, `__context__`."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, CheckpointException):
            todo.extend(cause for cause, _ in e.failures.values())
        todo.extend([e.__cause__, e.__context__])
    return seen


def free_bytes(folder: Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def can_write(folder: Path) -> bool:
    probe = folder / f".shardlab-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError:
        return False
    return True


def why(root: Path, exc: BaseException) -> str:
    """The cause of a failed save in a few words, then what was raised (its first line)."""
    chain = causes(exc)
    numbers = {e.errno for e in chain if isinstance(e, OSError) and e.errno}
    texts = " ".join(str(e) for e in chain)
    first = next((e for e in chain if not isinstance(e, CheckpointException)), exc)
    raised = (str(first).strip().splitlines() or [""])[0][:200]
    raised = f"{type(first).__name__}: {raised}" if raised else type(first).__name__
    free = free_bytes(root)
    if not root.is_dir():
        reason = "the folder was removed while the run was writing it"
    elif numbers & _NO_SPACE or SHORT_WRITE in texts or (free is not None
                                                         and free < NEARLY_FULL_BYTES):
        reason = "no space left on the device"
    elif numbers & _NO_PERMISSION or not can_write(root):
        reason = "the folder can no longer be written (permission lost or read-only)"
    elif errno.ENOENT in numbers:
        reason = ("a file of the save was removed while it was written (is another "
                  "program cleaning this folder?)")
    else:
        reason = "the write failed"
    return f"{reason} ({raised})"


def newest_complete(root: Path, is_complete) -> Path | None:
    try:
        steps = [f for f in root.glob("step-*") if f.name.split("-", 1)[1].isdigit()]
    except OSError:
        return None
    steps.sort(key=lambda f: int(f.name.split("-", 1)[1]), reverse=True)
    return next((f for f in steps if is_complete(f)), None)


def save_failed(root: Path, step: int, tmp: Path, exc: BaseException,
                is_complete) -> CheckpointError:
    """One error for a save that failed: why, where, and where a resume would start.
    The unfinished `.tmp` folder is removed here (by every rank: what is left of it is
    nobody's), so nothing of the failed save stays behind to fill the disk."""
    reason = why(root, exc)  # before removing: the folder's state is part of the answer
    shutil.rmtree(tmp, ignore_errors=True)
    left = (f"the unfinished {tmp.name} could not be removed; remove it by hand"
            if tmp.exists() else f"the unfinished {tmp.name} was removed")
    last = newest_complete(root, is_complete) if root.is_dir() else None
    intact = (f"the last complete checkpoint is {last}" if last is not None
              else "there is no complete checkpoint")
    return CheckpointError(f"saving step {step} into {root} failed: {reason}; {left}; "
                           f"{intact}. Free space or fix the folder, or choose another "
                           f"checkpoint_dir, then resume")
