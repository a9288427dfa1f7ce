"""Small nsys-like SQLite exports built inside tests, with known answers (CONSTRUCTED, not
captured): for logic no real trace exercises, e.g. cross-stream CUDA event waits, reused event
handles, graph launches, several hosts.

Only the tables and columns the loader reads are written, under nsys 2025.3's names (schema
3.20.3). Times are ns. The builder hands out correlationIds in the order its methods are
called, as CUPTI does in issue order, so write a test's calls in the order the host made them.

    x = Export()
    c = x.kernel("gemm", 1_000, 5_000, launch_at=500)       # launch call [500, 600)
    x.write(tmp_path / "run.sqlite")
"""

from __future__ import annotations

import sqlite3
import struct
from dataclasses import dataclass, field
from pathlib import Path

PID = 4242
NO_EVENT = 0xFFFFFFFF
LAUNCH_NS = 100  # duration of a launch call on the host
COPY_KINDS = {"HtoD": 1, "DtoH": 2, "DtoD": 8, "PtoP": 10}
SYNC_STREAM_WAIT = 2  # CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_STREAM_WAIT_EVENT
SYNC_STREAM = 3
NCCL_DOMAIN = "NCCL"
# NCCL's NVTX payload schemas as the real captures declare them (fixtures/h100_nccl_groups,
# h100_moe_megatron_ep2: NVTX_PAYLOAD_SCHEMA_ENTRIES): schemaId -> (payloadSize, entries of
# (idx, type, name, offset; None: 0)). Types: 18 UINT64, 22 SIZE, 5 INT, 16777236 the
# reduction enum.
REDUCTION_ENUM = 16777236
NCCL_SCHEMAS = {
    16777218: (24, [(0, 18, "NCCL communicator ID", None), (1, 5, "No. of ranks", 8),
                    (2, 5, "Rank", 12), (3, 5, "CUDA device", 16)]),
    16777220: (16, [(0, 18, "NCCL communicator ID", None), (1, 22, "Message size [bytes]", 8)]),
    16777221: (24, [(0, 18, "NCCL communicator ID", None), (1, 22, "Message size [bytes]", 8),
                    (2, REDUCTION_ENUM, "Reduction operation", 16)]),
    16777225: (24, [(0, 18, "NCCL communicator ID", None), (1, 22, "Message size [bytes]", 8),
                    (2, 5, "Peer rank", 16)]),
    16777226: (24, [(0, 18, "NCCL communicator ID", None), (1, 22, "Message size [bytes]", 8),
                    (2, 5, "Peer rank", 16)]),
    16777232: (16, [(0, 18, "NCCL communicator ID", None), (1, 22, "Message size [bytes]", 8)]),
}  # fmt: skip
NCCL_CALL_SCHEMAS = {
    "ncclCommInitRankConfig": 16777218,
    "ncclAllGather": 16777220,
    "ncclAllReduce": 16777221,
    "ncclSend": 16777225,
    "ncclRecv": 16777226,
    "ncclAlltoAll": 16777232,
}
NCCL_PACK = {18: "<Q", 22: "<Q", 5: "<i", REDUCTION_ENUM: "<I"}


def global_pid(pid: int) -> int:
    return pid << 24


def global_tid(pid: int, tid: int) -> int:
    return (pid << 24) | tid


