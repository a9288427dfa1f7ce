"""The device side of an export: its GPUs (TARGET_INFO_GPU or the older CUPTI device table),
which physical GPU each process's CUDA device is, the processes' names, and the GPU-metric
samples the measures use (``GPU_METRICS``, resolved by metric name: ids are not stable)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import polars as pl

from traceclf.ingest.reader import decode_pid, in_ranges
from traceclf.ingest.tables import PAYLOAD_COLUMNS
from traceclf.ingest.utf8 import blob_sql

if TYPE_CHECKING:
    from traceclf.ingest.reader import Reader


# The GPU metrics the measures use, each under the names nsys gives it on different GPUs;
# the others (clocks, graphics warps, PCIe) are not read: on a 1 GB export GPU_METRICS is most
# of the rows.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "sm_active": ("SMs Active [Throughput %]", "SM Active [Throughput %]"),
    "sm_issue": ("SM Issue [Throughput %]", "SM Issue Active [Throughput %]"),
    "tensor_active": (
        "Tensor Active [Throughput %]",
        "Tensor Active / FP16 Active [Throughput %]",
        "Tensor Pipe Active [Throughput %]",
    ),
}
GPU_METRICS_SCHEMA = {
    "timestamp": pl.Int64,
    "source": pl.Int64,
    "metric": pl.Categorical,
    "value": pl.Float32,
}


# Columns the metrics query below needs; an export laid out otherwise is read without metrics.
METRIC_TABLE_COLUMNS = {
    "GPU_METRICS": {"timestamp", "typeId", "metricId", "value"},
    "TARGET_INFO_GPU_METRICS": {"typeId", "metricId", "metricName"},
}


def read_gpu_metrics(
    reader: Reader,
    spans: tuple[int, int] | Sequence[tuple[int, int]] | None,
    *,
    rowids: Sequence[tuple[int, int]] | None = None,
) -> pl.DataFrame:
    """Samples of the metrics in :data:`METRIC_NAMES` inside ``spans`` (one time span or
    several; None: all), only from the rowid ranges ``rowids`` when given."""
    columns = reader.info.columns
    if any(not need <= set(columns.get(t, ())) for t, need in METRIC_TABLE_COLUMNS.items()):
        return pl.DataFrame(schema=GPU_METRICS_SCHEMA)
    names = reader.small_table(
        "TARGET_INFO_GPU_METRICS",
        METRIC_TABLE_COLUMNS["TARGET_INFO_GPU_METRICS"],
        text=("metricName",),
    )
    known = {name: key for key, names in METRIC_NAMES.items() for name in names}
    wanted = names.filter(pl.col("metricName").is_in(list(known)))
    # The ids go into SQL: only integers (a TEXT id could hold SQL, a recursive query that
    # never ends); metrics described otherwise are not read.
    if wanted.is_empty() or not all(
        dtype.is_integer() for dtype in wanted.select("typeId", "metricId").dtypes
    ):
        return pl.DataFrame(schema=GPU_METRICS_SCHEMA)
    ids = ", ".join(str(int(i)) for i in wanted["metricId"].drop_nulls().unique().to_list())
    if not ids:
        return pl.DataFrame(schema=GPU_METRICS_SCHEMA)
    clauses = [f"metricId IN ({ids})"]
    if spans is not None:
        spans = [spans] if isinstance(spans[0], int) else list(spans)
        clauses.append(
            " OR ".join(f"(timestamp BETWEEN {int(lo)} AND {int(hi)})" for lo, hi in spans) or "0"
        )
    select = "SELECT timestamp, typeId, metricId, value FROM GPU_METRICS"
    queries = (
        reader.partitioned(select, "GPU_METRICS", clauses)
        if rowids is None
        else in_ranges(select, rowids, clauses)
    )
    raw = reader.sql(queries) if queries else pl.DataFrame()
    if raw.is_empty():
        return pl.DataFrame(schema=GPU_METRICS_SCHEMA)
    return (
        raw.join(wanted.select("typeId", "metricId", "metricName"), on=["typeId", "metricId"])
        # nsys 2025.3 writes some unsigned values as negative: those samples are invalid, as
        # is a percentage over 100 (5000% SMs active was a verdict's evidence)
        .filter(pl.col("value").is_between(0, 100))
        .select(
            pl.col("timestamp").cast(pl.Int64),
            source=pl.col("typeId").cast(pl.Int64),
            metric=pl.col("metricName").replace_strict(known).cast(pl.Categorical),
            value=pl.col("value").cast(pl.Float32),
        )
        .sort("timestamp")
    )


# Logical GPU columns and their physical names: TARGET_INFO_GPU (nsys >= 2021.3) first, then the
# CUPTI device-record names of TARGET_INFO_CUDA_GPU (older). Units are the same in both.
GPU_TABLES = ("TARGET_INFO_GPU", "TARGET_INFO_CUDA_GPU")
GPU_COLUMNS: dict[str, tuple[str, ...]] = {
    "gpu_id": ("id", "deviceId"),
    "name": ("name",),
    "chip": ("chipName",),
    "sm_count": ("smCount", "numMultiprocessors"),
    "memory_bytes": ("totalMemory", "globalMemorySize"),
    "max_warps_per_sm": ("maxWarpsPerSm", "maxWarpsPerMultiprocessor"),
    "max_blocks_per_sm": ("maxBlocksPerSm", "maxBlocksPerMultiprocessor"),
    "max_registers_per_sm": ("maxRegistersPerSm", "maxRegistersPerMultiprocessor"),
    "max_shmem_per_sm": ("maxShmemPerSm", "maxSharedMemoryPerMultiprocessor"),
    "threads_per_warp": ("threadsPerWarp", "numThreadsPerWarp"),
    "memory_bandwidth": ("memoryBandwidth",),
    "clock_rate": ("clockRate",),
    "compute_major": ("computeMajor", "computeCapabilityMajor"),
    "compute_minor": ("computeMinor", "computeCapabilityMinor"),
    "bus": ("busLocation",),
    "uuid": ("uuid",),
}
# The GPU's sizes and limits, and the largest any GPU could have: a value outside (0, that]
# is read as unknown (a hand-edited or damaged table: the verdict must not scale by it).
GPU_SIZES = {
    "sm_count": 100_000,
    "memory_bytes": 1 << 50,
    "max_warps_per_sm": 1_024,
    "max_blocks_per_sm": 1_024,
    "max_registers_per_sm": 1 << 24,
    "max_shmem_per_sm": 1 << 30,
    "threads_per_warp": 1_024,
    "memory_bandwidth": 1 << 50,
    "clock_rate": 1 << 40,
}
GPU_SCHEMA = {
    out: (pl.String if out in ("name", "chip", "bus", "uuid") else pl.Int64) for out in GPU_COLUMNS
}
# physical columns holding text, read as bytes (ingest/utf8.py)
GPU_TEXT = tuple(
    s for out, srcs in GPU_COLUMNS.items() if GPU_SCHEMA[out] == pl.String for s in srcs
)


def read_gpus(reader: Reader) -> pl.DataFrame:
    """The GPUs of the capture (:data:`GPU_SCHEMA`): from TARGET_INFO_GPU, each fact it lacks
    from TARGET_INFO_CUDA_GPU of the same device (exports of 2020-2021 kept only the GPU's
    name in the first and its SMs, memory and limits in the second: occupancy and SM fill
    were unknown there)."""
    tables = [_gpu_table(reader, t) for t in GPU_TABLES if reader.info.has(t)]
    tables = [t for t in tables if not t.is_empty()]
    if not tables:
        return pl.DataFrame(schema=GPU_SCHEMA)
    gpus = tables[0]
    for other in tables[1:]:
        # (the same device and the same GPU: the second table's deviceId is a process's CUDA
        # number, which CUDA_VISIBLE_DEVICES can make another GPU's)
        facts = [c for c in GPU_SCHEMA if c not in ("gpu_id", "name")]
        gpus = gpus.join(other, on=["gpu_id", "name"], how="left", suffix="_other").select(
            "gpu_id", "name", *(pl.coalesce(c, f"{c}_other").alias(c) for c in facts)
        )
    return gpus.select(list(GPU_SCHEMA))


def _gpu_table(reader: Reader, table: str) -> pl.DataFrame:
    """One GPU table's facts as :data:`GPU_SCHEMA`, a row per device."""
    wanted = (src for sources in GPU_COLUMNS.values() for src in sources)
    raw = reader.small_table(table, wanted, text=GPU_TEXT)
    if raw.is_empty():
        return pl.DataFrame(schema=GPU_SCHEMA)

    def column(out: str) -> pl.Expr:
        src = next((s for s in GPU_COLUMNS[out] if s in raw.columns), None)
        value = (pl.col(src) if src else pl.lit(None)).cast(GPU_SCHEMA[out], strict=False)
        if out not in GPU_SIZES:
            return value
        # (a size no GPU has is unknown, not a fact: -5 SMs made memory -80789367500% full)
        return pl.when(value.is_between(1, GPU_SIZES[out])).then(value)

    return raw.select([column(out).alias(out) for out in GPU_COLUMNS]).unique(
        "gpu_id", maintain_order=True
    )


