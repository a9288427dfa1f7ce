"""An independent recomputation of traceclf's measures, for the tests that check the numbers
behind the report's evidence sentences (issue 10, tests/test_evidence_truth.py).

Nothing here imports traceclf (its loader, measures or polars code): the export is read with
:mod:`sqlite3`, the arithmetic is plain Python and NumPy. Only the taxonomy is shared, read as
data from rules/kernels.yaml, its regexes run with Python's :mod:`re` (first match wins). Each
measure follows its definition in docs/measures.md, under the report's name.

All interval arithmetic rests on one primitive, the union of intervals (a sweep):
``|A ∩ B| = |A| + |B| - |A ∪ B|`` and ``|A \\ B| = |A ∪ B| - |B|``.
"""

from __future__ import annotations

import itertools
import re
import sqlite3
import statistics
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import yaml

RULES = Path(__file__).resolve().parents[2] / "rules"
# docs/measures.md thresholds
MS = 1_000_000
LONG_GAP_NS = MS  # "idle gaps >= 1 ms with CUDA calls covering < half of them"
SYNC_SLACK_NS = 20_000  # "a synchronising call returned at the gap's start (within 20 µs)"
BIG_COPY_BYTES = 1 << 20  # next batch ("host->device copy of >= 1 MiB") and GB/s copies
SMALL_D2H_BYTES = 1024  # "device->host copies of <= 1 KiB"
WARMUP_PAUSE_REPLAYS, WARMUP_PAUSE_MIN_NS = 4, 20 * MS  # kernel_stats_outside_window
IDLE_CAUSES = ("launch", "sync", "input", "host", "graph", "other")
# docs/measures.md, dp_tp_exposed_frac: the collective kinds of data and tensor parallelism
DP_TP_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
# GPU-metric rows as nsys names them on different GPUs
METRIC_NAMES = {
    "sm_active_mean": ("SMs Active [Throughput %]", "SM Active [Throughput %]"),
    "sm_issue_mean": ("SM Issue [Throughput %]", "SM Issue Active [Throughput %]"),
    "tensor_active_mean": (
        "Tensor Active [Throughput %]",
        "Tensor Active / FP16 Active [Throughput %]",
        "Tensor Pipe Active [Throughput %]",
    ),
}

Table = list[tuple[str, re.Pattern]]

# ---------------------------------------------------------------- taxonomy: data, read as data


@cache
def taxonomy() -> dict:
    """rules/kernels.yaml ``taxonomy`` with compiled patterns. A kernel is communication when
    its family is ``communication`` (the first family: NCCL, DeepEP, HybridEP, NVSHMEM and
    userbuffers kernel names); all other kernels are compute."""
    raw = yaml.safe_load((RULES / "kernels.yaml").read_text())["taxonomy"]

    def table(key: str, label: str) -> Table:
        return [(e[label], re.compile(e["match"])) for e in raw[key]]

    return {
        "families": table("families", "family"),
        "comm_libraries": table("comm_libraries", "library"),
        "comm_kinds": table("comm_kinds", "kind"),
        "nvtx_collectives": [
            (e["source"], e["kind"], re.compile(e["match"])) for e in raw["nvtx_collectives"]
        ],
        "host_activities": table("host_activities", "activity"),
        **{key: {k: re.compile(v) for k, v in raw[key].items()} for key in ("nvtx", "cuda_api")},
        "fp8_gemm": re.compile(raw["fp8_gemm"]),
    }


def first(table: Table, text: str, default: str | None = None) -> str | None:
    return next((label for label, pattern in table if pattern.search(text)), default)


