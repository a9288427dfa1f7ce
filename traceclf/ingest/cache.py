"""Parquet cache of the normalised trace model, so re-analysing an unchanged export is cheap.

Loading a multi-GB export costs seconds; reading its model back from Parquet costs a fraction
of that. An entry lives in ``<export>.traceclf/<key>/`` beside the export, or, when that folder
is not writable, in ``<cache dir>/<export name>-<path hash>/<key>/``. The key is the export's
identity (size, mtime, first MiB) plus a fingerprint of the loader code, so an edited export or
a changed loader never serves stale frames. Entries are written into a temporary folder and
renamed into place, so concurrent processes see a whole entry or none; an entry that cannot be
read is treated as absent and rebuilt. The export itself is only ever read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import polars as pl

import traceclf
from traceclf import model
from traceclf.atomic import write_atomic
from traceclf.ingest import devices, load, schema
from traceclf.ingest.load import load_trace
from traceclf.ingest.schema import check_sqlite_file
from traceclf.model import Trace

# Bump when the on-disk layout changes; loader code changes are caught by the fingerprint.
CACHE_FORMAT = 2
HEAD_BYTES = 1 << 20
SUFFIX = ".traceclf"
META = "meta.json"
TMP_PREFIX = ".tmp-"
# A temporary folder this old belongs to a writer that died; younger ones may still be filling.
STALE_TMP_S = 3600

Progress = Callable[[str], None]


def load_trace_cached(
    path: str | Path,
    *,
    use_cache: bool = True,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
) -> Trace:
    """:func:`~traceclf.ingest.load.load_trace` through the Parquet cache.

    ``use_cache=False`` neither reads nor writes a cache. ``cache_dir`` (default
    ``$TRACECLF_CACHE_DIR``, then ``~/.cache/traceclf``) is used when the export's folder is
    not writable. Cache problems never fail a load: the export is read instead.
    """
    path = Path(path)
    if not use_cache:
        return load_trace(path, progress=progress)
    check_sqlite_file(path)  # a missing or non-SQLite file is a TraceError, not a cache miss
    step = progress or (lambda _msg: None)
    key = export_key(path)
    slots = (beside_slot(path), global_slot(path, cache_dir))
    for slot in slots:
        trace = read_entry(slot / key, path)
        if trace is not None:
            step("cache")
            return trace
    trace = load_trace(path, progress=progress)
    if export_key(path) != key:  # rewritten while we read it: do not file it under either key
        return trace
    step("writing cache")
    for slot in slots:
        if _writable(slot) and write_entry(trace, slot, key):
            break
    return trace


RESULTS_PREFIX = "results-"


def read_result(path: Path, variant: str, cache_dir: Path | None = None) -> dict | None:
    """A cached analysis result of the export (JSON), for ``variant`` (options and analysis
    code); None when absent or unreadable. Re-analysing an unchanged export then skips the
    trace model altogether."""
    key = export_key(path)
    for slot in (beside_slot(path), global_slot(path, cache_dir)):
        file = slot / f"{RESULTS_PREFIX}{key}" / f"{variant}.json"
        with contextlib.suppress(OSError, ValueError):
            return json.loads(file.read_text(encoding="utf-8"))
    return None


def write_result(path: Path, variant: str, result: dict, cache_dir: Path | None = None) -> None:
    """Store an analysis result next to the trace-model entry, atomically; failures are
    ignored (a cache must never fail an analysis)."""
    key = export_key(path)
    for slot in (beside_slot(path), global_slot(path, cache_dir)):
        if not _writable(slot):
            continue
        folder = slot / f"{RESULTS_PREFIX}{key}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(folder / f"{variant}.json", json.dumps(result))
        except OSError:
            continue
        _prune(slot, keep=key)
        return


def export_key(path: Path) -> str:
    """Identity of an export's content as traceclf's loader would see it.

    Size and mtime catch appends and rewrites; the first MiB holds SQLite's header, whose
    change counter moves on every committed write, and catches a same-size copy over the file.
    """
    st = path.stat()
    digest = hashlib.sha256(f"{_code_fingerprint()}:{st.st_size}:{st.st_mtime_ns}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(HEAD_BYTES))
    return digest.hexdigest()[:32]


@functools.cache
def _code_fingerprint() -> str:
    """Cache format, versions and the source of the modules that shape the trace model."""
    digest = hashlib.sha256(f"{CACHE_FORMAT}:{traceclf.__version__}:{pl.__version__}".encode())
    for module in (load, devices, model, schema):
        with contextlib.suppress(OSError, TypeError):  # no source shipped: version must do
            digest.update(Path(module.__file__).read_bytes())  # type: ignore[arg-type]
    return digest.hexdigest()


def beside_slot(path: Path) -> Path:
    return path.parent / (path.name + SUFFIX)


def global_slot(path: Path, cache_dir: Path | None) -> Path:
    root = cache_dir or Path(
        os.environ.get("TRACECLF_CACHE_DIR") or Path.home() / ".cache" / "traceclf"
    )
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return Path(root) / f"{path.name}-{where}"


def _writable(slot: Path) -> bool:
    """Whether a cache may be written into ``slot`` (or created in its nearest parent).

    Besides access(2) this asks for a write bit, so a folder made read-only on purpose stays
    untouched even for root, whom access(2) always allows.
    """
    folder = slot
    while not folder.exists():
        if folder.parent == folder:
            return False
        folder = folder.parent
    return os.access(folder, os.W_OK) and bool(folder.stat().st_mode & 0o222)


def read_entry(entry: Path, path: Path) -> Trace | None:
    """The cached trace in ``entry``, or None when it is absent or damaged (then removed)."""
    if not entry.is_dir():
        return None
    try:
        meta = json.loads((entry / META).read_text(encoding="utf-8"))
        if meta["format"] != CACHE_FORMAT:
            raise ValueError("cache format mismatch")
        # One collect_all reads every frame's file in parallel.
        frames = pl.collect_all([pl.scan_parquet(entry / f"{n}.parquet") for n in Trace.FRAMES])
    except (Exception, pl.exceptions.PanicException):
        # Published entries are complete, so this one was damaged after the fact: move it
        # away, or the rebuild below could never take its name.
        _discard(entry)
        return None
    return Trace(
        path=path,
        nsys_version=meta["nsys_version"],
        schema_version=meta["schema_version"],
        tables=frozenset(meta["tables"]),
        nccl_payload=meta["nccl_payload"],
        session=meta["session"],
        **dict(zip(Trace.FRAMES, frames, strict=True)),
    )


def write_entry(trace: Trace, slot: Path, key: str) -> bool:
    """Write ``trace`` as ``slot/key`` atomically; True when an entry is in place afterwards."""
    try:
        slot.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{key}-", dir=slot))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    except OSError:
        return False
    try:
        for name in Trace.FRAMES:
            # zstd level 1 without column statistics: fastest to write and to read back here
            getattr(trace, name).write_parquet(
                tmp / f"{name}.parquet", compression="zstd", compression_level=1, statistics=False
            )
        meta = {
            "format": CACHE_FORMAT,
            "nsys_version": trace.nsys_version,
            "schema_version": trace.schema_version,
            "tables": sorted(trace.tables),
            "nccl_payload": trace.nccl_payload,
            "session": trace.session,
        }
        # meta.json is written last, but the rename below is what publishes the entry.
        (tmp / META).write_text(json.dumps(meta), encoding="utf-8")
        os.rename(tmp, slot / key)
    except OSError:
        # Either another process renamed its entry in first (use theirs) or the disk refused.
        shutil.rmtree(tmp, ignore_errors=True)
        return (slot / key / META).exists()
    _prune(slot, keep=key)
    return True


def _discard(entry: Path) -> None:
    """Move a bad entry out of the way (atomically, so a racing writer is unaffected)."""
    trash = entry.with_name(f"{TMP_PREFIX}bad-{entry.name}-{os.getpid()}")
    with contextlib.suppress(OSError):
        os.rename(entry, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _prune(slot: Path, keep: str) -> None:
    """Remove entries of older versions of the export and leftovers of crashed writers."""
    now = time.time()
    for child in slot.iterdir():
        if child.name in (keep, f"{RESULTS_PREFIX}{keep}"):
            continue
        with contextlib.suppress(OSError):
            if child.name.startswith(TMP_PREFIX) and now - child.stat().st_mtime < STALE_TMP_S:
                continue
            shutil.rmtree(child)