PROCESS_SCHEMA = {"pid": pl.Int64, "process_name": pl.String}
THREAD_SCHEMA = {"global_tid": pl.Int64, "pid": pl.Int64, "tid": pl.Int64, "thread_name": pl.String}
DEVICE_MAP_SCHEMA = {"pid": pl.Int64, "device_id": pl.Int64, "gpu_id": pl.Int64}


def read_processes(reader: Reader) -> pl.DataFrame:
    raw = reader.small_table("PROCESSES", ("globalPid", "name"), text=("name",))
    if raw.is_empty() or not {"globalPid", "name"} <= set(raw.columns):
        return pl.DataFrame(schema=PROCESS_SCHEMA)
    return raw.select(
        pid=decode_pid("globalPid"), process_name=pl.col("name").cast(pl.String)
    ).unique("pid", maintain_order=True)


def read_threads(reader: Reader, strings: pl.DataFrame) -> pl.DataFrame:
    """Thread names (``ThreadNames``): which thread launched what, e.g. PyTorch's autograd
    threads ``pt_autograd_N`` that run the backward pass."""
    raw = reader.small_table("ThreadNames", ("globalTid", "nameId"))
    if raw.is_empty() or not {"globalTid", "nameId"} <= set(raw.columns):
        return pl.DataFrame(schema=THREAD_SCHEMA)
    return (
        raw.select(
            global_tid=pl.col("globalTid").cast(pl.Int64), id=pl.col("nameId").cast(pl.Int64)
        )
        .join(strings, on="id", how="left")
        .select(
            "global_tid",
            pid=decode_pid("global_tid"),
            tid=(pl.col("global_tid") % (1 << 24)).cast(pl.Int64),
            thread_name=pl.col("value").cast(pl.String),
        )
        .unique("global_tid", maintain_order=True)
    )