@dataclass
class Export:
    """One export being built. ``pid``/``device`` are the defaults for every row."""

    pid: int = PID
    device: int = 0
    host: str = "node0"
    utc_epoch_ns: int | None = 1_700_000_000_000_000_000
    gpu_uuid: str = "GPU-constructed-0"
    _corr: int = 0
    strings: dict[str, int] = field(default_factory=dict)
    rows: dict[str, list[tuple]] = field(default_factory=dict)

    # --- host-side calls -------------------------------------------------------------------
    def _call(self, api: str, at: int, dur: int = LAUNCH_NS, pid: int | None = None) -> int:
        self._corr += 1
        pid = self.pid if pid is None else pid
        self._add(
            "CUPTI_ACTIVITY_KIND_RUNTIME",
            (at, at + dur, 0, global_tid(pid, pid), self._corr, self._sid(api)),
        )
        return self._corr

    def _sid(self, text: str) -> int:
        return self.strings.setdefault(text, len(self.strings) + 1)

    def _add(self, table: str, row: tuple) -> None:
        self.rows.setdefault(table, []).append(row)

    # --- GPU work --------------------------------------------------------------------------
    def kernel(
        self,
        name: str,
        start: int,
        end: int,
        *,
        stream: int = 7,
        launch_at: int | None = None,
        launch_dur: int = LAUNCH_NS,
        corr: int | None = None,
        graph_node: int | None = None,
        pid: int | None = None,
        grid: int = 132,
    ) -> int:
        """A kernel row; its launch call starts at ``launch_at`` (no API row when None, unless
        ``corr`` names the call that launched it, e.g. a graph launch)."""
        pid = self.pid if pid is None else pid
        if corr is None:
            corr = (
                self._call("cudaLaunchKernel_v7000", launch_at, launch_dur, pid)
                if launch_at is not None
                else self._next_silent()
            )
        sid = self._sid(name)
        self._add(
            "CUPTI_ACTIVITY_KIND_KERNEL",
            (start, end, self.device, 1, stream, corr, global_pid(pid), sid, sid, grid, 1, 1,
             256, 1, 1, 32, 0, 0, graph_node, 1 if graph_node is not None else None),
        )  # fmt: skip
        return corr

    def _next_silent(self) -> int:
        self._corr += 1
        return self._corr

    def copy(
        self,
        start: int,
        end: int,
        *,
        kind: str = "HtoD",
        nbytes: int = 1 << 20,
        stream: int = 7,
        launch_at: int | None = None,
        pid: int | None = None,
        call: str = "cudaMemcpyAsync_v3020",
        call_ns: int = LAUNCH_NS,
    ) -> int:
        """A copy on the GPU, issued by ``call`` (from ``launch_at``, lasting ``call_ns``: a
        blocking ``cudaMemcpy_v3020`` of pageable memory lasts while it stages the copy)."""
        pid = self.pid if pid is None else pid
        corr = (
            self._call(call, launch_at, call_ns, pid)
            if launch_at is not None
            else self._next_silent()
        )
        self._add(
            "CUPTI_ACTIVITY_KIND_MEMCPY",
            (start, end, self.device, 1, stream, corr, global_pid(pid), nbytes,
             COPY_KINDS[kind], 1, 2),
        )  # fmt: skip
        return corr

    def graph(
        self, start: int, end: int, *, stream: int = 7, launch_at: int, graph_id: int = 1
    ) -> int:
        """A graph-level traced replay (GRAPH_TRACE row) launched by cudaGraphLaunch."""
        corr = self._call("cudaGraphLaunch_v10000", launch_at)
        self._add(
            "CUPTI_ACTIVITY_KIND_GRAPH_TRACE",
            (start, end, self.device, 1, stream, corr, global_pid(self.pid), graph_id, graph_id),
        )
        return corr

    def graph_launch(self, launch_at: int) -> int:
        """A cudaGraphLaunch call whose node kernels the test adds with ``kernel(corr=...)``
        (node-level tracing)."""
        return self._call("cudaGraphLaunch_v10000", launch_at)

    # --- events and synchronisation --------------------------------------------------------
    def record(self, event_sync_id: int, *, stream: int, at: int, event_id: int = 1) -> int:
        """cudaEventRecord on ``stream`` at host time ``at``."""
        corr = self._call("cudaEventRecord_v3020", at)
        self._add(
            "CUPTI_ACTIVITY_KIND_CUDA_EVENT",
            (self.device, 1, stream, corr, global_pid(self.pid), event_id, event_sync_id),
        )
        return corr

    def wait(self, event_sync_id: int, *, stream: int, at: int, event_id: int = 1) -> int:
        """cudaStreamWaitEvent: ``stream`` waits for the record with ``event_sync_id``."""
        corr = self._call("cudaStreamWaitEvent_v3020", at)
        self._add(
            "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",
            (at, at + LAUNCH_NS, self.device, 1, stream, corr, global_pid(self.pid),
             SYNC_STREAM_WAIT, event_id, event_sync_id),
        )  # fmt: skip
        return corr

    def stream_sync(self, start: int, end: int, *, stream: int = 7) -> int:
        """cudaStreamSynchronize on the host from ``start`` until it returns at ``end``."""
        corr = self._call("cudaStreamSynchronize_v3020", start, end - start)
        self._add(
            "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",
            (start, end, self.device, 1, stream, corr, global_pid(self.pid), SYNC_STREAM,
             NO_EVENT, NO_EVENT),
        )  # fmt: skip
        return corr

    def step(self, index: int, start: int, end: int, *, pid: int | None = None) -> None:
        """An NVTX push/pop range ``step N`` on the host."""
        self.nvtx(f"step {index}", start, end, pid=pid)

    def nvtx(self, text: str, start: int, end: int, *, pid: int | None = None) -> None:
        """An NVTX push/pop range of the default domain on the host."""
        pid = self.pid if pid is None else pid
        self._add("NVTX_EVENTS", (start, end, 59, text, None, global_tid(pid, pid), 0, None))

    # --- NCCL's NVTX ranges and payloads (as NCCL 2.28 writes them, nsys --include-blobs) ---
    def nccl_domain(self, at: int = 0, *, pid: int | None = None) -> None:
        """The NVTX domain NCCL creates (event type 75, domain 1, text 'NCCL')."""
        pid = self.pid if pid is None else pid
        self._add("NVTX_EVENTS", (at, None, 75, NCCL_DOMAIN, None, global_tid(pid, pid), 1, None))

    def nccl(
        self, call: str, start: int, end: int, values: dict | None = None, *, pid: int | None = None
    ) -> None:
        """An NCCL range (``ncclAllReduce``, ``ncclSend``, ``ncclGroupEnd``, ...) on the host;
        with ``values`` (entry name -> value) a payload of NCCL's schema for ``call``, as the
        blob nsys writes: ``u64 count``, ``{u64 schemaId, u64 size, u64 offset}``, the data."""
        pid = self.pid if pid is None else pid
        blob = None
        if values is not None:
            schema = NCCL_CALL_SCHEMAS[call]
            size, entries = NCCL_SCHEMAS[schema]
            data = bytearray(size)
            for _, kind, name, offset in entries:
                struct.pack_into(NCCL_PACK[kind], data, offset or 0, values.get(name, 0))
            blob = struct.pack("<QQQQ", 1, schema, size, 32) + bytes(data)
        self._add(
            "NVTX_EVENTS",
            (start, end, 59, None, self._sid(call), global_tid(pid, pid), 1, blob),
        )

    # --- output ----------------------------------------------------------------------------
    def write(self, path: Path) -> Path:
        with sqlite3.connect(path) as con:
            for ddl in SCHEMA:
                con.execute(ddl)
            con.executemany(
                "INSERT INTO META_DATA_EXPORT VALUES (?, ?)",
                [
                    ("EXPORT_PRODUCT_VERSION", "2025.3.2.0"),
                    ("EXPORT_SCHEMA_VERSION", "3.20.3"),
                    ("CONSTRUCTED", "built by tests/helpers/constructed.py"),
                ],
            )
            con.executemany(
                "INSERT INTO StringIds VALUES (?, ?)", [(i, s) for s, i in self.strings.items()]
            )
            pids = sorted(
                {r[6] >> 24 for r in self.rows.get("CUPTI_ACTIVITY_KIND_KERNEL", [])} | {self.pid}
            )
            con.executemany(
                "INSERT INTO PROCESSES VALUES (?, ?, ?)",
                [(global_pid(p), p, "python3") for p in pids],
            )
            con.executemany(
                "INSERT INTO TARGET_INFO_CUDA_DEVICE VALUES (?, ?, ?)",
                [(self.device, self.device, p) for p in pids],
            )
            con.execute(
                "INSERT INTO TARGET_INFO_GPU (id, name, busLocation, uuid, totalMemory, smCount,"
                " chipName, maxWarpsPerSm, threadsPerWarp) VALUES (?, 'NVIDIA H100 80GB HBM3',"
                " '0000:00:06.0', ?, 85017493504, 132, 'GH100', 64, 32)",
                (self.device, self.gpu_uuid),
            )
            con.execute(
                "INSERT INTO TARGET_INFO_SYSTEM_ENV VALUES (NULL, 'Local', 'Hostname', 619, ?)",
                (self.host,),
            )
            if self.utc_epoch_ns is not None:
                con.execute(
                    "INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, 'x', 'x')",
                    (self.utc_epoch_ns,),
                )
            for table, rows in self.rows.items():
                marks = ", ".join("?" * len(rows[0]))
                con.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
            if any(r[7] is not None for r in self.rows.get("NVTX_EVENTS", [])):
                self._payload_schemas(con)
        con.close()
        return path

    def _payload_schemas(self, con: sqlite3.Connection) -> None:
        """NCCL's schema rows, once per process that registered them (as nsys writes them)."""
        pids = {r[5] >> 24 for r in self.rows["NVTX_EVENTS"] if r[7] is not None}
        for _ in pids:
            for schema, (size, entries) in NCCL_SCHEMAS.items():
                con.execute(
                    "INSERT INTO NVTX_PAYLOAD_SCHEMAS VALUES (1, ?, NULL, 1, NULL, ?, ?, NULL)",
                    (schema, len(entries), size),
                )
                con.executemany(
                    "INSERT INTO NVTX_PAYLOAD_SCHEMA_ENTRIES VALUES "
                    "(1, ?, ?, NULL, ?, ?, NULL, NULL, ?)",
                    [(schema, i, kind, name, offset) for i, kind, name, offset in entries],
                )
            con.execute(
                "INSERT INTO NVTX_PAYLOAD_ENUMS VALUES (1, ?, 'ncclRedOp', 4)", (REDUCTION_ENUM,)
            )
            con.executemany(
                "INSERT INTO NVTX_PAYLOAD_ENUM_ENTRIES VALUES (1, ?, ?, ?, ?)",
                [(REDUCTION_ENUM, i, name, i or None) for i, name in enumerate(("Sum", "Prod"))],
            )


