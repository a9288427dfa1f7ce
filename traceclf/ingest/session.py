"""Who captured an export, and when: the evidence that several exports are ranks of one job.

Read straight from the small metadata tables with sqlite3 (read-only, no journal files), not
through the trace model: the session's UTC start, its UUID and host name, and the rank ids NCCL
writes into the payload of its ``ncclCommInitRank*`` NVTX ranges when nsys exported payloads
as JSON, or from the launcher's environment variables (``RANK=3``, ``SLURM_PROCID=3`` ...)
where nsys recorded the profiled process' environment in ``META_DATA_CAPTURE``. Every field may be missing (older nsys, a stripped export): missing is not a mismatch.
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
from pathlib import Path

from traceclf.ingest.schema import connect_readonly

# NCCL payload JSON is small; more rows than this would only repeat communicator inits.
MAX_PAYLOAD_ROWS = 256
# The NVTX rows whose payload may carry a rank id (SQL, on NVTX_EVENTS).
RANK_PAYLOAD_SQL = '"jsonText" IS NOT NULL AND "jsonText" LIKE \'%Rank%\''
RANK_KEY = re.compile(r"^rank$", re.IGNORECASE)
# Global-rank variables of torchrun, Open MPI, Slurm, MPICH/PMI.
RANK_ENV = re.compile(r"^(?:RANK|OMPI_COMM_WORLD_RANK|SLURM_PROCID|PMI_RANK|PMIX_RANK)=(\d+)$")


def job_evidence(session: dict, trace) -> dict:
    """``session`` (:func:`session_info` of the export) plus the span of the export's GPU work
    (ns, session time)."""
    frames = [f for f in (trace.kernels, trace.graphs, trace.copies) if f.height]
    span = (
        [int(min(f["start"].min() for f in frames)), int(max(f["end"].max() for f in frames))]
        if frames
        else None
    )
    if getattr(trace, "capture_span", None):  # a sampled trace: the capture's, not its rows'
        span = list(trace.capture_span)
    return session | {"gpu_span_ns": span}


def session_info(path: Path, payloads: bool = True) -> dict:
    """``{"session_uuid", "start_utc_ns", "hostname", "nccl_ranks", "env_ranks"}`` of an
    export (values None or empty when the export does not say); without ``payloads``, no
    ``nccl_ranks`` (a scan of the NVTX table: :func:`nccl_ranks` gives them)."""
    info: dict = {
        "session_uuid": None,
        "start_utc_ns": None,
        "hostname": None,
        "nccl_ranks": [],
        "env_ranks": [],
    }
    try:
        con = connect_readonly(path)  # (text that is not UTF-8 reads with U+FFFD)
    except sqlite3.Error:
        return info
    try:
        with contextlib.suppress(sqlite3.Error):
            row = con.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME").fetchone()
            if row and isinstance(row[0], int):
                info["start_utc_ns"] = row[0]
        with contextlib.suppress(sqlite3.Error):
            host = con.execute(
                "SELECT value FROM TARGET_INFO_SYSTEM_ENV WHERE name = 'Hostname' LIMIT 1"
            ).fetchone()
            info["hostname"] = str(host[0]) if host and host[0] else None
        with contextlib.suppress(sqlite3.Error):
            capture = con.execute("SELECT name, value FROM META_DATA_CAPTURE").fetchall()
            uuid = [v for n, v in capture if n == "PROFILING_SESSION_UUID" and v]
            info["session_uuid"] = uuid[0] if uuid else None
            info["env_ranks"] = sorted(
                {int(m.group(1)) for _n, v in capture if (m := RANK_ENV.match(str(v or "")))}
            )
        if payloads:
            with contextlib.suppress(sqlite3.Error):
                info["nccl_ranks"] = _nccl_ranks(con)
    finally:
        con.close()
    return info


def nccl_ranks(path: Path, rowids: list[int] | None = None) -> list[int]:
    """The ``nccl_ranks`` of :func:`session_info`: from the NVTX rows ``rowids`` (the first of
    those :data:`RANK_PAYLOAD_SQL` picks, in rowid order, as step sampling's first pass finds
    them in its scan of the table), else from a scan of its own."""
    if rowids is not None and not rowids:
        return []
    try:
        con = connect_readonly(path)
    except sqlite3.Error:
        return []
    try:
        with contextlib.suppress(sqlite3.Error):
            return _nccl_ranks(con, rowids)
        return []
    finally:
        con.close()


def _nccl_ranks(con: sqlite3.Connection, rowids: list[int] | None = None) -> list[int]:
    """Rank ids from NCCL's communicator-init payloads ({"Rank": 3, "No. of ranks": 8}),
    present only when nsys exported NVTX payloads as JSON: those of ``rowids``, else of the
    first :data:`MAX_PAYLOAD_ROWS` rows with one, by a scan."""
    at = "" if rowids is None else f"rowid IN ({', '.join(str(int(r)) for r in rowids)}) AND "
    rows = con.execute(
        f"SELECT jsonText FROM NVTX_EVENTS WHERE {at}{RANK_PAYLOAD_SQL} "
        f"ORDER BY rowid LIMIT {MAX_PAYLOAD_ROWS}"
    ).fetchall()
    ranks: set[int] = set()
    for (text,) in rows:
        with contextlib.suppress(ValueError, TypeError, RecursionError):
            payload = json.loads(text)
            if isinstance(payload, dict):
                ranks.update(
                    v for k, v in payload.items() if RANK_KEY.match(str(k)) and isinstance(v, int)
                )
    return sorted(ranks)