def nccl_payload(reader: Reader, raw_nvtx: pl.DataFrame | None) -> str:
    """Whether NCCL's NVTX ranges carry their payload (message sizes, peers...): ``"values"``,
    ``"declared_empty"`` (payload schemas declared, no range carries a value) or ``"absent"``.
    ``raw_nvtx``: the NVTX_EVENTS rows as read (their ``payload`` flag: any payload column
    set): the whole capture's, or a long capture's analysed steps' (NCCL's ranges recur in
    every step, with their payload or without); None when the rows of one time span were
    read: then the table is scanned."""
    if raw_nvtx is None:
        return _nccl_payload_scan(reader)
    carried = raw_nvtx.filter(pl.col("payload") == 1) if "payload" in raw_nvtx.columns else None
    if carried is not None and carried.height:
        strings = reader.strings.rename({"id": "text_id", "value": "_t"})
        text = carried.join(strings, on="text_id", how="left").select(
            pl.coalesce("text", "_t").str.to_lowercase()
        )
        # (SQLite's LIKE 'nccl%' of earlier releases: case-blind for ASCII)
        if text.to_series().str.starts_with("nccl").any():
            return "values"
    return _declared(reader)


def _declared(reader: Reader) -> str:
    """``"declared_empty"`` when NCCL's own payload schema is declared (an entry named as
    ingest/nccl_calls.py's first: other libraries, e.g. nsys's Python sampling, declare
    schemas of their own), else ``"absent"``."""
    if "name" not in reader.info.columns.get("NVTX_PAYLOAD_SCHEMA_ENTRIES", ()):
        return "absent"
    hit = reader.sql(
        "SELECT count(*) AS n FROM NVTX_PAYLOAD_SCHEMA_ENTRIES "
        "WHERE CAST(name AS BLOB) = CAST('NCCL communicator ID' AS BLOB)"
    )
    return "declared_empty" if int(hit["n"][0]) else "absent"