@cache
def callee(name: str) -> str:
    """docs/measures.md: what a kernel name is matched on, without its parameter list (the
    parenthesised group that closes the name, found by counting parentheses back from it)."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i]
    return name


@cache
def family(name: str) -> str:
    return first(taxonomy()["families"], callee(name), "other") or "other"


@cache
def api_is(kind: str, name: str) -> bool:
    """Whether a CUDA call is of ``kind``: sync, launch, alloc (taxonomy.cuda_api)."""
    return bool(taxonomy()["cuda_api"][kind].search(name))


# ---------------------------------------------------------------- intervals


def merged(*groups) -> np.ndarray:
    """Union of (start, end) pairs as disjoint sorted rows, by a sweep: +1 at each start, -1 at
    each end; the union is where the running count is positive (at one instant starts come
    first, so touching intervals merge)."""
    rows = [np.asarray(g, dtype=np.int64).reshape(-1, 2) for g in groups]
    iv = np.concatenate(rows) if rows else np.zeros((0, 2), np.int64)
    iv = iv[iv[:, 1] > iv[:, 0]]
    t = np.concatenate([iv[:, 0], iv[:, 1]])
    step = np.concatenate([np.ones(len(iv), np.int64), -np.ones(len(iv), np.int64)])
    order = np.lexsort((-step, t))
    t, count = t[order], np.cumsum(step[order])
    opens = (count > 0) & (np.concatenate([[0], count[:-1]]) == 0)
    return np.stack([t[opens], t[count == 0]], axis=1)


def length(*groups) -> int:
    """Length of the union of intervals."""
    iv = merged(*groups)
    return int((iv[:, 1] - iv[:, 0]).sum())


def covered(intervals, s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """ns of each [s, e) covered by the union of ``intervals``: P(e) - P(s), with P(t) the
    length of the union before t."""
    iv = merged(intervals)
    if not len(iv):
        return np.zeros(len(s), np.int64)
    before = np.concatenate([[0], np.cumsum(iv[:, 1] - iv[:, 0])])

    def prefix(t: np.ndarray) -> np.ndarray:
        n = np.searchsorted(iv[:, 0], t, side="right")  # intervals starting at or before t
        over = np.where(n > 0, np.maximum(iv[np.maximum(n - 1, 0), 1] - t, 0), 0)
        return before[n] - over

    return prefix(e) - prefix(s)


def clip(rows: list[dict], lo: int, hi: int) -> list[dict]:
    """Rows overlapping [lo, hi), with start/end clipped to it."""
    return [
        r | {"start": max(r["start"], lo), "end": min(r["end"], hi)}
        for r in rows
        if r["start"] < hi and r["end"] > lo
    ]


def spans(rows: list[dict]) -> list[tuple[int, int]]:
    return [(r["start"], r["end"]) for r in rows]


# ---------------------------------------------------------------- the export, read raw

PID = "(({} >> 24) & 16777215)"  # pid: bits 24..47 of globalPid / globalTid
QUERIES = {
    "kernels": "SELECT start, end, {pid} AS pid, deviceId AS device, correlationId AS corr, "
    "demangledName AS name_id, shortName AS short_id, gridX*gridY*gridZ AS grid, "
    "blockX*blockY*blockZ AS block, {node} AS node, streamId AS stream "
    "FROM CUPTI_ACTIVITY_KIND_KERNEL",
    "graphs": "SELECT start, end, {pid} AS pid, correlationId AS corr "
    "FROM CUPTI_ACTIVITY_KIND_GRAPH_TRACE",
    "memcpy": "SELECT start, end, {pid} AS pid, correlationId AS corr, bytes, copyKind, "
    "srcKind, dstKind FROM CUPTI_ACTIVITY_KIND_MEMCPY",
    "memset": "SELECT start, end, {pid} AS pid, correlationId AS corr, bytes "
    "FROM CUPTI_ACTIVITY_KIND_MEMSET",
    "api": "SELECT start, end, {tpid} AS pid, globalTid AS tid, correlationId AS corr, "
    "nameId AS name_id FROM CUPTI_ACTIVITY_KIND_RUNTIME",
    "nvtx": "SELECT start, end, {tpid} AS pid, globalTid AS tid, text, textId AS name_id "
    "FROM NVTX_EVENTS WHERE end IS NOT NULL AND eventType IN ({ranges})",
    "overhead": "SELECT start, end, {tpid} AS pid FROM PROFILER_OVERHEAD",
    "memory": "SELECT start, {pid} AS pid, deviceId AS device, bytes, memoryOperationType AS op, "
    "{mem_kind} AS kind FROM CUDA_GPU_MEMORY_USAGE_EVENTS ORDER BY start, rowid",
    "gpus": "SELECT id, name, chipName AS chip, smCount AS sm_count, totalMemory AS "
    "memory_bytes FROM TARGET_INFO_GPU",
    "device_map": "SELECT gpuId AS gpu, cudaId AS device, pid FROM TARGET_INFO_CUDA_DEVICE",
    "metrics": "SELECT m.timestamp, m.typeId AS source, m.value, n.metricName AS metric "
    "FROM GPU_METRICS m JOIN TARGET_INFO_GPU_METRICS n USING (typeId, metricId)",
}


@cache
def read_export(path: Path) -> dict[str, list[dict]]:
    """Every table the measures need, as lists of row dicts (absent table: no rows)."""
    con = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}

    def enum(table: str) -> dict[int, str]:
        return dict(con.execute(f"SELECT id, name FROM {table}")) if table in tables else {}

    kernel_cols = {r[1] for r in con.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)")}
    memory_cols = {r[1] for r in con.execute("PRAGMA table_info(CUDA_GPU_MEMORY_USAGE_EVENTS)")}
    event_types = {v: k for k, v in enum("ENUM_NSYS_EVENT_TYPE").items()}
    fields = {
        "pid": PID.format("globalPid"),
        "tpid": PID.format("globalTid"),
        "node": "graphNodeId" if "graphNodeId" in kernel_cols else "NULL",
        "mem_kind": "memKind" if "memKind" in memory_cols else "NULL",
        "ranges": ", ".join(  # push/pop and start/end ranges
            str(event_types.get(t, d))
            for t, d in (("NvtxPushPopRange", 59), ("NvtxStartEndRange", 60))
        ),
    }
    out: dict[str, list[dict]] = {}
    for name, sql in QUERIES.items():
        needed = re.findall(r"(?:FROM|JOIN) (\w+)", sql)
        if not all(t in tables for t in needed):
            out[name] = []
            continue
        cur = con.execute(sql.format(**fields))
        cols = [d[0] for d in cur.description]
        out[name] = [dict(zip(cols, row, strict=True)) for row in cur]
    strings = dict(con.execute("SELECT id, value FROM StringIds"))
    copy_kinds, mem_kinds = enum("ENUM_CUDA_MEMCPY_OPER"), enum("ENUM_CUDA_MEM_KIND")
    con.close()
    for k in out["kernels"]:
        k["name"] = strings.get(k.pop("name_id")) or strings.get(k["short_id"]) or ""
        k["short"] = strings.get(k["short_id"]) or k["name"]
        k["family"] = family(k["name"])
    for row in out["api"]:
        row["name"] = strings.get(row.pop("name_id"), "")
    for row in out["nvtx"]:
        row["text"] = row["text"] or strings.get(row.pop("name_id"), "") or ""
    for r in out["memory"]:
        kind = mem_kinds.get(r["kind"], "")  # CUDA_MEMOPR_MEMORY_KIND_PINNED, ...
        r["pinned"] = kind.endswith("_PINNED")
        r["host"] = r["pinned"] or kind.endswith("_PAGEABLE")
    for c in out["memcpy"]:
        kind = copy_kinds.get(c["copyKind"], "")  # CUDA_MEMCPY_KIND_HTOD, ..._UVM_HTOD, ...
        # (to or from a CUDA array crosses the host link too)
        c["h2d"] = kind.endswith(("_HTOD", "_HTOA"))
        c["d2h"] = kind.endswith(("_DTOH", "_ATOH"))
        c["peer"] = kind.endswith("_PTOP")
        c["uvm"] = "_UVM_" in kind
        c["on_device"] = kind.endswith(("_DTOD", "_PTOP", "_ATOA", "_ATOD", "_DTOA"))
        c["local"] = kind.endswith("_DTOD") and "_UVM_" not in kind  # within one GPU
        c["pageable"] = any(
            mem_kinds.get(c[k], "").endswith("_PAGEABLE") for k in ("srcKind", "dstKind")
        )
    return out


# NCCL's payload entries (src/include/nvtx_payload_schemas.h) and how each value is stored
NCCL_ENTRIES = {
    "NCCL communicator ID": ("comm", "<Q"),
    "No. of ranks": ("nranks", "<i"),
    "Rank": ("rank", "<i"),
    "Message size [bytes]": ("bytes", "<Q"),
    "Peer rank": ("peer", "<i"),
}


@cache
def nccl_calls(path: Path) -> list[dict]:
    """Every NVTX event of an NCCL domain that carries a payload, decoded by hand: the blob is
    ``u64 count``, ``count x {u64 schemaId, u64 size, u64 offset}``, then the payloads; each
    value sits at its schema entry's offset (NULL: 0). Rows: start, end, pid, tid, call (the
    range's name), and comm, nranks, rank, bytes, peer where the schema has them."""
    con = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    cols = {r[1] for r in con.execute("PRAGMA table_info(NVTX_EVENTS)")}
    if "NVTX_PAYLOAD_SCHEMA_ENTRIES" not in tables or "binaryData" not in cols:
        return []
    offsets: dict[int, dict[str, int]] = {}
    for schema, name, offset in con.execute(
        "SELECT DISTINCT schemaId, name, coalesce(offset, 0) FROM NVTX_PAYLOAD_SCHEMA_ENTRIES"
    ):
        if name in NCCL_ENTRIES:
            offsets.setdefault(schema, {})[name] = offset
    nccl_domains = set(
        con.execute(
            f"SELECT DISTINCT {PID.format('globalTid')}, domainId FROM NVTX_EVENTS "
            "WHERE eventType = 75 AND text = 'NCCL'"
        )
    )
    strings = dict(con.execute("SELECT id, value FROM StringIds"))
    out = []
    for start, end, tid, domain, text_id, blob in con.execute(
        "SELECT start, end, globalTid, domainId, textId, CAST(binaryData AS BLOB) "
        "FROM NVTX_EVENTS WHERE binaryData IS NOT NULL"
    ):
        pid = (tid >> 24) & 0xFFFFFF
        if (pid, domain) not in nccl_domains:
            continue
        (count,) = struct.unpack_from("<Q", blob, 0)
        for k in range(count):
            schema, _, at = struct.unpack_from("<QQQ", blob, 8 + 24 * k)
            if "NCCL communicator ID" not in offsets.get(schema, {}):
                continue
            row = {"start": start, "end": end, "pid": pid, "tid": tid}
            row["call"] = strings.get(text_id, "")
            for name, offset in offsets[schema].items():
                key, fmt = NCCL_ENTRIES[name]
                (row[key],) = struct.unpack_from(fmt, blob, at + offset)
            out.append(row)
    con.close()
    return sorted(out, key=lambda r: r["start"])


