"""Write reports safely: a reader sees the old file or the whole new one, never half, and
``-o`` never destroys what the user did not mean to replace (docs/security.md).

- A regular file (or a new name) is written to a temporary file beside it and renamed over
  it. A replaced file keeps its mode; a new one gets the mode the umask allows (0666 & ~umask).
- A symlink is followed: its target is replaced, the link stays.
- A FIFO or a character device (``/dev/null``, ``/dev/stdout``, a terminal, a process
  substitution's pipe) is written through, as the shell's ``>`` would; it is never replaced.
- A folder, a block device or a socket is refused, and so is any input of the run, however it
  is spelled (the CLI passes them): ``output would overwrite input``.

Every problem is a one-line :class:`~traceclf.support.errors.TraceError` naming the output.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from traceclf.support.errors import TraceError


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Replace the file at ``path`` with ``data`` through a temporary file beside it (the path
    itself, not a symlink's target: caches use this). Keeps the mode of the file it replaces;
    a new file gets 0666 & ~umask. Raises OSError."""
    path = Path(path)
    try:
        st = path.stat() if path.is_file() and not path.is_symlink() else None
    except OSError:
        st = None
    _replace(path, data.encode("utf-8") if isinstance(data, str) else data, st)


def write_output(path: str | Path, data: str | bytes, *, inputs: Iterable[Path] = ()) -> None:
    """Write a report to ``path`` as described in the module docstring; raises TraceError."""
    target, st = check_output(path, inputs)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        if st is not None and not stat.S_ISREG(st.st_mode):
            _write_through(target, payload)
        else:
            _replace(target, payload, st)
    except OSError as e:
        raise TraceError(path, f"cannot write the report: {_reason(e)}") from None


def check_output(
    path: str | Path, inputs: Iterable[Path] = ()
) -> tuple[Path, os.stat_result | None]:
    """Where a report for ``path`` goes (symlinks followed) and what is there now (None:
    nothing yet); raises TraceError if it cannot or must not be written. Cheap: the CLI calls
    it before the analysis, so a bad ``-o`` fails in milliseconds, not after minutes."""
    if not str(path).strip():
        raise TraceError(None, "-o/--output: empty file name")
    path = Path(path)
    try:
        st = path.stat()  # follows symlinks, /dev/stdout's /proc links included
    except FileNotFoundError:
        st = None
    except (OSError, RuntimeError) as e:
        raise TraceError(path, f"cannot write the report: {_reason(e)}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise TraceError(path, "cannot write the report: is a folder")
        if stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode):
            return path, st  # written through, by the name given
        raise TraceError(path, f"cannot write the report: {_kind(st.st_mode)}")
    try:
        target = path.resolve()  # a symlink's target is what gets replaced
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise TraceError(path, f"cannot write the report: {_reason(e)}") from None
    if st is None and not target.parent.is_dir():
        raise TraceError(path, f"cannot write the report: no folder {target.parent}")
    if any(_same(target, st, Path(i)) for i in inputs):
        raise TraceError(path, "output would overwrite input")
    return target, st


def _same(target: Path, st: os.stat_result | None, other: Path) -> bool:
    """Whether ``target`` is the file ``other`` (by identity: hard links and every spelling)."""
    if st is not None and stat.S_ISREG(st.st_mode):
        with contextlib.suppress(OSError):
            o = other.stat()
            return (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino)
    with contextlib.suppress(OSError, RuntimeError):
        return other.resolve() == target
    return False


def _write_through(target: Path, payload: bytes) -> None:
    # O_APPEND-free, no O_TRUNC needed: a FIFO or device has no contents to cut.
    with open(target, "wb", buffering=0) as f:
        view = memoryview(payload)
        while view:
            view = view[f.write(view) :]


def _replace(target: Path, payload: bytes, st: os.stat_result | None) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as e:  # say where: the file itself was never reached
        raise OSError(e.errno, f"cannot create a file in {target.parent} ({e.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            if st is None:
                os.fchmod(f.fileno(), 0o666 & ~_umask())
            else:
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
                # Root replacing another user's file: keep it theirs (best effort).
                with contextlib.suppress(OSError):
                    if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                        os.fchown(f.fileno(), st.st_uid, st.st_gid)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status", encoding="ascii") as f:
            line = next(line for line in f if line.startswith("Umask:"))
        return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _kind(mode: int) -> str:
    if stat.S_ISBLK(mode):
        return "is a block device (refusing to write a report onto a disk)"
    if stat.S_ISSOCK(mode):
        return "is a socket"
    return "not a regular file"


def _reason(e: BaseException) -> str:
    if isinstance(e, RuntimeError) or getattr(e, "errno", None) == errno.ELOOP:
        return "symbolic link loop"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)
