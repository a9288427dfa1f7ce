"""Where traceclf's caches live, which names in there it owns, and how it cleans them up.

One folder, the cache root, holds every cache: ``--cache-dir`` when given, else
``$TRACECLF_CACHE_DIR``, else the user's cache directory (platformdirs: ``~/.cache/traceclf``
on Linux, honouring ``$XDG_CACHE_HOME``; ``~/Library/Caches/traceclf`` on macOS). Nothing is
written beside the inputs unless the user puts the root there (``--cache-dir .``).

Names traceclf owns in the root, and the only names it ever deletes::

    <export name>-<16 hex>.traceclf/        one folder per export path (a "slot")
        .traceclf-made                      the marker traceclf wrote when it made the folder
        <32 hex>/                           the trace model of one version of the export
        results-<32 hex>/<24 hex>.json      analysis results of that version, per option set
        results-<32 hex>/run-<24 hex>.json  the report of a whole analysis whose first export
                                            this is (its inputs, options, rules and code)
        .tmp-*                              a writer's temporaries (removed once stale)
    <report stem>-<12 hex>-<12 hex>.sqlite  nsys exports of .nsys-rep reports (stamped in
                                            their SQLite header)
    .traceclf-export-*/                     a running nsys export's folder (marked; removed
                                            once stale)
    rules-<32 hex>.json                     a rule set that passed its checks (rulebook/
                                            stamp.py), marked by its first key

A name alone proves nothing (a user's ``rules-<32 hex>.json`` or ``x-<16 hex>.traceclf/`` may sit
in a ``--cache-dir``): traceclf reads, prunes and deletes only what carries the mark it wrote
there. The root itself may be a symbolic link (a user's choice); everything traceclf creates
inside it must be a real folder or file owned by this user, so a link planted in a cache can
neither redirect a write nor a deletion. Any problem with the cache (a full disk, a read-only or
foreign folder, a damaged entry, the root being a file) means "no cache", never a failed
analysis.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from traceclf.ingest.exportstamp import made_by_traceclf
from traceclf.rulebook.stamp import is_rules_stamp
from traceclf.support.owned import is_owned, read_head, usable_root, writable
from traceclf.support.version import __version__, sources_digest

APP = "traceclf"
ENV = "TRACECLF_CACHE_DIR"
SLOT_SUFFIX = ".traceclf"
RESULTS_PREFIX = "results-"
TMP_PREFIX = ".tmp-"
HEAD_BYTES = 1 << 20
TAIL_BYTES = 1 << 16
# A temporary this old belongs to a writer that died; younger ones may still be filling.
STALE_TMP_S = 3600

SLOT_RE = re.compile(r".+-[0-9a-f]{16}\.traceclf")
ENTRY_RE = re.compile(r"[0-9a-f]{32}")
RESULTS_RE = re.compile(r"results-[0-9a-f]{32}")
EXPORT_RE = re.compile(r".+-[0-9a-f]{12}-[0-9a-f]{12}\.sqlite")
EXPORT_WORK_RE = re.compile(r"\.traceclf-export-[\w-]+")
EXPORT_WORK_PREFIX = ".traceclf-export-"
RULES_STAMP_RE = re.compile(r"rules-[0-9a-f]{32}\.json")
# Bump when the on-disk layout changes; loader code changes are caught by the fingerprint.
CACHE_FORMAT = 5
# the modules that shape the trace model (read as files: importing them imports polars); a
# folder stands for its modules, so that one split off another is not forgotten
MODEL_SOURCES = ("ingest", "model/trace.py")
# What traceclf writes into each folder it makes in the cache: the proof that it made it.
MARKER = ".traceclf-made"
MARKER_TEXT = b"made by traceclf; `traceclf cache clear` removes this folder\n"


@dataclass(frozen=True)
class Root:
    path: Path
    origin: str  # "--cache-dir" | "$TRACECLF_CACHE_DIR" | "user cache directory"


def cache_root(cache_dir: Path | str | None = None) -> Root:
    """The cache root and why it is that one (``--cache-dir`` > ``$TRACECLF_CACHE_DIR`` >
    the platform's user cache directory). Relative paths are taken from the current folder."""
    if cache_dir is not None and str(cache_dir):
        return Root(Path(cache_dir).expanduser().absolute(), "--cache-dir")
    env = os.environ.get(ENV)
    if env:
        return Root(Path(env).expanduser().absolute(), f"${ENV}")
    return Root(_platform_cache_dir(), "user cache directory")


def _platform_cache_dir() -> Path:
    try:
        from platformdirs import user_cache_path
    except ImportError:  # a stripped install: XDG by hand, which is what platformdirs does on Linux
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base).absolute() / APP
    return user_cache_path(APP, appauthor=False)


def export_key(path: Path) -> str:
    """Identity of an export as the loader would see it: resolved path, size, mtime, inode,
    and a content fingerprint (the first MiB, which holds SQLite's header and its change
    counter, and the last 64 KiB). Raises OSError when the file cannot be read."""
    st = path.stat()
    digest = hashlib.sha256(
        f"{code_fingerprint()}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:".encode(
            errors="surrogateescape"
        )
    )
    with path.open("rb") as f:
        digest.update(f.read(HEAD_BYTES))
        if st.st_size > HEAD_BYTES:
            f.seek(max(HEAD_BYTES, st.st_size - TAIL_BYTES))
            digest.update(f.read(TAIL_BYTES))
    return digest.hexdigest()[:32]


@functools.cache
def code_fingerprint() -> str:
    """Cache format, versions and the source of the modules that shape the trace model."""
    digest = hashlib.sha256(f"{CACHE_FORMAT}:{__version__}:{_polars_release()}".encode())
    return sources_digest(digest, MODEL_SOURCES)