def grouped_peers(path: Path, pid: int, tid: int, launch: int) -> tuple[int, int, int] | None:
    """For a launch inside ``ncclGroupEnd``: (communicator, ranks it reached, ranks of the
    communicator), from the ncclSend/ncclRecv payloads since the group's ``ncclGroupStart``
    on the thread; None when the launch is in no group or the group holds no send/recv."""
    ex = read_export(path)
    mine = [n for n in ex["nvtx"] if n["tid"] == tid]
    end = [n for n in mine if n["text"] == "ncclGroupEnd" and n["start"] <= launch <= n["end"]]
    if not end:
        return None
    begun = [
        n["start"] for n in mine if n["text"] == "ncclGroupStart" and n["start"] <= end[0]["start"]
    ]
    if not begun:
        return None
    lo, hi = max(begun), end[0]["end"]
    calls = nccl_calls(path)
    p2p = [
        c
        for c in calls
        if c["tid"] == tid and c["call"] in ("ncclSend", "ncclRecv") and lo <= c["start"] <= hi
    ]
    if not p2p or len({c["comm"] for c in p2p}) != 1:
        return None
    comm = p2p[0]["comm"]
    sizes = [
        c["nranks"] for c in calls if c["pid"] == pid and c.get("comm") == comm and "nranks" in c
    ]
    if not sizes:
        return None
    return comm, len({c["peer"] for c in p2p}), max(sizes)


def rank_pids(path: Path) -> list[int]:
    """One rank per process that ran GPU work (kernels, graphs, copies)."""
    ex = read_export(path)
    return sorted({r["pid"] for t in ("kernels", "graphs", "memcpy", "memset") for r in ex[t]})


def gpu_of(path: Path, pid: int) -> dict | None:
    """The TARGET_INFO_GPU row of the rank's GPU: its most used CUDA device, mapped to a
    physical GPU through TARGET_INFO_CUDA_DEVICE where the export has that map."""
    ex = read_export(path)
    if not ex["gpus"]:
        return None
    devices = [k["device"] for k in ex["kernels"] if k["pid"] == pid]
    device = statistics.mode(devices) if devices else 0
    mapped = {(r["pid"], r["device"]): r["gpu"] for r in ex["device_map"]}
    gpu_id = mapped.get((pid, device), device)
    return next((g for g in ex["gpus"] if g["id"] == gpu_id), ex["gpus"][0])


# ---------------------------------------------------------------- one rank over one window


def rank_measures(
    path: Path,
    pid: int,
    window: tuple[int, int],
    steps: int,
    source: str = "none",
    label: str = "",
) -> dict:
    """The measures of rank ``pid`` over ``[lo, hi)`` holding ``steps`` steady steps (the
    report's ``steps.used``), found by ``source`` (``steps.source``: nvtx, graph, pattern,
    none; ``label``: the recurring kernel of pattern steps): fractions of the window, counts
    and bytes per step, and the step time statistics over the window's complete steps."""
    ex = read_export(path)
    mine = {t: [r for r in rows if r.get("pid") == pid] for t, rows in ex.items()}
    lo, hi = window
    w = Window(mine, lo, hi, max(hi - lo, 1), max(steps, 1), gpu_of(path, pid), source, path)
    table = step_table(w, label)
    return (
        _budget(w)
        | _communication(w)
        | _overlap_tax(w)
        | _copies(w)
        | _host(w)
        | _kernel_mix(w)
        | _memory_peak(w)
        | _gpu_metrics(ex["metrics"], window)
        | step_stats(w, table)
        | _pauses(w, table)
    )


@dataclass
class Window:
    rows: dict[str, list[dict]]  # the rank's rows of each table
    lo: int
    hi: int
    wall: int
    steps: int
    gpu: dict | None
    source: str = "none"  # how the steps were found (the report's steps.source)
    path: Path | None = None  # the export (NCCL's payloads are read from it when needed)

    def __post_init__(self) -> None:
        lo, hi, rows = self.lo, self.hi, self.rows
        self.kern = clip(rows["kernels"], lo, hi)
        self.comm_kernels = [k for k in self.kern if k["family"] == "communication"]
        # CUDA-graph executions: GRAPH_TRACE rows; with node-level tracing, the span of the
        # node kernels of one launch (one correlationId, over the capture, then clipped).
        nodes: dict[int, tuple[int, int]] = {}
        for k in rows["kernels"]:
            if k["node"] is not None:
                s, e = nodes.get(k["corr"], (k["start"], k["end"]))
                nodes[k["corr"]] = (min(s, k["start"]), max(e, k["end"]))
        self.graph_rows = spans(clip(rows["graphs"], lo, hi))
        node_spans = clip([{"start": s, "end": e} for s, e in nodes.values()], lo, hi)
        self.node_replays = spans(node_spans)
        self.graphs = self.graph_rows + self.node_replays
        # compute: kernels running, and graph-level replays (which hide theirs: an upper
        # bound); a node-traced replay is its kernels, the gaps between them idle (issue 22)
        self.compute = [(k["start"], k["end"]) for k in self.kern if k["family"] != "communication"]
        self.compute += self.graph_rows
        self.comm = spans(self.comm_kernels)
        self.memcpy = clip(rows["memcpy"], lo, hi)
        self.copies = spans(self.memcpy) + spans(clip(rows["memset"], lo, hi))
        self.busy = length(self.compute, self.comm, self.copies)
        self.api = clip(rows["api"], lo, hi)
        self.launched_at = {a["corr"]: a["start"] for a in rows["api"]}
        self.step_calls = _step_calls(self)
        # docs/measures.md: what an optimizer NVTX range launched is the optimizer's, whatever
        # its name (communication stays communication), and so is what runs inside an
        # optimizer's run of kernels
        for k in _launched_in(self, _nvtx(self, taxonomy()["nvtx"]["optimizer"])):
            if k["family"] != "communication":
                k["family"] = "optimizer"
        optimizer_runs(self.kern)

    def per_step(self, n: float) -> float:
        return n / self.steps


# A GEMM, attention or communication kernel ends an optimizer's run (docs/measures.md)
RUN_BREAKS = ("gemm", "attention", "convolution", "communication")


def optimizer_runs(kernels: list[dict]) -> None:
    """docs/measures.md: every kernel between the first and the last optimizer-named kernel of
    a stretch no GEMM, attention or communication kernel breaks — in one node-traced graph
    replay (one correlationId), or on one stream — is the optimizer's (family set in place;
    ``by_position`` on those neither their name nor an optimizer NVTX range made its)."""
    groups: dict[tuple, list[dict]] = {}
    for k in sorted(kernels, key=lambda k: k["start"]):
        key = ("replay", k["corr"]) if k.get("node") is not None else ("stream", k.get("stream"))
        groups.setdefault(key, []).append(k)
    for seq in groups.values():
        run: list[dict] = []
        for k in [*seq, None]:
            if k is None or k["family"] in RUN_BREAKS:
                named = [i for i, r in enumerate(run) if r["family"] == "optimizer"]
                for r in run[named[0] : named[-1] + 1] if named else ():
                    r["by_position"] = r["family"] != "optimizer"
                    r["family"] = "optimizer"
                run = []
            else:
                run.append(k)


