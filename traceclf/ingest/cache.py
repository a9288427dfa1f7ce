"""Parquet cache of the normalised trace model, so re-analysing an unchanged export is cheap
(the JSON cache of each export's analysis result is :mod:`traceclf.ingest.results`).

Loading a multi-GB export costs seconds; reading its model back from Parquet costs a fraction
of that. Where the cache lives and which names it owns there is :mod:`traceclf.ingest.cachedir`:
an entry is ``<root>/<export name>-<path hash>.traceclf/<key>/``, the key being the export's
identity (path, size, mtime, a content fingerprint) plus a fingerprint of the loader code, so an
edited export or a changed loader never serves stale frames. The identity is read before the
export is and checked again before anything is written, so a file replaced meanwhile is never
filed under the old one's key. Entries are written into a temporary folder and renamed into
place, so concurrent processes see a whole entry or none. An entry is checked on every read
(its meta.json, and each frame's rows and schema against it; a result's checksum): one that
fails is a miss and is rebuilt. Any cache problem, a full disk included, means no cache, never
a failed analysis. The export itself is only ever read.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import polars as pl

from traceclf.ingest.cachedir import (
    CACHE_FORMAT,
    TMP_PREFIX,
    ensure_slot,
    prune_slot,
    readable_slot,
    slot_of,
)
from traceclf.ingest.load import load_trace
from traceclf.ingest.results import identity
from traceclf.ingest.schema import check_sqlite_file
from traceclf.model.trace import Trace
from traceclf.support.errors import TraceError
from traceclf.support.owned import is_owned

# Bump when the on-disk layout changes; loader code changes are caught by the fingerprint.
META = "meta.json"
# Caps on what is parsed back: a damaged or planted file must not exhaust memory.
MAX_META_BYTES = 1 << 20
# Anything a cache operation may raise, polars' own errors (ENOSPC arrives as a ComputeError)
# and panics from a damaged Parquet file included; none of it may fail an analysis.
CACHE_ERRORS = (Exception, pl.exceptions.PanicException)

Progress = Callable[[str], None]


def load_trace_cached(
    path: str | Path,
    *,
    use_cache: bool = True,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    write: bool = True,
) -> Trace:
    """:func:`~traceclf.ingest.load.load_trace` through the Parquet cache.

    ``use_cache=False`` neither reads nor writes a cache; ``write=False`` reads an entry but
    writes none on a miss (writing costs about as much as a second of loading a GB: worth it
    only when the export will be loaded again). ``cache_dir`` (default
    ``$TRACECLF_CACHE_DIR``, then the user's cache directory) is where the cache lives. Cache
    problems never fail a load: the export is read instead.
    """
    path = Path(path)
    if not use_cache:
        return load_trace(path, progress=progress)
    check_sqlite_file(path)  # a missing or non-SQLite file is a TraceError, not a cache miss
    step = progress or (lambda _msg: None)
    key = identity(path)
    if key is None:
        return load_trace(path, progress=progress)
    slot = slot_of(path, cache_dir)
    trace = read_entry(slot / key, path) if readable_slot(slot) else None
    if trace is not None:
        step("cache")
        return trace
    trace = load_trace(path, progress=progress)
    if not write or identity(path) != key:  # (rewritten while read: file it under no key)
        return trace
    step("writing cache")
    with contextlib.suppress(*CACHE_ERRORS):
        write_entry(trace, slot, key)
    return trace


def read_entry(entry: Path, path: Path) -> Trace | None:
    """The cached trace in ``entry``, or None when it is absent or damaged (then removed)."""
    if not is_owned(entry):
        return None
    try:
        meta = _read_meta(entry / META)
        # One collect_all reads every frame's file in parallel.
        frames = pl.collect_all([pl.scan_parquet(entry / f"{n}.parquet") for n in Trace.FRAMES])
        for name, frame in zip(Trace.FRAMES, frames, strict=True):
            if _frame_meta(frame) != meta["frames"][name]:
                raise ValueError(f"{name}.parquet does not match meta.json")
    except (*CACHE_ERRORS, RecursionError):
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
        unusable_rows=dict(meta["unusable_rows"]),
        repaired_strings=dict(meta["repaired_strings"]),
        pid_from_calls=meta.get("pid_from_calls"),
        host_sources=tuple(meta["host_sources"]),
        host_notes=dict(meta["host_notes"]),
        **dict(zip(Trace.FRAMES, frames, strict=True)),
    )


def _read_meta(file: Path) -> dict:
    """meta.json of an entry, checked for every field a reader relies on (ValueError if not)."""
    with file.open("rb") as f:
        raw = f.read(MAX_META_BYTES + 1)
    if len(raw) > MAX_META_BYTES:
        raise ValueError("meta.json too large")
    meta = json.loads(raw)
    ok = (
        isinstance(meta, dict)
        and meta.get("format") == CACHE_FORMAT
        and all(_str_or_none(meta.get(k)) for k in ("nsys_version", "schema_version"))
        and isinstance(meta.get("tables"), list)
        and all(isinstance(t, str) for t in meta["tables"])
        and meta.get("nccl_payload") in ("values", "declared_empty", "absent")
        and isinstance(meta.get("session"), dict)
        and isinstance(meta.get("frames"), dict)
        and set(meta["frames"]) == set(Trace.FRAMES)
        and isinstance(meta.get("unusable_rows"), dict)
        and all(isinstance(n, int) for n in meta["unusable_rows"].values())
        and isinstance(meta.get("repaired_strings"), dict)
        and all(isinstance(n, int) for n in meta["repaired_strings"].values())
        and isinstance(meta.get("pid_from_calls"), int | None)
        and isinstance(meta.get("host_sources"), list)
        and all(isinstance(t, str) for t in meta["host_sources"])
        and isinstance(meta.get("host_notes"), dict)
        and all(isinstance(t, str) for t in meta["host_notes"].values())
    )
    if not ok:
        raise ValueError("meta.json is not a cache entry's")
    return meta


def _str_or_none(value) -> bool:
    return value is None or isinstance(value, str)


def _frame_meta(frame: pl.DataFrame) -> dict:
    """What meta.json records of a frame, to catch a truncated, swapped or foreign file."""
    return {"rows": frame.height, "schema": [[c, str(t)] for c, t in frame.schema.items()]}


def write_entry(trace: Trace, slot: Path, key: str) -> bool:
    """Write ``trace`` as ``slot/key`` atomically; True when an entry is in place afterwards.
    A failure (a full disk: polars reports it as a ComputeError) leaves nothing behind."""
    if not ensure_slot(slot):
        return False
    try:
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
            "frames": {name: _frame_meta(getattr(trace, name)) for name in Trace.FRAMES},
            "unusable_rows": trace.unusable_rows,
            "repaired_strings": trace.repaired_strings,
            "pid_from_calls": trace.pid_from_calls,
            "host_sources": list(trace.host_sources),
            "host_notes": trace.host_notes,
        }
        # meta.json is written last, but the rename below is what publishes the entry.
        (tmp / META).write_text(json.dumps(meta), encoding="utf-8")
        os.rename(tmp, slot / key)
    except CACHE_ERRORS:
        # Either another process renamed its entry in first (use theirs) or the disk refused.
        shutil.rmtree(tmp, ignore_errors=True)
        return is_owned(slot / key)
    prune_slot(slot, keep=key)
    return True


def _discard(entry: Path) -> None:
    """Move a bad entry out of the way (atomically, so a racing writer is unaffected)."""
    trash = entry.with_name(f"{TMP_PREFIX}bad-{entry.name}-{os.getpid()}")
    with contextlib.suppress(OSError):
        os.rename(entry, trash)
        shutil.rmtree(trash, ignore_errors=True)


def open_trace(path: str | Path, *, use_cache: bool = True, cache_dir: Path | None = None) -> Trace:
    """The trace model of the one export (or ``.nsys-rep`` report, exported once) ``path``
    names, through the cache; TraceError when it names several (a folder)."""
    from traceclf.ingest.inputs import resolve_inputs

    exports = resolve_inputs([str(path)], cache_dir=cache_dir, quiet=True)
    if len(exports) != 1:
        raise TraceError(path, f"holds {len(exports)} exports; open one at a time")
    return load_trace_cached(exports[0], use_cache=use_cache, cache_dir=cache_dir)
