"""Read an nsys SQLite export into the typed trace model: every table the analysis needs,
read by :class:`traceclf.ingest.reader.Reader` (only the columns it needs, an optional time
span pushed into the SQL) and assembled into a :class:`~traceclf.model.trace.Trace`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from traceclf.ingest.assemble import READ_ORDER, build_trace
from traceclf.ingest.devices import read_gpu_metrics
from traceclf.ingest.reader import Reader, Span
from traceclf.ingest.schema import inspect_export
from traceclf.model.trace import Trace
from traceclf.support.cpus import InOrder

# What load_trace passes to its ``progress`` callback, in order: one call as each stage starts.
LOAD_STAGES = (
    "strings",
    "kernels",
    "graphs",
    "copies",
    "CUDA API",
    "syncs",
    "NVTX",
    "NCCL payloads",
    "memory",
    "GPU metrics",
    "host side",
)


def load_trace(
    path: str | Path,
    span: Span | None = None,
    progress: Callable[[str], None] | None = None,
) -> Trace:
    """Open one SQLite export and return its :class:`~traceclf.model.trace.Trace`.

    ``span`` (ns, session timeline) restricts every timed table to events overlapping it;
    it is pushed into the SQL so that memory follows the span, not the file. ``progress`` is
    called with each of :data:`LOAD_STAGES` (e.g. a :class:`traceclf.support.progress.LoadProgress`).
    """
    path = Path(path)
    reader = Reader(inspect_export(path, check_pages=False))
    # (each table read while the one before it is built: the build's single-core work, names
    # looked up and rows checked, beside the reads)
    with InOrder(lambda logical: reader.read(logical, span), READ_ORDER, "traceclf-reads") as r:
        return build_trace(
            reader,
            r.take,
            lambda: read_gpu_metrics(reader, span),
            nvtx_span=span,
            progress=progress,
        )