def step_table(w: Window, label: str = "") -> list[dict]:
    """Every step of the rank in start order: its GPU start and, for an NVTX step, its range
    on the host (``cpu``). NVTX steps: the outermost ranges matching the taxonomy's step
    pattern, each starting where the first GPU work launched by a call inside it (any
    thread) starts; graph steps: each CUDA-graph launch (its first row); pattern steps: each
    occurrence of the recurring kernel named ``label``."""
    work = [r for t in ("kernels", "graphs", "memcpy", "memset") for r in w.rows[t]]
    if w.source == "nvtx":
        step = taxonomy()["nvtx"]["step"]
        ranges, reach = [], -1
        for n in sorted(w.rows["nvtx"], key=lambda n: n["start"]):
            if step.search(n["text"]) and n["start"] >= reach:  # outermost step ranges
                ranges.append((n["start"], n["end"]))
            if step.search(n["text"]):
                reach = max(reach, n["end"])
        firsts = np.array([s for s, _ in ranges], np.int64)
        owner = {}
        for a in w.rows["api"]:
            i = int(np.searchsorted(firsts, a["start"], side="right")) - 1
            if i >= 0 and a["start"] <= ranges[i][1]:
                owner[a["corr"]] = i
        start: dict[int, int] = {}
        for r in work:
            i = owner.get(r["corr"])
            if i is not None:
                start[i] = min(start.get(i, r["start"]), r["start"])
        rows = [{"start": t, "cpu": ranges[i]} for i, t in start.items()]
    elif w.source == "graph":
        launch: dict[int, int] = {}
        graph_work = w.rows["graphs"] + [k for k in w.rows["kernels"] if k["node"] is not None]
        for r in graph_work:
            launch[r["corr"]] = min(launch.get(r["corr"], r["start"]), r["start"])
        rows = [{"start": t, "cpu": None} for t in launch.values()]
    elif w.source == "pattern":
        rows = [{"start": k["start"], "cpu": None} for k in w.rows["kernels"] if k["name"] == label]
    else:
        rows = []
    return sorted(rows, key=lambda r: r["start"])


def step_stats(w: Window, table: list[dict]) -> dict:
    """docs/measures.md: the statistics of the window's steady steps that are complete (the
    next step's start ends them: the last step of the capture has no step time) and within
    [median / 2, 2 x median] of them: mean, median and sample CV."""
    starts = [r["start"] for r in table]
    # (complete: each has a successor)
    steady = [b - a for a, b in itertools.pairwise(starts) if w.lo <= a < w.hi]
    if not steady:
        return {}
    median = statistics.median(steady)
    kept = [d for d in steady if median / 2 <= d <= 2 * median]
    return {
        "step_time_ms": statistics.fmean(kept) / MS,
        "step_time_median_ms": statistics.median(kept) / MS,
        "step_time_cv": statistics.stdev(kept) / statistics.fmean(kept) if len(kept) > 1 else None,
    }


def _pauses(w: Window, table: list[dict]) -> dict:
    """docs/measures.md, "Host pauses": in each steady NVTX step range, the stretches of 1 ms
    or more with no CUDA call on any thread of the process that no NVTX range of a known host
    activity covers half of; per step, the longest, and how much of the spread of the complete
    steps' times they account for: 1 - var(step - pauses) / var(step)."""
    out = dict.fromkeys(("host_pause_ms", "host_pause_max_ms", "step_spread_pause_frac"))
    if not table:
        return out
    steady = [
        (r, nxt["start"] - r["start"] if nxt else None)
        for r, nxt in zip(table, [*table[1:], None], strict=True)
        if w.lo <= r["start"] < w.hi and r["cpu"]
    ]
    if w.source != "nvtx" or not steady or not w.rows["api"]:
        return out
    calls = merged(spans(w.rows["api"]))
    tax = taxonomy()
    named = merged(
        [(n["start"], n["end"]) for n in w.rows["nvtx"] if first(tax["host_activities"], n["text"])]
    )
    per_step, longest = [], 0
    for r, _ in steady:
        lo, hi = r["cpu"]
        inside = calls[(calls[:, 1] > lo) & (calls[:, 0] < hi)]
        edges = np.concatenate([[lo], np.minimum(inside[:, 1], hi)])
        nexts = np.concatenate([np.maximum(inside[:, 0], lo), [hi]])
        gap = (nexts - edges >= MS) & (covered(named, edges, nexts) * 2 < nexts - edges)
        per_step.append(int((nexts - edges)[gap].sum()))
        longest = max([longest, *(nexts - edges)[gap]])
    out["host_pause_ms"] = statistics.fmean(per_step) / MS
    out["host_pause_max_ms"] = longest / MS
    complete = [(d, p) for (_, d), p in zip(steady, per_step, strict=True) if d is not None]
    if len(complete) >= 3:
        median = statistics.median(d for d, _ in complete)
        kept = [(d, p) for d, p in complete if median / 2 <= d <= 2 * median]
        var = statistics.pvariance([d for d, _ in kept])
        if var:
            rest = statistics.pvariance([d - p for d, p in kept])
            out["step_spread_pause_frac"] = max(0.0, 1 - rest / var)
    return out


def _step_calls(w: Window) -> list[dict]:
    """docs/measures.md, "Calls per step": the CUDA calls of the window's steps. The host runs
    ahead of the GPU, so they are not the calls made while the GPU runs the window: for NVTX
    steps, the calls (any thread) starting inside the step ranges whose GPU work starts in the
    window (the steady steps); for steps found on the GPU, the calls from the one that launched
    the first GPU work starting in the window to the one that launched the first work starting
    after it (to the last call when none does); without steps, the calls overlapping it, whole
    (a launch made before the first kernel is no shorter for it)."""
    if w.source == "none":
        return [a for a in w.rows["api"] if a["start"] < w.hi and a["end"] > w.lo]
    calls = sorted(w.rows["api"], key=lambda a: a["start"])
    work = [r for t in ("kernels", "graphs", "memcpy", "memset") for r in w.rows[t]]
    if w.source == "nvtx":
        step = taxonomy()["nvtx"]["step"]
        ranges, reach = [], -1
        for n in sorted(w.rows["nvtx"], key=lambda n: n["start"]):
            if step.search(n["text"]) and n["start"] >= reach:  # outermost step ranges
                ranges.append((n["start"], n["end"]))
            if step.search(n["text"]):
                reach = max(reach, n["end"])
        first_start: dict[int, int] = {}  # GPU start of each range's work
        owner = {
            a["corr"]: i for i, (s, e) in enumerate(ranges) for a in calls if s <= a["start"] <= e
        }
        for r in work:
            i = owner.get(r["corr"])
            if i is not None:
                first_start[i] = min(first_start.get(i, r["start"]), r["start"])
        steady = [ranges[i] for i, t in first_start.items() if w.lo <= t < w.hi]
        return [a for a in calls if any(s <= a["start"] <= e for s, e in steady)]
    launches = [(r["start"], w.launched_at[r["corr"]]) for r in work if r["corr"] in w.launched_at]
    inside = [call for start, call in launches if w.lo <= start < w.hi]
    after = [call for start, call in launches if start >= w.hi]
    if not inside:
        return []
    lo, hi = min(inside), min(after) if after else None
    return [a for a in calls if lo <= a["start"] and (hi is None or a["start"] < hi)]


