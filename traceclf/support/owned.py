"""Files and folders of our own: a real folder or file (never reached through a link) that
this user owns and may write. Every cache write and deletion checks this, so that a link
planted in a cache can neither redirect a write nor a deletion (docs/security.md)."""

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
