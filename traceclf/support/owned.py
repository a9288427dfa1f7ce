"""Files and folders of our own: a real folder or file (never reached through a link) that
this user owns and may write. Every cache write and deletion checks this, so that a link
planted in a cache can neither redirect a write nor a deletion (docs/security.md). And the
first bytes of a file, read only if it is a regular one (a FIFO is never opened blocking)."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def is_owned(path: Path, kind: str = "dir") -> bool:
    """Whether ``path`` is a real (not linked) folder or file, as ``kind`` says, owned by us."""
    try:
        st = path.lstat()
    except OSError:
        return False
    right_kind = stat.S_ISDIR(st.st_mode) if kind == "dir" else stat.S_ISREG(st.st_mode)
    return right_kind and st.st_uid == os.geteuid()


def usable_root(root: Path, *, create: bool) -> bool:
    """Whether the cache root is a folder we may write into (creating it when asked)."""
    if create and not root.exists() and not root.is_symlink():
        with contextlib.suppress(OSError):
            root.mkdir(parents=True, exist_ok=True)
    return root.is_dir() and writable(root)


def writable(folder: Path) -> bool:
    """access(2) plus a write bit, so a folder made read-only on purpose stays untouched even
    for root, whom access(2) always allows."""
    try:
        return os.access(folder, os.W_OK) and bool(folder.stat().st_mode & 0o222)
    except OSError:
        return False


def read_head(path: Path, size: int, offset: int = 0) -> bytes | None:
    """``size`` bytes from ``offset`` of the regular file at ``path``; None for anything else
    (missing, unreadable, a FIFO or a device: opened without blocking, never read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.pread(fd, size, offset)
    except OSError:
        return None
    finally:
        os.close(fd)