def _budget(w: Window) -> dict:
    """gpu_busy_frac: union of kernels, graph executions, memcpy and memset; compute_frac:
    non-communication kernels and graph executions; comm_frac: communication kernels;
    exposed_comm_frac: communication with no compute; exposed_copy_frac: copies with neither.
    The device budget (docs/measures.md, "Critical path"): compute-absent = 1 - compute;
    occupied-not-computing = busy - compute; non-transfer busy = compute and copies other than
    host<->device or peer ones; time inside graph replays; and ``copy_alone_frac``, copies
    with no compute (not a report measure: what blocking_copy_frac cannot exceed)."""
    comp, com, kernels = length(w.compute), length(w.comm), length(w.compute, w.comm)
    exposed_comm = kernels - comp
    local = [(c["start"], c["end"]) for c in w.memcpy if not (c["h2d"] or c["d2h"] or c["peer"])]
    local += spans(clip(w.rows["memset"], w.lo, w.hi))
    return {
        "compute_absent_frac": 1 - comp / w.wall,
        "occupied_not_computing_frac": (w.busy - comp) / w.wall,
        "non_transfer_busy_frac": length(w.compute, local) / w.wall,
        "graph_unresolved_frac": length(w.graph_rows) / w.wall,
        "copy_alone_frac": (length(w.copies, w.compute) - comp) / w.wall,
        "gpu_busy_frac": w.busy / w.wall,
        "gpu_idle_frac": 1 - w.busy / w.wall,
        "compute_frac": comp / w.wall,
        "comm_frac": com / w.wall,
        "exposed_comm_frac": exposed_comm / w.wall,
        "comm_overlap_frac": 1 - exposed_comm / com if com else None,
        "compute_under_comm_frac": (comp + com - kernels) / comp if comp else None,
        "copy_frac": length(w.copies) / w.wall,
        "exposed_copy_frac": (w.busy - kernels) / w.wall,
    }


def _communication(w: Window) -> dict:
    """a2a_frac / a2a_exposed_frac: all-to-all kernels (alone / with no compute);
    dp_tp_exposed_frac: all-reduce, reduce-scatter, all-gather, broadcast and reduce kernels
    (one union) with no compute. The kind of a
    kernel comes from its name (taxonomy.comm_kinds); a SendRecv ("send_recv_or_all_to_all",
    "send_recv" or "other")
    takes the kind of the innermost collective NVTX range open on the launching thread at the
    launch, PyTorch's ``nccl:*`` ranges before NCCL's own (taxonomy.nvtx_collectives); with no
    such range, a launch inside ``ncclGroupEnd`` whose group's sends and receives reach every
    rank of their communicator is all-to-all, else send/recv (NCCL's payloads)."""
    tax = taxonomy()
    launch = {a["corr"]: a for a in w.rows["api"]}
    ranges = _collective_ranges(w)
    sources = list(dict.fromkeys(src for src, _, _ in tax["nvtx_collectives"]))
    kinds = []
    for k in w.comm_kernels:
        kind = first(tax["comm_kinds"], callee(k["name"]), "other")
        call = launch.get(k["corr"])
        if kind in ("send_recv_or_all_to_all", "send_recv", "other") and call:
            around = [r for r in ranges.get(call["tid"], ()) if r[0] <= call["start"] <= r[1]]
            around.sort(key=lambda r: (sources.index(r[2]), -r[0]))
            group = None if around else grouped_peers(w.path, k["pid"], call["tid"], call["start"])
            if around:
                kind = around[0][3]
            elif group is not None:  # a group of sends and receives that reaches every rank
                kind = "all_to_all" if group[1] >= group[2] else "send_recv"
        kinds.append(kind)
    a2a = [
        (k["start"], k["end"])
        for k, kind in zip(w.comm_kernels, kinds, strict=True)
        if kind == "all_to_all"
    ]
    dp_tp = [
        (k["start"], k["end"])
        for k, kind in zip(w.comm_kernels, kinds, strict=True)
        if kind in DP_TP_KINDS
    ]
    comp = length(w.compute)
    return {
        "a2a_frac": length(a2a) / w.wall,
        "a2a_exposed_frac": (length(a2a, w.compute) - comp) / w.wall,
        "dp_tp_exposed_frac": (length(dp_tp, w.compute) - comp) / w.wall,
        "comm_kinds": sorted(set(kinds)),
        "comm_libraries": sorted(
            {first(tax["comm_libraries"], callee(k["name"])) for k in w.comm_kernels} - {None}
        ),
    }


def _collective_ranges(w: Window) -> dict[int, list[tuple]]:
    """Per thread, the NVTX ranges that name a collective: (start, end, source, kind) of the
    first entry of taxonomy.nvtx_collectives that matches."""
    out: dict[int, list[tuple]] = {}
    for n in w.rows["nvtx"]:
        hit = next(
            ((src, kind) for src, kind, p in taxonomy()["nvtx_collectives"] if p.search(n["text"])),
            None,
        )
        if hit:
            out.setdefault(n["tid"], []).append((n["start"], n["end"], *hit))
    return out


def _overlap_tax(w: Window) -> dict:
    """overlap_tax_frac (docs/measures.md, "Overlap tax"): per compute kernel shape (name,
    grid, block), over whole launches in the window (not cut at its edges, not graph
    nodes), the median duration with no communication kernel of the rank in flight and the
    median with communication covering at least half of it; where each way has 3 launches or
    more, (median beside - median alone) x launches beside, summed, over the window (at least
    0; None when no shape qualifies)."""
    rows = [
        k
        for k in w.kern
        if k["family"] != "communication"
        and k["node"] is None
        and k["start"] not in (w.lo, w.hi)
        and k["end"] not in (w.lo, w.hi)
    ]
    if not rows or not w.comm:
        return {"overlap_tax_frac": None}
    starts = np.array([k["start"] for k in rows], np.int64)
    ends = np.array([k["end"] for k in rows], np.int64)
    cover = covered(w.comm, starts, ends)
    ways: dict[tuple, dict[str, list[int]]] = {}
    for k, c in zip(rows, cover, strict=True):
        dur = k["end"] - k["start"]
        way = "alone" if c == 0 else "beside" if c >= 0.5 * dur else None
        if way:
            ways.setdefault((k["name"], k["grid"], k["block"]), {"alone": [], "beside": []})[
                way
            ].append(dur)
    taxes = [
        (statistics.median(d["beside"]) - statistics.median(d["alone"])) * len(d["beside"])
        for d in ways.values()
        if len(d["alone"]) >= 3 and len(d["beside"]) >= 3
    ]
    return {"overlap_tax_frac": max(sum(taxes), 0) / w.wall if taxes else None}