SCHEMA = (
    "CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT)",
    "CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE PROCESSES (globalPid INTEGER, pid INTEGER, name TEXT)",
    "CREATE TABLE TARGET_INFO_CUDA_DEVICE (gpuId INTEGER, cudaId INTEGER NOT NULL,"
    " pid INTEGER NOT NULL)",
    "CREATE TABLE TARGET_INFO_GPU (id INTEGER, name TEXT, busLocation TEXT, uuid TEXT,"
    " totalMemory INTEGER, smCount INTEGER, chipName TEXT, maxWarpsPerSm INTEGER,"
    " threadsPerWarp INTEGER)",
    "CREATE TABLE TARGET_INFO_SYSTEM_ENV (globalVid INTEGER, devStateName TEXT NOT NULL,"
    " name TEXT NOT NULL, nameEnum INTEGER NOT NULL, value TEXT NOT NULL)",
    "CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER, utcTime TEXT,"
    " localTime TEXT)",
    'CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, "end" INTEGER NOT NULL,'
    " eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER"
    " NOT NULL)",
    'CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, "end" INTEGER NOT NULL,'
    " deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,"
    " correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL,"
    " shortName INTEGER NOT NULL, gridX INTEGER, gridY INTEGER, gridZ INTEGER, blockX INTEGER,"
    " blockY INTEGER, blockZ INTEGER, registersPerThread INTEGER, staticSharedMemory INTEGER,"
    " dynamicSharedMemory INTEGER, graphNodeId INTEGER, graphId INTEGER)",
    'CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, "end" INTEGER NOT NULL,'
    " deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,"
    " correlationId INTEGER, globalPid INTEGER, bytes INTEGER NOT NULL, copyKind INTEGER"
    " NOT NULL, srcKind INTEGER, dstKind INTEGER)",
    'CREATE TABLE CUPTI_ACTIVITY_KIND_GRAPH_TRACE (start INTEGER NOT NULL, "end" INTEGER'
    " NOT NULL, deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER"
    " NOT NULL, correlationId INTEGER, globalPid INTEGER, graphId INTEGER NOT NULL,"
    " graphExecId INTEGER NOT NULL)",
    'CREATE TABLE CUPTI_ACTIVITY_KIND_SYNCHRONIZATION (start INTEGER NOT NULL, "end" INTEGER'
    " NOT NULL, deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER"
    " NOT NULL, correlationId INTEGER, globalPid INTEGER, syncType INTEGER NOT NULL,"
    " eventId INTEGER NOT NULL, eventSyncId INTEGER)",
    "CREATE TABLE CUPTI_ACTIVITY_KIND_CUDA_EVENT (deviceId INTEGER NOT NULL, contextId INTEGER"
    " NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,"
    " eventId INTEGER NOT NULL, eventSyncId INTEGER NOT NULL)",
    'CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, "end" INTEGER, eventType INTEGER'
    " NOT NULL, text TEXT, textId INTEGER, globalTid INTEGER, domainId INTEGER, binaryData TEXT)",
    "CREATE TABLE NVTX_PAYLOAD_SCHEMAS (domainId INTEGER, schemaId INTEGER, name TEXT, type"
    " INTEGER, flags INTEGER, numEntries INTEGER, payloadSize INTEGER, alignTo INTEGER)",
    "CREATE TABLE NVTX_PAYLOAD_SCHEMA_ENTRIES (domainId INTEGER, schemaId INTEGER, idx INTEGER,"
    " flags INTEGER, type INTEGER, name TEXT, description TEXT, arrayOrUnionDetail INTEGER,"
    " offset INTEGER)",
    "CREATE TABLE NVTX_PAYLOAD_ENUMS (domainId INTEGER, schemaId INTEGER, name TEXT, size INTEGER)",
    "CREATE TABLE NVTX_PAYLOAD_ENUM_ENTRIES (domainId INTEGER, schemaId INTEGER, idx INTEGER,"
    " name TEXT, value INTEGER)",
)
