"""Imported by the fork server alone (`starter.PRELOAD`): the server keeps out of the
launching process's signals, and removes the folder of its socket when it ends.

multiprocessing makes that folder (`/tmp/pymp-*`, `util.get_temp_dir`) in the launching
process when it starts the server, and removes it when that process exits normally. A
launching process killed outright (kill -9 of a script, a notebook kernel that its client
stops with a signal to the kernel's process group) leaves it behind: 26 of them after one
run of the test suite. The server's loop ends when the launching process and every rank
have closed the pipe it watches, which only their deaths do (a server replaced on purpose
is stopped by a signal: `starter`), so the server is the one left to remove the folder
(or the launch's reaper, if the launching process dies during a launch: `hygiene`). For
that it must outlive them: in a session of its own, a signal sent to the launching
process's process group (a notebook's client sends SIGTERM, then SIGKILL, to the kernel's)
does not reach it. A rank forked from the server leads a session of its own too, and never
exits through here.
"""

from __future__ import annotations

import atexit
import os
import shutil
from multiprocessing import forkserver

_SERVER = os.getpid()
os.setsid()


def _remove_socket_folder() -> None:
    if os.getpid() != _SERVER:
        return
    address = getattr(forkserver._forkserver, "_forkserver_address", None)
    folder = os.path.dirname(address) if isinstance(address, str) else ""
    if os.path.basename(folder).startswith("pymp-"):
        shutil.rmtree(folder, ignore_errors=True)


atexit.register(_remove_socket_folder)