def _copies(w: Window) -> dict:
    """Host<->device memcpys (HtoD/DtoH, unified memory included): time as unions, bytes and
    counts per step, pageable ones (either side pageable), GB/s of those >= 1 MiB (bytes over
    the sum of their durations), and the part with no kernel running."""
    h2d = [c for c in w.memcpy if c["h2d"]]
    d2h = [c for c in w.memcpy if c["d2h"]]
    pageable = [c for c in w.memcpy if c["pageable"]]
    uvm = [c for c in h2d + d2h if c["uvm"]]
    kernels = w.compute + w.comm

    def gbps(copies: list[dict]) -> float | None:
        big = [c for c in copies if c["bytes"] >= BIG_COPY_BYTES]
        ns = sum(c["end"] - c["start"] for c in big)
        return sum(c["bytes"] for c in big) / ns if ns else None  # bytes per ns = GB/s

    h2d_bytes, d2h_bytes = sum(c["bytes"] for c in h2d), sum(c["bytes"] for c in d2h)
    local = [c for c in w.memcpy if c["local"]]
    return {
        "d2d_frac": length(spans(local)) / w.wall,
        "d2d_bytes_per_step": w.per_step(sum(c["bytes"] for c in local)),
        "exposed_d2d_frac": (length(spans(local), kernels) - length(kernels)) / w.wall,
        "d2d_in_collective_frac": _in_collectives(w, local),
        "offload_copy_frac": length(spans(h2d + d2h)) / w.wall,
        "h2d_frac": length(spans(h2d)) / w.wall,
        "d2h_frac": length(spans(d2h)) / w.wall,
        "exposed_offload_frac": (length(spans(h2d + d2h), kernels) - length(kernels)) / w.wall,
        "h2d_bytes_per_step": w.per_step(h2d_bytes),
        "d2h_bytes_per_step": w.per_step(d2h_bytes),
        "h2d_d2h_bytes_per_step": w.per_step(h2d_bytes + d2h_bytes),
        "device_copy_bytes_per_step": w.per_step(
            sum(c["bytes"] for c in w.memcpy if c["on_device"])
        ),
        "memset_bytes_per_step": w.per_step(
            sum(m["bytes"] or 0 for m in clip(w.rows["memset"], w.lo, w.hi))
        ),
        "pageable_copies_per_step": w.per_step(len(pageable)),
        "pageable_bytes_per_step": w.per_step(sum(c["bytes"] for c in pageable)),
        "pageable_copy_frac": length(spans(pageable)) / w.wall,
        "uvm_bytes_per_step": w.per_step(sum(c["bytes"] for c in uvm)),
        "uvm_copy_frac": length(spans(uvm)) / w.wall,
        "small_d2h_per_step": w.per_step(sum(c["bytes"] <= SMALL_D2H_BYTES for c in d2h)),
        "h2d_gbps": gbps(h2d),
        "d2h_gbps": gbps(d2h),
        # both directions at once: |A| + |B| - |A or B|, over the shorter direction's time
        "host_copy_duplex_frac": (
            (length(spans(h2d)) + length(spans(d2h)) - length(spans(h2d + d2h)))
            / min(length(spans(h2d)), length(spans(d2h)))
            if h2d and d2h and min(length(spans(h2d)), length(spans(d2h)))
            else None
        ),
    }


def _in_collectives(w: Window, copies: list[dict]) -> float | None:
    """Share of the copies' time (a union) whose CUDA call started inside a collective NVTX
    range (taxonomy.nvtx_collectives, any source) on the same thread, ends included; null
    without copies, NVTX ranges or the calls that made them."""
    if not copies or not w.rows["nvtx"]:
        return None
    calls = {a["corr"]: a for a in w.rows["api"]}
    if not any(c["corr"] in calls for c in copies):  # no call traced: unknown
        return None
    ranges = _collective_ranges(w)

    def inside(c: dict) -> bool:
        call = calls.get(c["corr"])
        around = ranges.get(call["tid"], ()) if call else ()
        return any(r[0] <= call["start"] <= r[1] for r in around)  # type: ignore[index]

    return length(spans([c for c in copies if inside(c)])) / length(spans(copies))


def _host(w: Window) -> dict:
    """Per-step counts of the CUDA calls of the window's steps (taxonomy.cuda_api,
    :func:`_step_calls`) and the median duration of their launch calls; GPU idle time inside
    the allocator calls and the idle gaps by cause, from the calls made while the GPU runs the
    window."""
    calls = {
        kind: [a for a in w.step_calls if api_is(kind, a["name"])]
        for kind in ("sync", "launch", "alloc")
    }
    in_window = {kind: [a for a in w.api if api_is(kind, a["name"])] for kind in ("sync", "alloc")}
    launch_ns = [a["end"] - a["start"] for a in calls["launch"]]
    median_launch = statistics.median(launch_ns) if launch_ns else None
    kernel_ns = [k["end"] - k["start"] for k in w.kern]
    work = w.compute + w.comm + w.copies
    return {
        "sync_calls_per_step": w.per_step(len(calls["sync"])),
        "launch_calls_per_step": w.per_step(len(calls["launch"])),
        "alloc_calls_per_step": w.per_step(len(calls["alloc"])),
        "free_calls_per_step": w.per_step(sum(api_is("free", a["name"]) for a in calls["alloc"])),
        "median_launch_us": median_launch / 1e3 if launch_ns else None,
        "short_kernel_frac": sum(d < median_launch for d in kernel_ns) / len(kernel_ns)
        if kernel_ns and launch_ns
        else None,
        "alloc_idle_frac": (length(spans(in_window["alloc"]), work) - length(work)) / w.wall,
        # the host's time inside the steps' calls that only wait, any thread (a union:
        # threads overlap), whole (host time)
        "wait_call_frac": length(spans([a for a in w.step_calls if api_is("wait", a["name"])]))
        / w.wall,
        "host_call_ms_per_step": _host_call_ms(w),
        "nvtx_ranges_per_launch": _nvtx_per_launch(w),
    } | _idle_causes(w, in_window["sync"])


def _nvtx_per_launch(w: Window) -> float | None:
    """NVTX ranges the rank opened per launch call, both counted by their start inside the
    window (host clock), steps and forward/backward/optimizer phases left out; null without
    NVTX ranges or launches."""
    launches = sum(w.lo <= a["start"] < w.hi and api_is("launch", a["name"]) for a in w.rows["api"])
    if not w.rows["nvtx"] or not launches:
        return None
    tax = taxonomy()["nvtx"]
    phases = [tax[k] for k in ("step", "forward", "backward", "optimizer")]
    opened = [
        n
        for n in w.rows["nvtx"]
        if w.lo <= n["start"] < w.hi and not any(p.search(n["text"] or "") for p in phases)
    ]
    return len(opened) / launches


def _host_call_ms(w: Window) -> float | None:
    """ms per step the busiest thread spends in the steps' CUDA calls other than waits (each
    thread's calls as a union); null without CUDA calls."""
    threads: dict[int, list[dict]] = {}
    for a in w.step_calls:
        if not api_is("wait", a["name"]):
            threads.setdefault(a["tid"], []).append(a)
    busiest = max((length(spans(calls)) for calls in threads.values()), default=0)
    return w.per_step(busiest) / 1e6 if w.api or w.step_calls else None


