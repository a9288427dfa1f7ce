"""The result cache: each export's analysis result as checked JSON, keyed by the export's
identity (its path, size, times and fingerprint, and the code that reads it) and the options.

Kept apart from the trace-model cache (:mod:`traceclf.ingest.cache`, Parquet through polars):
re-analysing an unchanged export reads one small file here and imports neither polars nor
the loader. A whole analysis's report is filed beside the results of its first export, keyed by
every input's identity, the options, the rules and the code: re-analysing unchanged inputs
then skips even the reduce step (cross-rank matching, the judge). See
:mod:`traceclf.ingest.cachedir` for where the files live.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from traceclf.ingest.cachedir import (
    RESULTS_PREFIX,
    ensure_slot,
    export_key,
    prune_slot,
    readable_slot,
    slot_of,
)
from traceclf.support.atomic import write_atomic
from traceclf.support.owned import is_owned

# 2: a line {format, sha256} then the result as compact JSON, the checksum of its bytes as
# written (1: one object, the checksum of the result encoded again, sorted: two encodings of
# an --all-steps result to write it and one more to read it)
RESULT_FORMAT = 2
# a whole analysis's report, beside the first export's results (pipeline/analysis.py)
RUN_PREFIX = "run-"
RUN_FORMAT = 2  # 2: the report as --format json writes it (1: compact JSON)
MAX_RESULT_BYTES = 64 << 20  # a damaged or planted file must not exhaust memory
MAX_STAMP_BYTES = 256  # a stamp line: its format and checksum
CACHE_ERRORS = (Exception,)  # none of it may fail an analysis


def identity(path: Path) -> str | None:
    """The export's cache key, or None when it cannot be read (then: no cache)."""
    try:
        return export_key(path)
    except OSError:
        return None


def read_result(path: Path, variant: str, key: str, cache_dir: Path | None = None) -> dict | None:
    """The cached analysis result of version ``key`` of the export, for ``variant`` (options
    and analysis code); None when absent, unreadable or failing its checksum. Re-analysing an
    unchanged export then skips the trace model altogether."""
    return _read(path, key, f"{variant}.json", cache_dir)


def read_run(path: Path, key: str, run: str, cache_dir: Path | None = None) -> dict | None:
    """The cached report (or run set) of a whole analysis, filed as ``run`` (every input's
    identity, the options, the rules and the code: :func:`traceclf.pipeline.analysis.run_key`)
    with version ``key`` of its first export; None when absent or damaged."""
    text = read_run_text(path, key, run, cache_dir)
    if text is None:
        return None
    try:
        report = json.loads(text)
    except (*CACHE_ERRORS, RecursionError):  # a nesting bomb is a RecursionError
        return None
    return report if isinstance(report, dict) else None


def read_run_text(path: Path, key: str, run: str, cache_dir: Path | None = None) -> str | None:
    """The JSON text of the report :func:`read_run` reads, as ``--format json`` writes it
    (without its last newline). Its checksum is of the report's bytes as written (a line of its
    own before them), not of the report encoded again: an ``--all-steps`` report runs to
    megabytes."""
    try:
        body = _checked(_file(path, key, f"{RUN_PREFIX}{run}.json", cache_dir), RUN_FORMAT)
        return None if body is None else body.decode()
    except CACHE_ERRORS:
        return None


def _checked(file: Path | None, version: int) -> bytes | None:
    """The body of a cache file of ours laid out as a stamp line (its format and the checksum
    of the bytes after it) then the body; None when absent, of another format or damaged."""
    raw = _bounded(file)
    if raw is None:
        return None
    head, _, body = raw.partition(b"\n")
    if len(head) > MAX_STAMP_BYTES:  # (no stamp line: not a file of this layout)
        return None
    stamp = json.loads(head)
    if not isinstance(stamp, dict):
        return None
    if stamp.get("format") != version or stamp.get("sha256") != _digest(body):
        return None
    return body


def _file(path: Path, key: str, name: str, cache_dir: Path | None) -> Path | None:
    """The cache file ``name`` of version ``key`` of the export, if it is one of ours."""
    slot = slot_of(path, cache_dir)
    folder = slot / f"{RESULTS_PREFIX}{key}"
    file = folder / name
    if not (readable_slot(slot) and is_owned(folder) and is_owned(file, "file")):
        return None
    return file


def _bounded(file: Path | None) -> bytes | None:
    """The bytes of a cache file of ours, None when there is none or it is over
    :data:`MAX_RESULT_BYTES` (raises OSError)."""
    if file is None:
        return None
    with file.open("rb") as f:
        raw = f.read(MAX_RESULT_BYTES + 1)
    return raw if len(raw) <= MAX_RESULT_BYTES else None


def _read(path: Path, key: str, name: str, cache_dir: Path | None) -> dict | None:
    try:
        body = _checked(_file(path, key, name, cache_dir), RESULT_FORMAT)
        result = None if body is None else json.loads(body)
        return result if isinstance(result, dict) else None
    except (*CACHE_ERRORS, RecursionError):  # a nesting bomb is a RecursionError
        return None


def analysed_before(path: Path, key: str, cache_dir: Path | None = None) -> bool:
    """Whether a result of version ``key`` of the export is cached under any options: then a
    trace model of it is being loaded again, and caching that pays."""
    folder = slot_of(path, cache_dir) / f"{RESULTS_PREFIX}{key}"
    with contextlib.suppress(*CACHE_ERRORS):
        return is_owned(folder) and any(folder.glob("*.json"))
    return False


def write_result(
    path: Path, variant: str, key: str, result: dict, cache_dir: Path | None = None
) -> bool:
    """Store an analysis result of version ``key`` of the export, atomically, if the export
    is still that version (it may have been replaced during the analysis). Failures are
    ignored: a cache must never fail an analysis. True when stored."""
    try:
        body = json.dumps(result, separators=(",", ":"))  # (one line: ASCII, escaped)
        stamp = json.dumps({"format": RESULT_FORMAT, "sha256": _digest(body.encode())})
    except CACHE_ERRORS:
        return False
    return _write(path, key, f"{variant}.json", stamp + "\n" + body, cache_dir)


def write_run(path: Path, key: str, run: str, report: str, cache_dir: Path | None = None) -> bool:
    """Store the report (or run set) of a whole analysis, ``report`` its JSON text as
    ``--format json`` writes it, as :func:`read_run` and :func:`read_run_text` find it."""
    body = report.encode()
    stamp = json.dumps({"format": RUN_FORMAT, "sha256": _digest(body)})
    return _write(path, key, f"{RUN_PREFIX}{run}.json", stamp + "\n" + report, cache_dir)


def _write(path: Path, key: str, name: str, text: str, cache_dir: Path | None) -> bool:
    """Write the cache file ``name`` of version ``key`` of the export, atomically."""
    if identity(path) != key:
        return False
    slot = slot_of(path, cache_dir)
    folder = slot / f"{RESULTS_PREFIX}{key}"
    try:
        if len(text) > MAX_RESULT_BYTES:  # it would never be read back
            return False
        if not ensure_slot(slot):
            return False
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        if not is_owned(folder):
            return False
        write_atomic(folder / name, text)
    except CACHE_ERRORS:
        return False
    prune_slot(slot, keep=key)
    return True


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()
