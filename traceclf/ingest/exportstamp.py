"""The stamp traceclf writes into the SQLite header of each export it makes from an nsys report:
how the cache (:mod:`traceclf.ingest.cachedir`) recognises the exports it may delete and the
exporter (:mod:`traceclf.ingest.nsys`) those of one version of a report."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from traceclf.support.owned import read_head

# SQLite header fields (offsets 60 and 68) that nsys leaves at 0: ours carry "tclf" and the
# report's identity, which is how an export is recognised as made by traceclf for that report.
APPLICATION_ID = 0x74636C66
HEADER_STAMP = struct.Struct(">i4xi")  # user_version, (incremental vacuum), application_id
STAMP_OFFSET = 60


def stamp_for(key: str) -> tuple[int, int]:
    """(user_version, application_id) of the export of the report identity ``key``."""
    return zlib.crc32(key.encode()) & 0x7FFFFFFF, APPLICATION_ID


def read_stamp(path: Path) -> tuple[int, int] | None:
    raw = read_head(path, HEADER_STAMP.size, STAMP_OFFSET)  # (a FIFO there is never opened)
    return HEADER_STAMP.unpack(raw) if raw and len(raw) == HEADER_STAMP.size else None


def is_export_of(path: Path, key: str) -> bool:
    """Whether ``path`` is an export traceclf stamped for the report identity ``key``."""
    return read_stamp(path) == stamp_for(key)


def made_by_traceclf(path: Path) -> bool:
    """Whether ``path`` is an export traceclf made (for this report or an earlier version)."""
    stamp = read_stamp(path)
    return stamp is not None and stamp[1] == APPLICATION_ID