def _idle_causes(w: Window, syncs: list[dict]) -> dict:
    """docs/measures.md, "How time is attributed": each idle gap (the window minus busy) gets
    one cause: other when profiler overhead covers half of it; input / host when it lasts
    >= 1 ms and CUDA calls cover less than half of it (input with evidence of data loading:
    an NVTX data range over half of it, or it ends where a host->device copy of >= 1 MiB
    starts, where such gaps recur in at least half of the steps and no NVTX range of another
    host activity covers half of it); graph inside a node-traced replay; sync when a
    synchronising call returned inside it or at most 20 µs before it, or synchronising and
    allocator calls (which synchronise the device) cover at least half of it (the host sat
    blocked in them); launch when the host started
    CUDA calls in it or was still in one begun before it; other otherwise. With them, the share in sync gaps inside which a call
    that only waits (taxonomy cuda_api wait) returned."""
    busy = merged(w.compute, w.comm, w.copies)
    s = np.concatenate([[w.lo], busy[:, 1]])
    e = np.concatenate([busy[:, 0], [w.hi]])
    s, e = s[e > s], e[e > s]
    dur = e - s
    call_starts = np.sort([a["start"] for a in w.api]).astype(np.int64)
    n_calls = np.searchsorted(call_starts, e) - np.searchsorted(call_starts, s)
    in_call = (n_calls > 0) | (covered(spans(w.api), s, e) > 0)  # (begun before it, too)
    after_sync = _returned_in([a["end"] for a in syncs], s - SYNC_SLACK_NS, e)
    blocked = [a for a in w.api if api_is("alloc", a["name"]) or api_is("sync", a["name"])]
    after_sync |= covered(spans(blocked), s, e) * 2 >= dur
    profiler = covered(spans(w.rows["overhead"]), s, e) * 2 >= dur
    long = (dur >= LONG_GAP_NS) & (covered(spans(w.api), s, e) * 2 < dur)
    tax = taxonomy()
    phases = [tax["nvtx"][k] for k in ("step", "forward", "backward", "optimizer")]
    named = [  # ranges of a known host activity, in start order
        (n["start"], n["end"], activity)
        for n in sorted(w.rows["nvtx"], key=lambda n: n["start"])
        if (activity := first(tax["host_activities"], n["text"]))
        and not any(p.search(n["text"]) for p in phases)
    ]
    batches = [c["start"] for c in w.rows["memcpy"] if c["h2d"] and c["bytes"] >= BIG_COPY_BYTES]
    batch = long & np.isin(e, batches)
    recurs = w.source != "none" and batch.sum() >= 0.5 * w.steps
    loading = np.zeros(len(s), bool)
    ranged, copied = np.zeros(len(s), bool), np.zeros(len(s), bool)  # which sign made it
    for j in np.flatnonzero(long):
        # the innermost range of a known activity over half of the gap says what the host did
        over = [act for a, b, act in named if min(b, e[j]) - max(a, s[j]) >= dur[j] / 2]
        ranged[j] = bool(over) and over[-1] == "data"
        copied[j] = not over and bool(batch[j] and recurs)
        loading[j] = ranged[j] or copied[j]
    in_graph = covered(w.node_replays, s, e) > 0
    cause = np.select(
        [profiler, in_graph, long & loading, long, after_sync, in_call],
        ["other", "graph", "input", "host", "sync", "launch"],
        "other",
    )
    # of the sync gaps, those in which a call that only waits returned (inside, no slack)
    waited = _returned_in([a["end"] for a in w.api if api_is("wait", a["name"])], s, e)
    return {f"idle_{c}_frac": int(dur[cause == c].sum()) / w.wall for c in IDLE_CAUSES} | {
        "idle_after_wait_frac": int(dur[(cause == "sync") & waited].sum()) / w.wall,
        "idle_input_copy_frac": int(dur[(cause == "input") & copied].sum()) / w.wall,
        # (unknown, not zero, where the export holds no NVTX range)
        "idle_input_nvtx_frac": (
            int(dur[(cause == "input") & ranged].sum()) / w.wall if w.rows["nvtx"] else None
        ),
    }


