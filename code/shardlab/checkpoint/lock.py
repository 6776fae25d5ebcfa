"""One writer per checkpoint folder: an advisory lock, held by the launching process.

Two runs saving into one folder would each take the other's `step-N.tmp` for an
interrupted save and remove it (a save cleans what it finds), so one of them dies with a
`FileNotFoundError` that explains nothing. The lock refuses the second run before it
trains, naming the first (its pid, host and start time, written in the lock file).

The lock is `fcntl.flock` on `<folder>/.shardlab.lock`: the kernel releases it when its
holder exits, however it exits (even by SIGKILL), so a lock file left by a dead run is
stale by construction: whoever can lock it owns it, and rewrites it with its own name. A
run that ends normally removes the file.
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
    """Hold `folder`'s lock for the `with` block, or raise `FolderInUse` at once. The lock
    file is removed on release, so a finished run leaves only its checkpoints."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = _locked(path, folder, what)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.time()}).encode(), 0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # still holding it: whoever opens the name next makes a new file
        os.close(fd)  # closing the last descriptor releases the lock


def _locked(path: Path, folder: Path, what: str) -> int:
    """A descriptor of `path` holding its lock. A run that released the lock removes the
    file; one that opened it just before then holds the lock of a file that no longer
    has the name, and must open the name again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderInUse(f"{what} {str(folder)!r} is in use by another run "
                              f"({_describe_holder(path)}): wait for it to finish, or "
                              f"choose another {what}") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