def _nccl_payload_scan(reader: Reader) -> str:
    """:func:`nccl_payload` by a scan of NVTX_EVENTS in SQL (for a read of some time spans)."""
    columns = reader.info.columns.get("NVTX_EVENTS", ())
    present = [c for c in PAYLOAD_COLUMNS if c in columns]
    if present and {"text", "textId"} <= set(columns) and reader.info.has("StringIds"):
        any_value = " OR ".join(f'e."{c}" IS NOT NULL' for c in present)
        # A scan of the whole table: the names' ids found once (not a join per row), and the
        # name tested before the payload columns, which sit at the end of every row.
        named = "SELECT id FROM StringIds WHERE value LIKE 'nccl%'"
        hit = reader.sql(
            "SELECT count(*) AS n FROM (SELECT 1 FROM NVTX_EVENTS e WHERE (e.text LIKE 'nccl%' "
            f"OR (e.text IS NULL AND e.textId IN ({named}))) AND ({any_value}) LIMIT 1)"
        )
        if int(hit["n"][0]):
            return "values"
    return _declared(reader)


def read_device_map(reader: Reader) -> pl.DataFrame:
    """(pid, CUDA device ordinal) -> physical GPU id, for ranks that each see their GPU as 0."""
    raw = reader.small_table("TARGET_INFO_CUDA_DEVICE", ("gpuId", "cudaId", "pid"))
    if raw.is_empty() or not {"gpuId", "cudaId", "pid"} <= set(raw.columns):
        return pl.DataFrame(schema=DEVICE_MAP_SCHEMA)
    return raw.select(
        pid=pl.col("pid").cast(pl.Int64),
        device_id=pl.col("cudaId").cast(pl.Int64),
        gpu_id=pl.col("gpuId").cast(pl.Int64),
    ).unique(["pid", "device_id"], maintain_order=True)


def read_session(reader: Reader) -> dict:
    """Where this export's clock sits and on which host it ran, to put ranks from several
    exports on one clock: ``utc_offset_ns`` is added to a session timestamp to get UTC ns
    (TARGET_INFO_SESSION_START_TIME.utcEpochNs is the UTC time of session time 0, or of
    ``systemClockNs`` where newer exports give it: their timestamps are the system clock's);
    ``host`` is the Hostname of TARGET_INFO_SYSTEM_ENV. Either is None when absent."""
    start = reader.small_table("TARGET_INFO_SESSION_START_TIME", ("utcEpochNs", "systemClockNs"))
    offset = None
    if "utcEpochNs" in start.columns and len(start) and start["utcEpochNs"][0] is not None:
        clock = start["systemClockNs"][0] if "systemClockNs" in start.columns else None
        offset = int(start["utcEpochNs"][0]) - int(clock or 0)
    return {"utc_offset_ns": offset, "host": _hostname(reader)}


def _hostname(reader: Reader) -> str | None:
    """The Hostname row of TARGET_INFO_SYSTEM_ENV, and only that row: nsys 2022.2/2022.3 keep
    raw bytes (GpuInfo, NicInfo) in other rows of its TEXT value column."""
    if not {"name", "value"} <= set(reader.info.columns.get("TARGET_INFO_SYSTEM_ENV", ())):
        return None
    hit = reader.sql(
        f"SELECT {blob_sql('value')} AS value FROM TARGET_INFO_SYSTEM_ENV "
        "WHERE name = 'Hostname' LIMIT 1"
    )
    if hit.is_empty():
        return None
    (value,) = reader.decoded(hit, "TARGET_INFO_SYSTEM_ENV", {"value": "value"})["value"]
    return value or None
