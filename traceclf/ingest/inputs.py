"""What the user named on the command line -> the SQLite exports to analyse.

Accepts export files (any name: an SQLite file called run.db is fine), nsys reports
(``.nsys-rep``, older ``.qdrep``; exported once, see :mod:`traceclf.ingest.nsys`), folders of them
(not recursive) and glob patterns the shell left unexpanded. The result is deduplicated and in
natural order, so rank_2 comes before rank_10 whatever order the shell produced.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from traceclf.ingest.exportstamp import is_export_of, made_by_traceclf
from traceclf.ingest.nsys import REPORT_SUFFIXES, beside_export, export_report, report_key
from traceclf.ingest.schema import is_sqlite_file
from traceclf.support.errors import TraceError, TraceWarning

EXPORT_SUFFIX = ".sqlite"
GLOB_CHARS = re.compile(r"[*?\[]")


def resolve_inputs(
    inputs: list[str],
    *,
    nsys: Path | None = None,
    cache_dir: Path | None = None,
    quiet: bool = False,
) -> list[Path]:
    """The SQLite exports named by ``inputs``, exporting reports with nsys where needed.

    Raises :class:`~traceclf.support.errors.TraceError` for a missing path, a folder or pattern with
    no exports, a file that is neither a report nor an SQLite database, or a failed export.
    """
    sources = export_sources(chosen_files(inputs), nsys=nsys, cache_dir=cache_dir, quiet=quiet)
    return [export for export, _named in sources]


def chosen_files(inputs: list[str]) -> list[Path]:
    """The files of ``inputs`` to analyse, one per run, in natural order, reports not yet
    exported (:func:`export_sources`): one export each. Raises TraceError like
    :func:`resolve_inputs` for inputs that are bad."""
    if not inputs:
        raise TraceError(None, "no input given (a .sqlite export, a .nsys-rep or a folder)")
    files = _unique(f for arg in inputs for f in _expand(arg))
    return sorted(_one_per_run(files), key=natural_key)


def named_order(inputs: list[str]) -> dict[Path, int]:
    """Each file's place in what the user named, by resolved path: the arguments in the order
    given, the files of a folder or pattern in natural order. Unrelated runs are reported in
    this order; the ranks of one job keep :func:`chosen_files`' natural order (rank_2 before
    rank_10 whatever order the shell produced)."""
    order: dict[Path, int] = {}
    for arg in inputs:
        for path in sorted(_expand(arg), key=natural_key):
            order.setdefault(path.resolve(), len(order))
    return order


def export_sources(
    files: list[Path],
    *,
    nsys: Path | None = None,
    cache_dir: Path | None = None,
    quiet: bool = False,
) -> list[tuple[Path, Path]]:
    """Each of :func:`chosen_files` paired with its export: ``(export, file)``, where the
    export of a ``.nsys-rep`` is the one traceclf made into its cache, else the file itself."""
    return [
        (export_report(f, nsys=nsys, cache_dir=cache_dir, quiet=quiet), f)
        if is_report(f)
        else (f, f)
        for f in files
    ]


def named_files(inputs: list[str]) -> list[Path]:
    """Every file ``inputs`` name as they are now (folders and patterns expanded, nothing
    exported), plus the export beside each report: what a report written with ``-o`` must
    never replace. Raises TraceError like :func:`resolve_inputs` for inputs that are bad."""
    files = [f for arg in inputs for f in _expand(arg)]
    return files + [beside_export(f) for f in files if is_report(f)]


def natural_key(path: Path) -> list[str | int]:
    """Sort key that orders digit runs by value: rank_2 < rank_10."""
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", str(path))]


def is_report(path: Path) -> bool:
    """An nsys report (by name) that is not secretly an SQLite export already."""
    return path.suffix.lower() in REPORT_SUFFIXES and not is_sqlite_file(path)


def _expand(arg: str) -> Iterator[Path]:
    if not arg.strip():
        raise TraceError(None, "empty input name")
    path = Path(arg).expanduser()
    try:
        folder, there = path.is_dir(), path.exists()
    except OSError as e:  # (a name too long for the file system, ...)
        raise TraceError(path, f"cannot open: {e.strerror}") from None
    if folder:
        yield from _scan_folder(path)
    elif there:
        yield _checked_file(path)
    elif GLOB_CHARS.search(arg):
        matches = sorted(glob.glob(str(path)))
        if not matches:
            raise TraceError(arg, "no file matches this pattern")
        # As if the shell had expanded it: every match is an input of its own.
        for match in matches:
            yield from _expand(match)
    else:
        raise TraceError(path, _missing(path))


def _missing(path: Path) -> str:
    """Why ``path`` cannot be opened, as precisely as the file system says: a symlink loop
    and a broken link are not "no such file"."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "symbolic link loop"
        if e.errno == errno.ENOENT and path.is_symlink():
            return f"broken symbolic link (to {os.readlink(path)}, which does not exist)"
        if e.errno not in (errno.ENOENT, None):
            return f"cannot open: {e.strerror}"
    return "no such file or directory"


def _scan_folder(folder: Path) -> list[Path]:
    """The exports and reports directly in ``folder``; hidden files are traceclf's temporaries."""
    suffixes = (EXPORT_SUFFIX, *REPORT_SUFFIXES)
    try:
        entries = list(folder.iterdir())
    except OSError as e:
        raise TraceError(folder, f"cannot read folder: {e.strerror or e}") from None
    found = [
        p
        for p in entries
        if p.suffix.lower() in suffixes and not p.name.startswith(".") and p.is_file()
    ]
    if not found:
        raise TraceError(folder, "folder holds no .sqlite or .nsys-rep files")
    # (in natural order, as the user reads the folder: of two names of one file, the first is
    # the one kept)
    return sorted(found, key=natural_key)


def _checked_file(path: Path) -> Path:
    """``path`` if it can be an export or a report; the content decides, not the name."""
    if not path.is_file():
        raise TraceError(path, "not a regular file")
    known = path.suffix.lower() in (EXPORT_SUFFIX, *REPORT_SUFFIXES)
    if not known and not is_sqlite_file(path):
        raise TraceError(
            path,
            "neither an nsys report (.nsys-rep) nor an SQLite export "
            "(make one with: nsys export --type sqlite REPORT.nsys-rep)",
        )
    return path


def _unique(paths: Iterable[Path]) -> list[Path]:
    """First occurrence of each file, however it was named (relative, absolute, via a link);
    each other name of it is dropped with a warning, as a copy of a capture is (README)."""
    seen: dict[Path, Path] = {}
    for path in paths:
        first = seen.setdefault(path.resolve(), path)
        if first is not path:
            same = "named twice" if first == path else f"the same file as {first}"
            warnings.warn(f"{path}: {same}: analysed once", TraceWarning, stacklevel=2)
    return list(seen.values())


def _one_per_run(files: list[Path]) -> list[Path]:
    """Drop one of ``run.nsys-rep`` + ``run.sqlite`` when both were named, since they are one
    run: the export when it is current (made from this report, or newer than it), else the
    report, to be exported afresh."""
    exports = {f.resolve(): f for f in files if not is_report(f)}
    dropped = set()
    for report in filter(is_report, files):
        export = exports.get(beside_export(report).resolve())
        if export is None:
            continue
        dropped.add(report if _is_current(export, report) else export)
    return [f for f in files if f not in dropped]


def _is_current(export: Path, report: Path) -> bool:
    if made_by_traceclf(export):
        return is_export_of(export, report_key(report))
    return export.stat().st_mtime_ns >= report.stat().st_mtime_ns
