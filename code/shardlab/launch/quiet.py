"""What a library prints below Python, kept out of a rank's output.

Some libraries write to the process's stderr from C code (file descriptor 2), where
`contextlib.redirect_stderr` cannot reach: DeepSpeed's linker probe for libaio prints
"cannot find -laio", Kineto (the profiler) announces its start and stop. A notebook shows
such lines under the cell and nbval compares them, so the moments that print them write to
/dev/null instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Send what is written to stderr, by Python or by C code and subprocesses (file
    descriptor 2), to /dev/null while the block runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