def _returned_in(ends: list[int], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per span [lo, hi]: whether one of the calls ending at ``ends`` returned inside it."""
    ends_sorted = np.sort(np.asarray(ends, dtype=np.int64))
    i = np.searchsorted(ends_sorted, lo)  # the first call returning since lo
    out = i < len(ends_sorted)
    out[out] = ends_sorted[i[out]] <= hi[out]
    return out


def _kernel_mix(w: Window) -> dict:
    """Kernel rows per step; family shares of kernel time, median kernel duration and grids
    below the SM count — from the window's kernels, or when graph-level tracing hides most of
    the busy time, from the eager warm-up before capture (kernel_stats_outside_window)."""
    hidden = w.busy > 0 and length(w.graph_rows) > w.busy / 2
    shape, per_step = _warmup(w) if hidden else (w.kern, float(w.steps))
    sm_count = (w.gpu or {}).get("sm_count")
    dur = [k["end"] - k["start"] for k in shape]
    total = sum(dur)
    out = {
        "kernels_per_step": w.per_step(len(w.kern)),
        # busy time inside replays: |replays| + |busy| - |replays ∪ busy|
        "graph_frac": (length(w.graphs) + w.busy - length(w.graphs, w.compute, w.comm, w.copies))
        / w.busy
        if w.busy
        else 0.0,
        "uses_cuda_graphs": bool(w.graphs),
        "kernel_stats_outside_window": hidden,
        "graph_internal_gap_frac": _graph_internal_gaps(w),
        "median_kernel_us": statistics.median(dur) / 1e3 if dur else None,
        "small_grid_kernel_frac": sum(k["grid"] < sm_count for k in shape) / len(shape)
        if sm_count and shape
        else None,
        "optimizer_kernels_per_step": _optimizer_kernels(w, shape, per_step),
        "recompute_frac": _recompute(w),
        "recompute_ms_per_step": _recompute_ms(w),
    }
    for fam in [f for f, _ in taxonomy()["families"]] + ["other"]:
        fam_ns = sum(d for k, d in zip(shape, dur, strict=True) if k["family"] == fam)
        out[f"{fam}_time_frac"] = fam_ns / total if total else 0.0
    placed = sum(d for k, d in zip(shape, dur, strict=True) if k.get("by_position"))
    out["optimizer_by_position_frac"] = placed / total if total else 0.0
    gemm = [k for k in shape if k["family"] == "gemm"]
    gemm_ns = sum(k["end"] - k["start"] for k in gemm)
    small = [k for k in gemm if sm_count and k["grid"] < sm_count]
    shapes = [(k["name"], k["grid"]) for k in small]
    fp8_ns = sum(k["end"] - k["start"] for k in gemm if taxonomy()["fp8_gemm"].search(k["name"]))
    return out | {
        "gemm_kernels_per_step": len(gemm) / per_step if per_step else None,
        "small_gemm_repeats_per_step": max(map(shapes.count, set(shapes)), default=0) / per_step
        if sm_count and per_step
        else None,
        "fp8_gemm_frac": fp8_ns / gemm_ns if gemm_ns else None,
        "small_grid_gemm_frac": sum(k["end"] - k["start"] for k in small) / gemm_ns
        if gemm_ns and sm_count
        else None,
        # the SMs the small GEMMs fill, weighted by their time
        "small_grid_gemm_fill": sum(k["grid"] / sm_count * (k["end"] - k["start"]) for k in small)
        / sum(k["end"] - k["start"] for k in small)
        if small and sum(k["end"] - k["start"] for k in small)
        else None,
        # the optimizer's longest one-pass op: its multi-tensor kernels of one name, summed
        "optimizer_pass_frac": max(
            (
                sum(d for k, d in zip(shape, dur, strict=True) if k["name"] == name)
                for name in {
                    k["name"]
                    for k in shape
                    if k["family"] == "optimizer" and "multi_tensor_apply" in k["name"].lower()
                }
            ),
            default=0,
        )
        / total
        if total
        else 0.0,
    }


def _warmup(w: Window) -> tuple[list[dict], float | None]:
    """The eager kernels of the warm-up iterations right before the first graph capture (the
    last burst of kernels launched before cudaStreamBeginCapture, split at GPU pauses longer
    than 4 replays, at least 20 ms), and how many steps they hold. One step is as many kernels
    as launches were recorded between cudaStreamBeginCapture and cudaStreamEndCapture (the
    captured graph, replayed once per step): a longer burst is cut to its last step, a shorter
    one holds that fraction of a step. Null without a capture in the trace."""
    api = w.rows["api"]
    begin = min(
        (a["start"] for a in api if re.match(r"cu(da)?StreamBeginCapture", a["name"])), default=None
    )
    if begin is None:
        return [], None
    eager = sorted(
        (dict(k) for k in w.rows["kernels"] if w.launched_at.get(k["corr"], begin) < begin),
        key=lambda k: k["start"],
    )
    end = min(a["start"] for a in api if a["start"] > begin and "StreamEndCapture" in a["name"])
    captured = [
        a
        for a in api
        if begin < a["start"] < end
        and api_is("launch", a["name"])
        and not api_is("graph_launch", a["name"])
    ]
    if not eager or not captured:
        return eager, None
    replay = statistics.median(e - s for s, e in w.graphs)
    pause = max(WARMUP_PAUSE_REPLAYS * replay, WARMUP_PAUSE_MIN_NS)
    burst, reach = 0, eager[0]["end"]
    for i, k in enumerate(eager[1:], 1):
        burst = i if k["start"] - reach > pause else burst
        reach = max(reach, k["end"])
    burst_kernels = eager[burst:]
    if len(burst_kernels) > len(captured):
        burst_kernels, iterations = burst_kernels[-len(captured) :], 1.0
    else:
        iterations = len(burst_kernels) / len(captured)
    optimizer_runs(burst_kernels)  # (the eager iteration's optimizer, as the replays')
    return burst_kernels, iterations


def _graph_internal_gaps(w: Window) -> float | None:
    """Node-level tracing: the share of the replays' spans (window kernels of one launch) in
    which no node kernel runs."""
    launches: dict[int, list] = {}
    for k in w.kern:
        if k["node"] is not None:
            launches.setdefault(k["corr"], []).append((k["start"], k["end"]))
    span = sum(max(e for _, e in iv) - min(s for s, _ in iv) for iv in launches.values())
    busy = sum(length(iv) for iv in launches.values())
    return (span - busy) / span if span else None


def _launched_in(w: Window, ranges: list[tuple[int, int]]) -> list[dict]:
    """Window kernels whose launching call (any thread of the process) started in a range."""
    return [
        k
        for k in w.kern
        if k["corr"] in w.launched_at and any(s <= w.launched_at[k["corr"]] <= e for s, e in ranges)
    ]


def _nvtx(w: Window, pattern: re.Pattern) -> list[tuple[int, int]]:
    return [(n["start"], n["end"]) for n in w.rows["nvtx"] if pattern.search(n["text"])]


def _optimizer_kernels(w: Window, shape: list[dict], per_step: float | None) -> float | None:
    """Optimizer kernels per step (by name, NVTX range or run) of the kernels the mix comes
    from; null when neither an optimizer NVTX range nor an optimizer kernel shows."""
    n = sum(k["family"] == "optimizer" for k in shape)
    if not n and not _nvtx(w, taxonomy()["nvtx"]["optimizer"]):
        return None
    return n / per_step if per_step else None


def _forward_backward(w: Window) -> tuple[list[dict], list[dict]] | None:
    """The GEMM/attention kernels launched inside the forward and inside the backward NVTX
    ranges (null without both, or without such a kernel in the forward)."""
    nvtx = taxonomy()["nvtx"]
    fwd = _nvtx(w, nvtx["forward"])
    bwd = [r for r in _nvtx(w, nvtx["backward"]) if r not in fwd]
    if not fwd or not bwd:
        return None

    def heavy(ranges) -> list[dict]:
        return [k for k in _launched_in(w, ranges) if k["family"] in ("gemm", "attention")]

    forward = heavy(fwd)
    return (forward, heavy(bwd)) if forward else None


def _shape(k: dict) -> tuple:
    return (k["name"], k["grid"], k["block"])


def _recompute(w: Window) -> float | None:
    """Forward GEMM/attention launches seen again in backward, by (name, grid, block): the sum
    over shapes of min(forward, backward) over the forward launches (null without both
    forward and backward NVTX ranges)."""
    found = _forward_backward(w)
    if found is None:
        return None
    forward, backward = ([_shape(k) for k in ks] for ks in found)
    return sum(min(forward.count(s), backward.count(s)) for s in set(forward)) / len(forward)


def _recompute_ms(w: Window) -> float | None:
    """ms per step of the launches _recompute counts: per shape, min(forward, backward)
    launches at the shape's mean forward duration."""
    found = _forward_backward(w)
    if found is None:
        return None
    forward, backward = found
    back = [_shape(k) for k in backward]
    total = 0.0
    for shape in {_shape(k) for k in forward}:
        times = [k["end"] - k["start"] for k in forward if _shape(k) == shape]
        total += min(len(times), back.count(shape)) * statistics.fmean(times)
    return total / MS / w.steps


def _memory_peak(w: Window) -> dict:
    """Peak allocated bytes over the capture (allocations minus frees in time order, per
    device) of the device's own memory, and that over the GPU's totalMemory; the memory events
    also record host buffers (ENUM_CUDA_MEM_KIND 0 pageable, 1 pinned), whose peak is apart."""
    device = _level_peak([r for r in w.rows["memory"] if not r["host"]])
    capacity = (w.gpu or {}).get("memory_bytes")
    return {
        "peak_memory_bytes": device,
        "peak_memory_frac": device / capacity if device is not None and capacity else None,
        "pinned_host_peak_bytes": (_level_peak([r for r in w.rows["memory"] if r["pinned"]]) or 0)
        if w.rows["memory"]
        else None,
    }


def _level_peak(rows: list[dict]) -> int | None:
    level: dict[int, int] = {}
    peak = None
    for r in rows:
        level[r["device"]] = level.get(r["device"], 0) + (
            r["bytes"] if r["op"] == 0 else -r["bytes"]
        )
        peak = max(peak or 0, level[r["device"]])
    return peak


def _gpu_metrics(rows: list[dict], window: tuple[int, int]) -> dict:
    """Mean of each GPU metric's valid (>= 0) samples with lo <= timestamp <= hi, as 0-1; only
    with one sampled GPU (several would need pairing with the rank's GPU)."""
    if len({r["source"] for r in rows}) > 1:
        return {}
    lo, hi = window
    out = {}
    for key, names in METRIC_NAMES.items():
        values = [
            r["value"]
            for r in rows
            if r["metric"] in names and lo <= r["timestamp"] <= hi and r["value"] >= 0
        ]
        out[key] = statistics.fmean(values) / 100 if values else None
    return out
