"""Write reports safely: a reader sees the old file or the whole new one, never half, and
``-o`` never destroys what the user did not mean to replace (docs/security.md).

- A regular file (or a new name) is written to a temporary file beside it and renamed over
  it. A replaced file keeps its mode; a new one gets the mode the umask allows (0666 & ~umask).
- A symlink is followed: its target is replaced, the link stays.
- A FIFO or a character device (``/dev/null``, ``/dev/stdout``, a terminal, a process
  substitution's pipe) is written through, as the shell's ``>`` would; it is never replaced.
- A folder, a block device or a socket is refused, and so is any input of the run, however it
  is spelled (the CLI passes them): ``output would overwrite input``.
- The files that go with a report under names traceclf derives (a Markdown report's figures,
  the ``--export-dir`` tables) are its own: only a regular file or nothing may be there. A
  symlink there is refused, never followed (someone else planted it), and so is a FIFO.
- Files that belong together (a report and its figures, the tables of ``--export-dir``) are
  written with :func:`written_together`: every one to its temporary first, then all renamed
  into place; a failure (a full disk) removes the temporaries, so they appear whole or not
  at all. Opened inside another, its files join the outer one's: the CLI opens one for the
  report, its tables and its trace file, so that a run that fails leaves none of them: a
  FIFO or device is written first, and a failure there leaves the other files unwritten.

Every problem is a one-line :class:`~traceclf.support.errors.TraceError` naming the output.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
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


class Together:
    """Files written as one: staged to temporaries by :meth:`add`, renamed into place by
    :meth:`publish`, or removed by :meth:`discard`."""

    def __init__(self, inputs: Iterable[Path]) -> None:
        self.inputs = list(inputs)
        self.staged: list[tuple[Path, Path]] = []  # (temporary, target)
        self.through: list[tuple[Path, bytes]] = []  # FIFOs and devices, written at the end
        self.folders: list[Path] = []  # made for the files: removed with them, if empty

    def made(self, folders: Iterable[Path]) -> None:
        """Folders made for these files (innermost first): removed, if empty, on discard."""
        self.folders = [*folders, *self.folders]

    def add(self, path: str | Path, data: str | bytes, *, named: bool = False) -> None:
        """Stage ``data`` for ``path``: ``named`` when the user named it (``-o``: links are
        followed, a FIFO or device is written through), else a name traceclf derived (only a
        regular file or nothing may be there). Raises TraceError."""
        payload = data.encode("utf-8") if isinstance(data, str) else data
        target, st = check_output(path, self.inputs) if named else check_derived(path, self.inputs)
        if st is not None and not stat.S_ISREG(st.st_mode):
            self.through.append((target, payload))
            return
        try:
            self.staged.append((_stage(target, payload, st), target))
        except OSError as e:
            raise TraceError(path, f"cannot write the report: {_reason(e)}") from None

    def publish(self) -> None:
        # FIFOs and devices first: a write that fails there (a full device, a reader gone)
        # cannot be taken back, and then the staged files must not appear either
        for target, payload in self.through:
            try:
                _write_through(target, payload)
            except OSError as e:
                self.discard()
                raise TraceError(target, f"cannot write the report: {_reason(e)}") from None
        for tmp, target in self.staged:
            try:
                os.replace(tmp, target)
            except OSError as e:
                self.discard()
                raise TraceError(target, f"cannot write the report: {_reason(e)}") from None
        self.staged = []

    def discard(self) -> None:
        for tmp, _target in self.staged:
            tmp.unlink(missing_ok=True)
        self.staged = []
        for folder in self.folders:
            with contextlib.suppress(OSError):
                folder.rmdir()
        self.folders = []


# the files being written together in this thread's context (None: none)
_STAGING: contextvars.ContextVar[Together | None] = contextvars.ContextVar(
    "traceclf_written_together", default=None
)


@contextlib.contextmanager
def written_together(inputs: Iterable[Path] = ()) -> Iterator[Together]:
    """Stage files with ``.add`` in the body; they are renamed into place when it ends, or
    all removed when it fails, so that they appear whole or not at all. Inside another
    ``written_together``, the files are staged with the outer one's (``inputs`` refused
    there too) and appear when it ends."""
    outer = _STAGING.get()
    if outer is not None:
        outer.inputs += [p for p in inputs if p not in outer.inputs]
        yield outer
        return
    files = Together(inputs)
    token = _STAGING.set(files)
    try:
        yield files
    except BaseException:
        files.discard()
        raise
    finally:
        _STAGING.reset(token)
    files.publish()


def check_derived(path: Path, inputs: Iterable[Path] = ()) -> tuple[Path, os.stat_result | None]:
    """Where a file traceclf names itself (a figure beside the report, an exported table)
    goes: that very path, if nothing or a regular file is there. A symlink is refused, never
    followed: traceclf did not make it, and following it would overwrite its target."""
    path = Path(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise TraceError(path, f"cannot write the report: {_reason(e)}") from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise TraceError(
            path,
            "is a symbolic link, and traceclf does not follow a link it did not make "
            "(remove it, or write the report elsewhere)",
        )
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "is a folder" if stat.S_ISDIR(st.st_mode) else _kind(st.st_mode)
        raise TraceError(path, f"cannot write the report: {kind}")
    if any(_same(path.absolute(), st, Path(i)) for i in inputs):
        raise TraceError(path, "output would overwrite input")
    return path, st


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
    tmp = _stage(target, payload, st)
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _stage(target: Path, payload: bytes, st: os.stat_result | None) -> Path:
    """``payload`` in a temporary file beside ``target``, with the mode ``target`` has (or a
    new file's), ready to be renamed over it; removed again if writing it fails."""
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
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


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