def _polars_release() -> str:
    """The installed polars distributions (polars and its runtime), named by their dist-info
    folders beside the package: read without importing polars or importlib.metadata (which
    cost a cached re-analysis a sixth of its time)."""
    import importlib.util

    spec = importlib.util.find_spec("polars")
    if spec is not None and spec.origin:
        found = sorted(p.name for p in Path(spec.origin).parent.parent.glob("polars*.dist-info"))
        if found:
            return ",".join(found)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("polars")
    except PackageNotFoundError:
        return "?"


def path_digest(path: Path, length: int = 16) -> str:
    return hashlib.sha256(str(path.resolve()).encode(errors="surrogateescape")).hexdigest()[:length]


def slot_of(path: Path, cache_dir: Path | None = None) -> Path:
    """The folder that holds every cached version of the export at ``path``."""
    return cache_root(cache_dir).path / f"{path.name}-{path_digest(path)}{SLOT_SUFFIX}"


def ensure_slot(slot: Path) -> bool:
    """Create ``slot`` (and the root) if needed, marked as made by traceclf; True when it is
    a real folder of ours, so marked, that we may write into. A link in its place is never
    followed, and a folder of that name without the mark is someone else's."""
    if not usable_root(slot.parent, create=True):
        return False
    with contextlib.suppress(OSError):
        slot.mkdir()
        mark(slot)
    return readable_slot(slot) and writable(slot)


def readable_slot(slot: Path) -> bool:
    """A slot we may read: a real folder (not a link) of ours that traceclf marked."""
    return is_owned(slot) and marked(slot)


def mark(folder: Path) -> None:
    """Write the marker into a folder traceclf just made (raises OSError)."""
    fd = os.open(folder / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(MARKER_TEXT)


def marked(folder: Path) -> bool:
    """Whether ``folder`` holds the marker traceclf writes into the folders it makes."""
    return (
        is_owned(folder / MARKER, "file")
        and read_head(folder / MARKER, len(MARKER_TEXT) + 1) == MARKER_TEXT
    )


def remove(path: Path) -> int:
    """Delete ``path`` if it is a real folder or file of ours; bytes freed (0 when refused).
    ``shutil.rmtree`` never follows links inside the folder it removes."""
    if is_owned(path, "dir"):
        size = _size(path)
        shutil.rmtree(path, ignore_errors=True)
        return size if not path.exists() else 0
    if is_owned(path, "file"):
        size = path.lstat().st_size
        with contextlib.suppress(OSError):
            path.unlink()
            return size
    return 0


def prune_slot(slot: Path, keep: str) -> None:
    """Remove the older versions' entries and results and dead writers' temporaries from a
    slot; names the cache did not create are left alone."""
    if not readable_slot(slot):
        return
    with contextlib.suppress(OSError):
        for child in slot.iterdir():
            name = child.name
            if name in (keep, f"{RESULTS_PREFIX}{keep}"):
                continue
            if name.startswith(TMP_PREFIX):
                if _stale(child):
                    remove(child)
            elif ENTRY_RE.fullmatch(name) or RESULTS_RE.fullmatch(name):
                remove(child)


@dataclass
class Usage:
    root: Root
    slots: int = 0  # exports with a cached trace model or result
    models: int = 0
    results: int = 0
    exports: int = 0  # nsys exports of reports
    bytes: int = 0


def usage(cache_dir: Path | None = None) -> Usage:
    """What the cache root holds (only the names traceclf owns are counted)."""
    root = cache_root(cache_dir)
    out = Usage(root)
    for kind, path in owned_items(root.path):
        out.bytes += _size(path)
        if kind == "slot":
            out.slots += 1
            with contextlib.suppress(OSError):
                for child in path.iterdir():
                    out.models += bool(ENTRY_RE.fullmatch(child.name))
                    out.results += bool(RESULTS_RE.fullmatch(child.name))
        elif kind == "export":
            out.exports += 1
    return out


def clear(cache_dir: Path | None = None) -> tuple[int, int]:
    """Delete everything traceclf owns in the cache root: (items removed, bytes freed).
    Anything else in that folder (a user's own files under ``--cache-dir .``) stays."""
    removed = freed = 0
    for _kind, path in owned_items(cache_root(cache_dir).path):
        size = remove(path)
        removed += bool(size) or not path.exists()
        freed += size
    return removed, freed


def owned_items(root: Path) -> list[tuple[str, Path]]:
    """The slots, exports and rule stamps in ``root`` that traceclf made, by name, kind,
    owner and (for exports) the stamp traceclf writes into their SQLite header."""
    items: list[tuple[str, Path]] = []
    try:
        children = sorted(root.iterdir())
    except OSError:
        return items
    for child in children:
        name = child.name
        if SLOT_RE.fullmatch(name) and readable_slot(child):
            items.append(("slot", child))
        elif EXPORT_WORK_RE.fullmatch(name) and is_owned(child) and marked(child):
            if _stale(child):  # a dead export's folder (a live one may still be filling)
                items.append(("work", child))
        elif _owned_export(child):
            items.append(("export", child))
        elif RULES_STAMP_RE.fullmatch(name) and is_rules_stamp(child):
            items.append(("rules", child))
    return items


def _owned_export(path: Path) -> bool:
    """An nsys export traceclf made (stamped in its SQLite header)."""
    return (
        is_owned(path, "file") and bool(EXPORT_RE.fullmatch(path.name)) and made_by_traceclf(path)
    )


def _stale(path: Path) -> bool:
    """A temporary whose writer has surely died (a live one may still be filling it)."""
    try:
        return time.time() - path.lstat().st_mtime >= STALE_TMP_S
    except OSError:
        return False


def _size(path: Path) -> int:
    """Bytes under ``path`` (links not followed)."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total
