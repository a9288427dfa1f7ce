"""Read a small input file (a rule file, a saved report) without trusting what is at its path.

A FIFO would block a plain ``open`` forever and ``/dev/zero`` never ends: the file is opened
without blocking, must be a regular file, and is read up to a bound, so that whatever is at the
path costs at most that bound. Every problem is a one-line :class:`TraceError`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from traceclf.support.errors import TraceError


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file at ``path`` (links followed), if it holds at most
    ``limit`` bytes; ``what`` names it in messages ("rule file", "JSON report")."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise TraceError(path, f"cannot read {what}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TraceError(path, f"not a regular file (a {what} must be a plain file)")
        if st.st_size > limit:
            raise TraceError(path, f"{what} larger than {_size(limit)} ({st.st_size:,} bytes)")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise TraceError(path, f"cannot read {what}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while being read
        raise TraceError(path, f"{what} larger than {_size(limit)}")
    return data


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit:,} bytes"
