"""One writer per checkpoint folder: an advisory lock, held by the launching process.

Two runs saving into one folder would each take the other's `step-N.tmp` for an
interrupted save and remove it (a save cleans what it finds), so one of them dies with a
`FileNotFoundError` that explains nothing. The lock refuses the second run before it
trains, naming the first (its pid, host and start time, written in the lock file).

The lock is `fcntl.flock` on `<folder>/.shardlab.lock`: the kernel releases it when its
holder exits, however it exits (even by SIGKILL), so a lock file left by a dead run is
stale by construction: whoever can lock it owns it. The file stays; its content is the
holder's, rewritten by each new holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".shardlab.lock"


class FolderInUse(ValueError):
    """Another live run holds the folder's lock."""


def _describe_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on {holder['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet said who it is"


@contextlib.contextmanager
def writer_lock(folder: str | os.PathLike, what: str = "checkpoint_dir"):
    """Hold `folder`'s lock for the `with` block, or raise `FolderInUse` at once."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderInUse(f"{what} {str(folder)!r} is in use by another run "
                              f"({_describe_holder(path)}): wait for it to finish, or "
                              f"choose another {what}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.time()}).encode(), 0)
        yield path
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
