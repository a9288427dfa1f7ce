"""Raw rows of the export's tables → the frames of the trace model: kernel and CUDA-call names
resolved by lookup into Categoricals, copies and memsets as one frame, NVTX ranges with their
text and domain, unusable rows left out and counted, start order flagged.

:func:`build_trace` builds the :class:`~traceclf.model.trace.Trace` from whatever rows a caller read:
the whole capture (:func:`traceclf.ingest.load.load_trace`) or the analysed steps of a sampled
capture (:mod:`traceclf.pipeline.twopass`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import polars as pl

from traceclf.ingest.devices import (
    DEVICE_MAP_SCHEMA,
    GPU_METRICS_SCHEMA,
    GPU_SCHEMA,
    PROCESS_SCHEMA,
    THREAD_SCHEMA,
    nccl_payload,
    read_device_map,
    read_gpus,
    read_processes,
    read_session,
    read_threads,
)
from traceclf.ingest.hosttables import HostSide, empty_host_side, read_host_side
from traceclf.ingest.nccl_calls import empty as nccl_empty
from traceclf.ingest.nccl_calls import read_nccl_calls
from traceclf.ingest.reader import Reader, Span, decode_pid, release_read_buffers
from traceclf.ingest.tables import MAX_ALLOCATION_BYTES
from traceclf.model.trace import Trace
from traceclf.support.cpus import second_lane
from traceclf.support.errors import TraceError, TraceWarning

# copyKind values of CUpti_ActivityMemcpyKind
COPY_KINDS = {
    1: "HtoD",
    2: "DtoH",
    3: "HtoA",
    4: "AtoH",
    5: "AtoA",
    6: "AtoD",
    7: "DtoA",
    8: "DtoD",
    9: "HtoH",
    10: "PtoP",
    11: "UVM_HtoD",
    12: "UVM_DtoH",
    13: "UVM_DtoD",
}
MEMORY_KIND_PAGEABLE = 0
NVTX_RANGE_TYPES = (59, 60)  # push/pop and start/end ranges
NVTX_DOMAIN_CREATE = 75


def decode_tid(col: str) -> pl.Expr:
    return (pl.col(col) % (1 << 24)).cast(pl.Int64)


def lookup_names(strings: pl.DataFrame, *ids: pl.Series) -> list[pl.Series]:
    """Each id column as a Categorical of its StringIds values (null where absent), by lookup:
    the few hundred distinct ids are resolved once and gathered, so no join copies the frame."""
    used = _used_ids(ids)
    known = strings.filter(pl.col("id").is_in(used.implode()))
    if known.is_empty() or used.is_empty():
        return [pl.Series(i.name, [None] * len(i), dtype=pl.Categorical) for i in ids]
    values = known["value"].cast(pl.Categorical)
    top = int(max(used.max(), known["id"].max()))  # type: ignore[arg-type]
    if top < 0 or top > LOOKUP_MAX_ID:
        return _lookup_by_join(known, ids)
    codes = np.full(top + 1, len(values), dtype=np.uint32)  # len(values): the null slot
    codes[known["id"].to_numpy()] = np.arange(len(values), dtype=np.uint32)
    slots = pl.Series(codes)
    table = pl.concat([values, pl.Series([None], dtype=pl.Categorical)])
    return [table.gather(_slots(codes, slots, i, len(values))).alias(i.name) for i in ids]


def _used_ids(ids: tuple[pl.Series, ...]) -> pl.Series:
    """The distinct ids of the columns: marked in a table of every id when they are small
    non-negative integers (millions of rows, a few hundred names: no hashing), else unique."""
    present = [i.drop_nulls() for i in ids if len(i)]
    top = max((int(i.max()) for i in present if len(i)), default=-1)  # type: ignore[arg-type]
    low = min((int(i.min()) for i in present if len(i)), default=0)  # type: ignore[arg-type]
    if not present or low < 0 or top > LOOKUP_MAX_ID:
        return pl.concat(present or [pl.Series([], dtype=pl.Int64)]).unique()
    seen = np.zeros(top + 1, bool)
    for i in present:
        seen[i.to_numpy()] = True
    return pl.Series(np.flatnonzero(seen))


def _slots(codes: np.ndarray, slots: pl.Series, ids: pl.Series, null_slot: int) -> pl.Series:
    """The slot of each id in the names' table (``null_slot`` for a negative id: no string);
    through numpy when no id is null (millions of ids: one array, not three)."""
    if ids.null_count():
        valid = ids.cast(pl.Int64)
        return slots.gather(pl.select(pl.when(valid >= 0).then(valid)).to_series())
    at = ids.to_numpy()
    if not len(at) or int(at.min()) >= 0:  # (as nsys writes them: one gather)
        return pl.Series(codes[at])
    return pl.Series(np.where(at >= 0, codes[np.maximum(at, 0)], np.uint32(null_slot)))


# Above this id a dense lookup table would be too big: resolve names with a join instead.
LOOKUP_MAX_ID = 50_000_000


def _lookup_by_join(known: pl.DataFrame, ids: tuple[pl.Series, ...]) -> list[pl.Series]:
    table = known.with_columns(pl.col("value").cast(pl.Categorical))
    return [
        pl.DataFrame({"id": i.cast(pl.Int64)})
        .join(table, on="id", how="left", maintain_order="left")["value"]
        .alias(i.name)
        for i in ids
    ]


def _names(strings: pl.DataFrame, id_col: str, out: str) -> Callable[[pl.DataFrame], pl.DataFrame]:
    def attach(df: pl.DataFrame) -> pl.DataFrame:
        (names,) = lookup_names(strings, df[id_col])
        return df.with_columns(names.alias(out)).drop(id_col)

    return attach


# Event times no capture has: before the session's clock starts, past 2^62 ns (146 years), or
# one event lasting more than a day. A row holding one (a damaged or forged export: a kernel
# from -2^63 to 2^63-1) would stretch every union and interval it joins.
MAX_EVENT_NS = 24 * 3600 * 10**9
MAX_TIME_NS = 1 << 62


def usable(
    df: pl.DataFrame, logical: str, counts: dict[str, int], *, process: bool = True
) -> pl.DataFrame:
    """``df`` without the rows no measure can use: no start or end (or one of another type),
    an end before the start, times no capture has, no process (unless ``process`` is False).
    How many are dropped, each under the first of these reasons it has, is added to
    ``counts`` (the Trace's ``unusable_rows``), so the report can say so rather than judge
    silently on fewer rows."""
    if df.is_empty():
        return df
    timed = "end" in df.columns
    end = pl.col("end") if timed else pl.col("start")
    checks = {
        "no_time": pl.col("start").is_null() | end.is_null(),
        "end_before_start": (end < pl.col("start")).fill_null(False),
        "implausible_time": (
            (pl.col("start") < 0) | (end > MAX_TIME_NS) | (end - pl.col("start") > MAX_EVENT_NS)
        ).fill_null(False),
        "no_process": (
            pl.col("pid").is_null() if process and "pid" in df.columns else pl.lit(False)
        ),
    }
    unusable = pl.any_horizontal(*checks.values())
    if not df.select(unusable.any()).item():
        return df
    reason = pl.lit(None, pl.String)
    for name, check in reversed(checks.items()):  # (the first reason a row has is its own)
        reason = pl.when(check).then(pl.lit(name)).otherwise(reason)
    found = df.select(reason=reason).drop_nulls()["reason"].value_counts()
    for name, n in found.iter_rows():
        counts[f"{logical}.{name}"] = counts.get(f"{logical}.{name}", 0) + int(n)
    return df.filter(~unusable)


def sorted_by_start(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` in ``start`` order, flagged so (set_sorted) that later sorts, joins and searches
    skip the work: nsys writes rows in that order, so this is a check, rarely a sort."""
    if "start" not in df.columns or df.is_empty():
        return df
    if df["start"].null_count() or not df["start"].is_sorted():
        return df.sort("start")
    return df.with_columns(pl.col("start").set_sorted())


ReadFn = Callable[[str], pl.DataFrame]


# The logical tables build_trace reads, in the order it reads them (a caller may read each
# ahead while the one before it is built).
READ_ORDER = (
    "kernels",
    "graphs",
    "memcpy",
    "memset",
    "api",
    "syncs",
    "events",
    "nvtx",
    "memory",
    "overhead",
)


def build_trace(
    reader: Reader,
    read: ReadFn,
    read_metrics: Callable[[], pl.DataFrame],
    *,
    nvtx_span: Span | None = None,
    nvtx: pl.DataFrame | None = None,
    read_spans: tuple[Span, ...] | None = None,
    capture: tuple[tuple[int, int] | None, dict[str, int]] = (None, {}),
    progress: Callable[[str], None] | None = None,
    host_begun: HostRead | None = None,
) -> Trace:
    """The trace model from the raw frames ``read`` returns for each logical table (the whole
    capture, one time span, or the rows of chosen steps: :mod:`traceclf.pipeline.twopass`).
    ``read_spans`` records which time spans the frames hold (None: the whole capture).
    ``host_begun``: the host side's read begun by the caller (:func:`begin_host_read`),
    taken where it reads the threads of the CUDA calls read here."""
    info = reader.info
    step = progress or (lambda _msg: None)
    unusable: dict[str, int] = {}

    step("strings")
    strings = reader.strings
    # (NCCL's payloads: filtered scans of the whole NVTX table, needing nothing built here)
    nccl_read = second_lane("traceclf-nccl-payloads").submit(read_nccl_calls, reader)

    step("kernels")
    kernels = usable(read("kernels"), "kernels", unusable)
    name, short = lookup_names(strings, kernels["name_id"], kernels["short_id"])
    unknown = pl.lit("<unknown kernel>").cast(pl.Categorical)
    # Categorical: a few hundred distinct names over millions of rows (~4x less memory).
    kernels = kernels.with_columns(
        name=pl.coalesce(name, short).fill_null(unknown),
        short_name=pl.coalesce(short, name).fill_null(unknown),
    ).drop("name_id", "short_id")

    step("graphs")
    graphs = usable(read("graphs"), "graphs", unusable)

    step("copies")
    memcpy = (
        usable(read("memcpy"), "memcpy", unusable)
        .with_columns(
            op=pl.lit("memcpy"),
            direction=pl.col("copy_kind").replace_strict(
                COPY_KINDS, default="other", return_dtype=pl.String
            ),
            pageable=(pl.col("src_kind") == MEMORY_KIND_PAGEABLE)
            | (pl.col("dst_kind") == MEMORY_KIND_PAGEABLE),
        )
        .drop("src_kind", "dst_kind")
    )
    memset = usable(read("memset"), "memset", unusable).with_columns(
        op=pl.lit("memset"),
        copy_kind=pl.lit(None, pl.Int32),
        direction=pl.lit("memset"),
        pageable=pl.lit(False),
    )
    copies = pl.concat([memcpy, memset.select(memcpy.columns)], how="vertical")
    if memcpy.height and memset.height:
        copies = copies.sort("start")
    # a size no copy has (negative, over MAX_ALLOCATION_BYTES): unknown, counted; the copy's
    # time still counts
    odd = (pl.col("bytes") < 0) | (pl.col("bytes") > MAX_ALLOCATION_BYTES)
    if copies.height and copies.select(odd.any()).item():
        for op, n in copies.filter(odd).group_by("op").len().iter_rows():
            unusable[f"{op}.implausible_bytes"] = n
        copies = copies.with_columns(bytes=pl.when(odd).then(None).otherwise(pl.col("bytes")))

    step("CUDA API")
    api = usable(read("api"), "api", unusable)
    (api_names,) = lookup_names(strings, api["name_id"])
    api = api.with_columns(
        name=api_names.fill_null(pl.lit("<unknown api>").cast(pl.Categorical))
    ).drop("name_id")
    host_side = begin_host_read(
        reader, api, read_spans if read_spans is not None else nvtx_span, host_begun
    )

    step("syncs")
    syncs = usable(read("syncs"), "syncs", unusable)
    events = read("events")  # cudaEventRecord rows: no time, whole capture

    step("NVTX")
    raw_nvtx = read("nvtx")  # (step sampling: the ranges over the analysed steps)
    # ranges never closed (open when the capture stopped, or their end not written) have no
    # span to measure: counted, as left out (a step range among them merges two steps)
    if raw_nvtx.height and (
        n := raw_nvtx.filter(
            pl.col("event_type").is_in(NVTX_RANGE_TYPES) & pl.col("end").is_null()
        ).height
    ):
        unusable["nvtx.no_end"] = n
    if nvtx is None:
        nvtx = nvtx_ranges(reader, raw_nvtx)
    # (a range's process comes from its thread; one without stays, as it always has)
    nvtx = usable(nvtx, "nvtx", unusable, process=False)
    if nvtx_span is not None:
        nvtx = nvtx.filter((pl.col("start") < nvtx_span[1]) & (pl.col("end") > nvtx_span[0]))

    step("NCCL payloads")
    # (whole capture, like the NVTX ranges: a few per collective; no measure depends on them)
    nccl = optional(reader, "NCCL payload values", nccl_read.result, nccl_empty())

    step("memory")
    memory = read("memory")  # instants; the whole capture is needed for the peak
    memory = usable(memory, "memory", unusable)
    # (a size that is negative or over MAX_ALLOCATION_BYTES is read as null: ingest/tables.py)
    if memory.height and (n := memory["delta"].null_count()):
        unusable["memory.implausible_bytes"] = n
        memory = memory.filter(pl.col("delta").is_not_null())
    # (a process-wide buffer flush may name no thread: kept; a row without times is not)
    overhead = usable(read("overhead"), "overhead", unusable, process=False)
    overhead = _names(strings, "name_id", "name")(overhead)

    step("GPU metrics")
    gpu_metrics = optional(
        reader, "GPU metrics", read_metrics, pl.DataFrame(schema=GPU_METRICS_SCHEMA)
    )

    gpus = optional(
        reader, "GPU descriptions", lambda: read_gpus(reader), pl.DataFrame(schema=GPU_SCHEMA)
    )
    processes = optional(
        reader, "process names", lambda: read_processes(reader), pl.DataFrame(schema=PROCESS_SCHEMA)
    )
    device_map = optional(
        reader,
        "CUDA device map",
        lambda: read_device_map(reader),
        pl.DataFrame(schema=DEVICE_MAP_SCHEMA),
    )
    threads = optional(
        reader,
        "thread names",
        lambda: read_threads(reader, strings),
        pl.DataFrame(schema=THREAD_SCHEMA),
    )
    session = optional(
        reader,
        "session start and host",
        lambda: read_session(reader),
        {"utc_offset_ns": None, "host": None},
    )
    payload = optional(
        # (a read of one time span has some of the NVTX rows: the payload check scans; the
        # analysed steps of a long capture have a range of every recurring collective)
        reader,
        "NCCL payloads",
        lambda: nccl_payload(reader, raw_nvtx if nvtx_span is None else None),
        "absent",
    )

    step("host side")
    host = optional(
        reader,
        "host side (OS runtime calls, samples, scheduling, diagnostics)",
        host_side.future.result,
        empty_host_side(),
    )

    trace = Trace(
        path=info.path,
        nsys_version=info.nsys_version,
        schema_version=info.schema_version,
        tables=info.tables,
        kernels=sorted_by_start(kernels),
        graphs=sorted_by_start(graphs),
        copies=sorted_by_start(copies),
        api=sorted_by_start(api),
        syncs=sorted_by_start(syncs),
        nvtx=nvtx,
        gpu_metrics=gpu_metrics,
        memory=sorted_by_start(memory),
        overhead=sorted_by_start(overhead),
        gpus=gpus,
        processes=processes,
        device_map=device_map,
        threads=threads,
        events=events,
        nccl=nccl,
        session=session,
        nccl_payload=payload,
        unusable_rows=dict(sorted(unusable.items())),
        repaired_strings=dict(sorted(reader.repaired.items())),
        pid_from_calls=reader.pid_from_calls,
        read_spans=read_spans,
        capture_span=capture[0],
        capture_rows=capture[1],
        osrt=host.osrt,
        samples=host.samples,
        callchains=host.callchains,
        py_frames=host.py_frames,
        sched=host.sched,
        diagnostics=host.diagnostics,
        host_sources=(() if nvtx.is_empty() else ("nvtx",)) + host.sources,
        host_notes=host.notes,
    )
    release_read_buffers()
    return trace


@dataclass(frozen=True)
class HostRead:
    """The host side's read (:func:`~traceclf.ingest.hosttables.read_host_side`) of
    ``threads`` in ``spans``, under way on a lane of its own."""

    threads: frozenset[int]
    spans: Span | tuple[Span, ...] | None
    future: Future[HostSide]


def begin_host_read(
    reader: Reader,
    calls: pl.DataFrame,
    spans: Span | tuple[Span, ...] | None,
    begun: HostRead | None = None,
) -> HostRead:
    """The host side read on the threads that made ``calls`` (only their time can leave the
    GPU idle), by filtered scans of whole tables (SQLite's work, without the GIL): on a lane
    beside what reads and builds the rest when two cores may be kept busy. ``begun``, a read
    begun before, when it reads those very threads and spans; else it is let finish (no
    thread left at work) and the read begun again."""
    threads = frozenset(int(t) for t in calls["global_tid"].unique().drop_nulls().to_list())
    if begun is not None:
        if begun.threads == threads and begun.spans == spans:
            return begun
        begun.future.exception()  # (waits: the read it began is not left running)
    future = second_lane("traceclf-host-side").submit(read_host_side, reader, threads, spans)
    return HostRead(threads, spans, future)


T = TypeVar("T")


def optional(reader: Reader, what: str, read: Callable[[], T], absent: T) -> T:
    """Metadata no measure depends on (GPU and process descriptions, the session, GPU metrics):
    unreadable, it is absent, said in a warning; a valid export never fails on it."""
    try:
        return read()
    except TraceError as e:
        warnings.warn(
            TraceWarning(f"{reader.info.path}: {what} left out: {e.problem}"), stacklevel=2
        )
        return absent


def nvtx_ranges(reader: Reader, raw: pl.DataFrame) -> pl.DataFrame:
    """NVTX push/pop and start/end ranges of the whole capture, with text and domain names,
    sorted by start (``raw``: the NVTX_EVENTS rows as read)."""
    domains = (
        raw.filter(pl.col("event_type") == NVTX_DOMAIN_CREATE)
        .select("domain_id", domain=pl.col("text"))
        .unique("domain_id", maintain_order=True)
    )
    ranges = raw.filter(pl.col("event_type").is_in(NVTX_RANGE_TYPES) & pl.col("end").is_not_null())
    ranges = ranges.join(
        reader.strings.rename({"id": "text_id", "value": "_t"}), on="text_id", how="left"
    )
    return (
        ranges.join(domains, on="domain_id", how="left")
        .select(
            "start",
            "end",
            text=pl.coalesce("text", "_t", pl.lit("")),
            domain=pl.col("domain").fill_null(""),
            pid=decode_pid("global_tid"),
            tid=decode_tid("global_tid"),
            global_tid="global_tid",
        )
        .sort("start")
    )
