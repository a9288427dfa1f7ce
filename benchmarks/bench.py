"""Benchmark traceclf (and nsys-ai, when installed) on large synthetic-but-real exports.

    .venv/bin/python benchmarks/bench.py [--inputs kernel-dense:1GB,gpu-metrics:1GB] [--ranks 8x128MB]

Builds long exports by replicating a real trace's event rows in time (benchmarks/out/), then
times, each in a fresh process: ``traceclf analyze`` cold and warm, in its default (window)
mode and with ``--all-steps``; the read-only floor (connectorx reading the needed columns of
the whole capture); ``nsys-ai diagnose``; the loader alone (``--loader``); and many per-rank
files with ``--jobs 1`` and ``--jobs 2``. Prints the tables and the targets, and writes
benchmarks/RESULTS.md. See benchmarks/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"
DEFAULT_SOURCES = (
    ROOT / "fixtures" / "h100_host_launch_gpumetrics.sqlite",
    Path("/work/shared/traces/h100_host_launch_gpumetrics.sqlite"),
    ROOT / "fixtures" / "h100_host_launch_gpumetrics_trimmed.sqlite",
)
UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
PER_RUN_TIMEOUT_S = 900
DEFAULT_INPUTS = (
    "kernel-dense:1GB,out-of-order:1GB,few-long-steps:1GB,nvtx-dense:1GB,ep-comm:1GB,"
    "cuda-graph:1GB,gpu-metrics:1GB,kernel-dense:4GB"
)
# Inputs past this size are timed in the default mode only (and without the read-only floor).
ALL_STEPS_MAX_BYTES = 1.5e9
DEFAULT_RANKS = "8x128MB"
# nsys-ai takes minutes per GB and writes into its input: by default only inputs up to this.
NSYS_AI_MAX_BYTES = 600 << 20

# Event tables copied forward in time, with the rows that are events (not registrations).
REPLICATED = {
    "CUPTI_ACTIVITY_KIND_KERNEL": "1",
    "CUPTI_ACTIVITY_KIND_GRAPH_TRACE": "1",
    "CUPTI_ACTIVITY_KIND_MEMCPY": "1",
    "CUPTI_ACTIVITY_KIND_MEMSET": "1",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "1",
    "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION": "1",
    "CUDA_GPU_MEMORY_USAGE_EVENTS": "1",
    "NVTX_EVENTS": '"end" IS NOT NULL',  # ranges; domain/category registrations stay single
    "GPU_METRICS": "1",
    "PROFILER_OVERHEAD": "1",
    "OSRT_API": "1",  # not read by traceclf, but part of what makes a real export big
}
# What each kind of input replicates. "gpu-metrics": everything, so GPU_METRICS (sampled at
# 1 kHz) is most of the file. "kernel-dense": everything but GPU metrics, so kernel and CUDA
# API rows are most of it, as in a large MoE run (the source's own metrics stay, once). The
# other kinds replicate another shared trace the same way: "ep-comm" two expert-parallel ranks
# in one file (NCCL all-to-all), "cuda-graph" a step captured in one CUDA graph (graph-level
# tracing); "out-of-order" is kernel-dense's twin with every pair of copies written in reverse
# order, so no event table is in start order (as when nsys flushes buffers out of order).
# "few-long-steps" is kernel-dense's twin with its NVTX step ranges joined LONG_STEPS at a
# time (the same rows; at 1 GB each step holds 0.6 M kernels and 1.4 M CUDA calls, more than
# the row budget). "nvtx-dense" is kernel-dense's twin with one NVTX range around each kernel
# launch, as PyTorch's emit_nvtx (nsys --pytorch=autograd-nvtx) writes: each op's name with
# its sequence number, kept in the row, so nearly every range's text differs (OP_NAMES).
NO_METRICS = tuple(t for t in REPLICATED if t != "GPU_METRICS")
KINDS = {
    "gpu-metrics": tuple(REPLICATED),
    "kernel-dense": NO_METRICS,
    "ep-comm": NO_METRICS,
    "cuda-graph": NO_METRICS,
    "out-of-order": NO_METRICS,
    "few-long-steps": NO_METRICS,
    "nvtx-dense": NO_METRICS,
}
# The shared trace each kind grows (host-launch for kernel-dense and its kin: --source).
KIND_SOURCES = {
    "ep-comm": "h100_comm_ep2.sqlite",
    "cuda-graph": "h100_host_cudagraph.sqlite",
}
# Kinds whose copies are written in pairs in reverse order (copy 2, copy 1, copy 4, copy 3...).
SWAPPED = {"out-of-order"}
# Kinds made from their kernel-dense twin (same copies) rather than grown from a source.
TWINS = SWAPPED | {"few-long-steps", "nvtx-dense"}
# Steps per thread that a few-long-steps input keeps (its twin's joined evenly into these).
LONG_STEPS = 8
# The ops an nvtx-dense input's ranges name, one per launch in turn (by correlation id).
OP_NAMES = (
    "aten::mm",
    "aten::add_",
    "aten::mul",
    "aten::copy_",
    "aten::_softmax",
    "aten::native_layer_norm",
    "aten::gelu",
    "aten::bmm",
    "aten::addmm",
    "aten::sum",
)
TIME_COLUMNS = ("start", "end", "timestamp", "rawTimestamp")
# The tables traceclf's loader reads: their rows are the "events" of events/second.
LOADED = tuple(t for t in REPLICATED if t != "OSRT_API")


# ---------------------------------------------------------------------------------- inputs


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]B)\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"size like 100MB or 1GB, not {text!r}")
    return int(float(match[1]) * UNITS[match[2]])


def columns(con: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in con.execute(f"PRAGMA table_info('{table}')")]


def event_span(con: sqlite3.Connection, tables: Sequence[str]) -> int:
    """Time from the first to the last event of any replicated table, in ns (+1 so copies
    never touch)."""
    lo, hi = None, None
    for table in tables:
        cols = [c for c in ("start", "end", "timestamp") if c in columns(con, table)]
        for col in cols:
            a, b = con.execute(f'SELECT min("{col}"), max("{col}") FROM {table}').fetchone()
            if a is not None:
                lo, hi = min(a, lo if lo is not None else a), max(b, hi if hi is not None else b)
    if lo is None:
        raise SystemExit("source trace has no events to replicate")
    return hi - lo + 1


def max_correlation(con: sqlite3.Connection, tables: Sequence[str]) -> int:
    ids = [
        con.execute(f"SELECT max(correlationId) FROM {t}").fetchone()[0] or 0
        for t in tables
        if "correlationId" in columns(con, t)
    ]
    return max(ids, default=0)


def copy_statement(con: sqlite3.Connection, table: str, where: str, n0: int) -> str:
    """INSERT ... SELECT that appends one shifted copy of the first ``n0`` rows of ``table``
    (the original ones); parameters :dt (time shift) and :dc (correlationId shift)."""
    cols = columns(con, table)

    def shifted(col: str) -> str:
        if col in TIME_COLUMNS:
            return f'"{col}" + :dt'
        if col == "correlationId":
            return f'"{col}" + :dc'
        return f'"{col}"'

    names = ", ".join(f'"{c}"' for c in cols)
    values = ", ".join(shifted(c) for c in cols)
    return f"INSERT INTO {table} ({names}) SELECT {values} FROM {table} WHERE rowid <= {n0} AND ({where})"


def count_events(con: sqlite3.Connection) -> int:
    present = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    return sum(
        con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in LOADED if t in present
    )


def source_of(kind: str, host_launch: Path) -> Path:
    """The shared trace a kind of input grows: ``host_launch`` (``--source``), or the kind's
    own from fixtures/ or /work/shared/traces."""
    name = KIND_SOURCES.get(kind)
    if name is None:
        return host_launch
    for folder in (ROOT / "fixtures", Path("/work/shared/traces")):
        if (folder / name).exists():
            return folder / name
    raise SystemExit(f"no source trace {name} for {kind} inputs")


def build_input(
    source: Path,
    target: int,
    label: str,
    rebuild: bool,
    kind: str = "gpu-metrics",
    copies_wanted: int | None = None,
) -> tuple[Path, dict]:
    """A copy of ``source`` grown to at least ``target`` bytes by replicated event rows
    (exactly ``copies_wanted`` copies when given: an out-of-order twin).

    Copy k shifts every time column by k x the event span and every correlationId by
    k x (max correlationId + 1), so API calls still pair with their GPU work and copies follow
    one another on the timeline like later steps of the same run. ``kind`` says which tables
    are replicated (:data:`KINDS`). Rows stay in ``start`` order, as nsys writes them, except
    for the kinds of :data:`SWAPPED`, whose copies are written two at a time, the later first.
    """
    prefix = "" if kind == "gpu-metrics" else f"{kind}-"
    dest = OUT / f"{prefix}{source.stem}-{label}.sqlite"
    sidecar = dest.with_suffix(".json")
    if dest.exists() and sidecar.exists() and not rebuild:
        return dest, json.loads(sidecar.read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".sqlite.tmp")
    shutil.copyfile(source, tmp)
    con = sqlite3.connect(tmp, isolation_level=None)
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    present = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    tables = [t for t in KINDS[kind] if t in present]
    span, corr = event_span(con, tables), max_correlation(con, tables) + 1
    statements = [
        copy_statement(
            con, t, REPLICATED[t], con.execute(f"SELECT max(rowid) FROM {t}").fetchone()[0] or 0
        )
        for t in tables
    ]
    started, copies = time.perf_counter(), 1
    swapped = kind in SWAPPED

    def more() -> bool:
        if copies_wanted is not None:
            return copies < copies_wanted
        return tmp.stat().st_size < target

    while more():
        con.execute("BEGIN")
        batch = [copies]
        if swapped and (copies_wanted is None or copies + 1 < copies_wanted):
            batch = [copies + 1, copies]  # the later copy first: out of start order
        for k in batch:
            for statement in statements:
                con.execute(statement, {"dt": k * span, "dc": k * corr})
        con.execute("COMMIT")
        copies += len(batch)
        print(
            f"  {dest.name}: {copies} copies, {tmp.stat().st_size / 1e6:.0f} MB",
            end="\r",
            file=sys.stderr,
        )
    if "ANALYSIS_DETAILS" in present:  # the capture now lasts as long as its copies
        con.execute(
            "UPDATE ANALYSIS_DETAILS SET duration = duration + :d, stopTime = stopTime + :d",
            {"d": (copies - 1) * span},
        )
    meta = {
        "kind": kind,
        "copies": copies,
        "pids": con.execute(
            "SELECT count(DISTINCT globalPid) FROM CUPTI_ACTIVITY_KIND_KERNEL"
        ).fetchone()[0],
        "events": count_events(con),
        "kernels": con.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0],
        "api": con.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME").fetchone()[0],
        "bytes": tmp.stat().st_size,
        "source": str(source),
        "build_s": round(time.perf_counter() - started, 1),
    }
    con.close()
    os.replace(tmp, dest)
    sidecar.write_text(json.dumps(meta, indent=1))
    print(file=sys.stderr)
    return dest, meta


def edited_twin(
    twin: Path,
    twin_meta: dict,
    kind: str,
    rebuild: bool,
    edit: Callable[[sqlite3.Connection], dict],
) -> tuple[Path, dict]:
    """A copy of the kernel-dense input ``twin`` for input ``kind``, changed by ``edit`` (on
    an autocommit connection to the copy; it returns what the sidecar adds), reused until
    ``rebuild``."""
    dest = OUT / f"{kind}-{twin.name.removeprefix('kernel-dense-')}"
    sidecar = dest.with_suffix(".json")
    made = json.loads(sidecar.read_text()) if dest.exists() and sidecar.exists() else {}
    if made.get("edit") == EDIT_VERSIONS.get(kind) and not rebuild:
        return dest, made
    tmp = dest.with_suffix(".sqlite.tmp")
    shutil.copyfile(twin, tmp)
    con = sqlite3.connect(tmp, isolation_level=None)
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    added = edit(con)
    con.close()
    os.replace(tmp, dest)
    meta = {
        **twin_meta,
        "kind": kind,
        "bytes": dest.stat().st_size,
        "edit": EDIT_VERSIONS.get(kind),
        **added,
    }
    sidecar.write_text(json.dumps(meta, indent=1))
    return dest, meta


def join_steps(con: sqlite3.Connection) -> dict:
    """few-long-steps: the NVTX step ranges (those the bundled step pattern matches) joined,
    on each thread, into :data:`LONG_STEPS` ranges of consecutive steps: every row kept, few
    long steps (each over the row budget)."""
    from traceclf.model.taxonomy import bundled

    step = re.compile(bundled().nvtx["step"])
    con.create_function("is_step", 1, lambda t: t is not None and bool(step.search(t)))
    rows = con.execute(
        'SELECT n.rowid, n.globalTid, n."end" FROM NVTX_EVENTS n '
        "LEFT JOIN StringIds s ON s.id = n.textId "
        'WHERE n."end" IS NOT NULL AND is_step(coalesce(n.text, s.value)) '
        "ORDER BY n.globalTid, n.start"
    ).fetchall()
    con.execute("BEGIN")
    by_thread: dict[int, list[tuple[int, int]]] = {}
    for rowid, tid, end in rows:
        by_thread.setdefault(tid, []).append((rowid, end))
    for ranges in by_thread.values():
        size = -(-len(ranges) // LONG_STEPS)
        for i in range(0, len(ranges), size):
            group = ranges[i : i + size]
            con.execute(
                'UPDATE NVTX_EVENTS SET "end" = ? WHERE rowid = ?', (group[-1][1], group[0][0])
            )
            con.executemany("DELETE FROM NVTX_EVENTS WHERE rowid = ?", [(r,) for r, _ in group[1:]])
    con.execute("COMMIT")
    return {"steps_joined": len(rows)}


def add_op_ranges(con: sqlite3.Connection) -> dict:
    """nvtx-dense: an NVTX range around each kernel launch call (0.5 us before it to 0.2 us
    after it, on its thread), its text the op's name and a sequence number kept in the row,
    as PyTorch's emit_nvtx ranges are ("aten::mm, seq = 7"). The table is then rewritten in
    start order, as nsys writes it: none of the 24 NVTX tables of the real exports here (the
    Ulysses emit_nvtx export among them) has a row out of start order. (A table out of order is
    the out-of-order kind's, whose every table is.)"""
    ops = " ".join(f"WHEN {i} THEN '{name}'" for i, name in enumerate(OP_NAMES))
    op_range = {
        "start": "r.start - 500",
        "end": 'r."end" + 200',
        "eventType": "59",
        "text": f"(CASE r.correlationId % {len(OP_NAMES)} {ops} END) || ', seq = ' || "
        "r.correlationId",
        "globalTid": "r.globalTid",
        "domainId": "0",
    }
    names = [row[1] for row in con.execute("PRAGMA table_info(NVTX_EVENTS)")]
    (create,) = con.execute(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'NVTX_EVENTS'"
    ).fetchone()
    con.execute("BEGIN")
    # (a new table filled in start order, the old one's rows among the added: rewriting the
    # grown table instead would leave its pages free in the file, as big again)
    con.execute(create.replace("NVTX_EVENTS", "NVTX_SORTED", 1))
    added = (
        con.execute(
            "INSERT INTO NVTX_SORTED SELECT * FROM (SELECT * FROM NVTX_EVENTS UNION ALL SELECT "
            + ", ".join(op_range.get(name, "NULL") for name in names)
            + " FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON s.id = r.nameId "
            "WHERE s.value LIKE 'cudaLaunchKernel%') ORDER BY start"
        ).rowcount
        - con.execute("SELECT count(*) FROM NVTX_EVENTS").fetchone()[0]
    )
    con.execute("DROP TABLE NVTX_EVENTS")
    con.execute("ALTER TABLE NVTX_SORTED RENAME TO NVTX_EVENTS")
    con.execute("COMMIT")
    return {"op_ranges": added}


# How each kind built from its kernel-dense twin by editing a copy changes it, and the version
# of each edit: an input made by an earlier one is made again (nvtx-dense 2: its table in
# start order).
EDITS: dict[str, Callable[[sqlite3.Connection], dict]] = {
    "few-long-steps": join_steps,
    "nvtx-dense": add_op_ranges,
}
EDIT_VERSIONS = {"few-long-steps": 1, "nvtx-dense": 2}


def build_ranks(source: Path, spec: str, rebuild: bool) -> tuple[Path, dict]:
    """``spec`` "8x128MB": a folder of 8 per-rank files, hard links to one kernel-dense export
    of that size (one copy on disk; each rank is still read and analysed on its own)."""
    count, size = spec.upper().split("X", 1)
    path, meta = build_input(source, parse_size(size), size, rebuild, "kernel-dense")
    folder = OUT / f"ranks-{spec}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for rank in range(int(count)):
        os.link(path, folder / f"rank_{rank}.sqlite")
    return folder, {**meta, "ranks": int(count), "bytes": meta["bytes"] * int(count)}


# ------------------------------------------------------------------------------ measuring

# Runs a command and reports its wall time and the peak RSS of its biggest process. A fresh
# interpreter per run, so RUSAGE_CHILDREN holds this command's processes only (ru_maxrss of
# RUSAGE_CHILDREN is that of the largest descendant, worker processes included).
MEASURE = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
try:
    p = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=float(sys.argv[1]))
    rc, out, err = p.returncode, p.stdout, p.stderr
except subprocess.TimeoutExpired:
    rc, out, err = "timeout", "", f"timed out after {sys.argv[1]} s"
wall = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime,
                  "rss_mb": ru.ru_maxrss / 1024, "out": out[-4000:], "err": err[-4000:]}))
"""

# What a loader run does inside its own process; prints the time of the call alone.
LOAD = """
import json, sys, time
from traceclf.ingest.cache import load_trace_cached
t = time.perf_counter()
trace = load_trace_cached(sys.argv[2], use_cache=sys.argv[1] != "nocache")
print(json.dumps({"call_s": time.perf_counter() - t}))
"""

# The columns the measures need, by table: the read-only floor reads exactly these, for the
# whole capture, through connectorx into Arrow (as traceclf's loader does), big tables in two
# rowid ranges on the two cores. No analysis can read the whole capture faster than this.
FLOOR_COLUMNS = {
    "CUPTI_ACTIVITY_KIND_KERNEL": (
        "start end deviceId streamId correlationId globalPid demangledName shortName gridX gridY "
        "gridZ blockX blockY blockZ registersPerThread staticSharedMemory dynamicSharedMemory "
        "graphNodeId graphId"
    ),
    "CUPTI_ACTIVITY_KIND_GRAPH_TRACE": "start end deviceId streamId correlationId globalPid graphId graphExecId",
    "CUPTI_ACTIVITY_KIND_MEMCPY": (
        "start end deviceId streamId correlationId globalPid bytes copyKind srcKind dstKind"
    ),
    "CUPTI_ACTIVITY_KIND_MEMSET": "start end deviceId streamId correlationId globalPid bytes",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "start end globalTid correlationId nameId",
    "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION": "start end deviceId streamId correlationId globalPid syncType",
    "NVTX_EVENTS": "start end eventType text textId globalTid domainId",
    "CUDA_GPU_MEMORY_USAGE_EVENTS": "start globalPid deviceId bytes memoryOperationType",
    "PROFILER_OVERHEAD": "start end globalTid nameId",
    "GPU_METRICS": "timestamp typeId metricId value",
}
FLOOR = """
import json, sqlite3, sys, time
from urllib.parse import quote
import connectorx as cx
t = time.perf_counter()
path, wanted = sys.argv[1], json.loads(sys.argv[2])
uri = f"file:{quote(path)}?mode=ro&immutable=1"
con = sqlite3.connect(uri, uri=True)
frames, rows = [], 0
for table, cols in wanted.items():
    have = {r[1] for r in con.execute(f"PRAGMA table_info('{table}')")}
    cols = [c for c in cols.split() if c in have]
    if not cols:
        continue
    lo, hi = con.execute(f"SELECT min(rowid) - 1, max(rowid) FROM {table}").fetchone()
    if hi is None:
        continue
    select = f"SELECT {', '.join(repr(c).replace(chr(39), chr(34)) for c in cols)} FROM {table}"
    where = "metricId IN (SELECT metricId FROM TARGET_INFO_GPU_METRICS WHERE metricName LIKE '%Active%' OR metricName LIKE 'SM Issue%')" if table == "GPU_METRICS" else "1"
    mid = lo + (hi - lo) // 2
    queries = [f"{select} WHERE rowid > {a} AND rowid <= {b} AND {where}" for a, b in ((lo, mid), (mid, hi))]
    frame = cx.read_sql("sqlite://" + quote(uri, safe=""), queries, return_type="arrow")
    rows += frame.num_rows
    frames.append(frame)
print(json.dumps({"call_s": time.perf_counter() - t, "rows": rows}))
"""


@dataclass
class Run:
    tool: str
    mode: str
    wall_s: float | None
    cpu_s: float | None
    rss_mb: float | None
    call_s: float | None = None
    note: str = ""
    load: float | None = None  # 1-minute load average as the run started (other work)
    err: str = ""  # the tail of the command's stderr
    out: str = field(default="", repr=False)  # the tail of its stdout


# --settle LOAD: before each run, wait (up to SETTLE_MAX_S) for the 1-minute load average to
# drop below LOAD, so that other people's work on a shared machine weighs less on the rows.
SETTLE = {"load": None}
SETTLE_MAX_S = 90


def settle() -> float:
    """Wait for a quiet machine if asked; the 1-minute load average the run starts with."""
    limit, waited = SETTLE["load"], 0
    while limit is not None and os.getloadavg()[0] > limit and waited < SETTLE_MAX_S:
        time.sleep(5)
        waited += 5
    return os.getloadavg()[0]


def measure(
    tool: str, mode: str, cmd: Sequence[str], *, cwd: Path = ROOT, env: dict | None = None
) -> Run:
    load = settle()
    try:
        done = subprocess.run(
            [sys.executable, "-c", MEASURE, str(PER_RUN_TIMEOUT_S), *cmd],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(done.stdout)
    except (subprocess.CalledProcessError, json.JSONDecodeError) as e:
        return Run(tool, mode, None, None, None, note=f"did not finish: {str(e)[:120]}", load=load)
    run = Run(
        tool,
        mode,
        result["wall_s"],
        result["cpu_s"],
        result["rss_mb"],
        err=result["err"],
        out=result["out"],
        load=load,
    )
    if result["rc"] != 0:
        last = (result["err"].strip().splitlines() or ["?"])[-1]
        run.note = f"exit {result['rc']}: {last[:160]}"
    elif result["out"].startswith('{"call_s"'):
        run.call_s = json.loads(result["out"])["call_s"]
    return run


def clear_cache(path: Path, env: dict) -> None:
    targets = sorted(path.glob("*.sqlite")) if path.is_dir() else [path]
    for target in targets:
        shutil.rmtree(target.parent / (target.name + ".traceclf"), ignore_errors=True)
    shutil.rmtree(env["TRACECLF_CACHE_DIR"], ignore_errors=True)


def traceclf_env() -> dict:
    return {**os.environ, "TRACECLF_CACHE_DIR": str(OUT / "cache")}


def traceclf_exe() -> list[str]:
    """The console script beside this interpreter, or ``python -m traceclf`` where traceclf is
    importable but not installed (on PYTHONPATH, as on a borrowed machine of more cores)."""
    script = Path(sys.executable).with_name("traceclf")
    return [str(script)] if script.exists() else [sys.executable, "-m", "traceclf"]


def compile_bytecode() -> None:
    """Byte-compile traceclf as an installed package would be (pip compiles what it installs):
    an editable install under PYTHONDONTWRITEBYTECODE would otherwise compile every module
    from source in every timed run (~0.1 s of each)."""
    package = Path(
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import traceclf, os; print(os.path.dirname(traceclf.__file__))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True)


def has_all_steps() -> bool:
    """Whether this traceclf has the window mode (and so ``--all-steps``)."""
    help_text = subprocess.run(
        [*traceclf_exe(), "analyze", "--help"], capture_output=True, text=True
    ).stdout
    return "--all-steps" in help_text


def loader_runs(path: Path) -> list[Run]:
    env = traceclf_env()
    clear_cache(path, env)
    load = [sys.executable, "-c", LOAD]
    runs = [measure("load_trace", "no cache", [*load, "nocache", str(path)], env=env)]
    runs.append(
        measure("load_trace_cached", "cold (miss + write)", [*load, "cache", str(path)], env=env)
    )
    runs.append(measure("load_trace_cached", "warm (hit)", [*load, "cache", str(path)], env=env))
    return runs


def floor_run(path: Path) -> Run:
    wanted = json.dumps(FLOOR_COLUMNS)
    return measure(
        "read-only floor", "connectorx", [sys.executable, "-c", FLOOR, str(path), wanted]
    )


def cli_runs(path: Path, all_steps: bool) -> list[Run]:
    """traceclf analyze cold then warm, in the default mode and (when there is one) with
    ``--all-steps``; each cold run starts with no cache at all."""
    env = traceclf_env()
    cmd = [*traceclf_exe(), "analyze", str(path), "--format", "json", "--quiet"]
    variants = [("", cmd)]
    if all_steps:
        variants.append((" --all-steps", [*cmd, "--all-steps"]))
    runs = []
    for suffix, command in variants:
        tool = "traceclf analyze" + suffix
        cold = []
        for _ in range(REPEAT["n"]):  # each cold run starts with no cache at all
            clear_cache(path, env)
            cold.append(measure(tool, "cold", command, env=env))
        warm = [measure(tool, "warm", command, env=env) for _ in range(REPEAT["n"])]
        runs += [median_run(cold), median_run(warm)]
    return runs


# --repeat N: each row is the median run (by wall time) of N; other work on a shared machine
# makes single runs vary by a third.
REPEAT = {"n": 1}


def median_run(runs: list[Run]) -> Run:
    timed = sorted((r for r in runs if r.wall_s is not None), key=lambda r: r.wall_s or 0)
    if not timed:
        return runs[0]
    run = timed[(len(timed) - 1) // 2]
    if len(runs) > 1:
        walls = ", ".join(f"{r.wall_s:.2f}" for r in timed)
        run.note = (run.note + "; " if run.note else "") + f"median of {len(runs)}: {walls} s"
    return run


def rank_runs(folder: Path, all_steps: bool, jobs_counts: Sequence[int] = (1, 2)) -> list[Run]:
    """Every rank file of ``folder`` in one analysis, with each of ``jobs_counts`` worker
    processes."""
    env = traceclf_env()
    runs = []
    for jobs in jobs_counts:
        cmd = [*traceclf_exe(), "analyze", str(folder), "--format", "json", "--quiet"]
        tries = []
        for _ in range(REPEAT["n"]):
            clear_cache(folder, env)
            tries.append(
                measure(
                    "traceclf analyze", f"cold, --jobs {jobs}", [*cmd, "--jobs", str(jobs)], env=env
                )
            )
        runs.append(median_run(tries))
    return runs


# nsys-ai asks DuckDB to download its sqlite extension at run time; offline that fails after
# network timeouts, and it goes on with Python's sqlite3 instead of its Parquet cache.
OFFLINE_NSYS_AI = (
    "offline: DuckDB sqlite extension download failed, fell back to sqlite3 (no cache)"
)


def nsys_ai_runs(path: Path, meta: dict) -> list[Run]:
    exe = Path(sys.executable).with_name("nsys-ai")
    if not exe.exists():
        return [
            Run(
                "nsys-ai diagnose",
                "-",
                None,
                None,
                None,
                note="not installed (.venv/bin/pip install nsys-ai)",
            )
        ]
    # nsys-ai keeps sessions under the working directory and state under $HOME, and writes
    # into the export it reads (tables and indexes): it gets its own copy, all of it inside
    # benchmarks/out/nsys-ai, removed afterwards.
    work = OUT / "nsys-ai"
    shutil.rmtree(work, ignore_errors=True)
    (work / "home").mkdir(parents=True)
    copy = work / path.name
    shutil.copyfile(path, copy)
    env = {**os.environ, "HOME": str(work / "home")}
    cmd = [str(exe), "diagnose", str(copy), "--format", "json"]
    runs = [measure("nsys-ai diagnose", "cold", cmd, cwd=work, env=env)]
    grown = copy.stat().st_size
    for run in runs:
        if not run.note and "Failed to download extension" in run.err:
            run.note = OFFLINE_NSYS_AI
        if grown > meta["bytes"] * 1.01:
            run.note = (run.note + "; " if run.note else "") + (
                f"grew its input to {grown / 1e6:,.0f} MB"
            )
    shutil.rmtree(work, ignore_errors=True)
    return runs


# ------------------------------------------------------------------------------ reporting


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "?",
    )
    ram_kb = meminfo_kb("MemTotal:")
    import polars

    return (
        f"{os.cpu_count()} CPUs (`nproc` {len(os.sched_getaffinity(0))}, affinity "
        f"{sorted(os.sched_getaffinity(0))}), {ram_kb / 2**20:.1f} GiB RAM, "
        f"{cpu}; Python {platform.python_version()}, polars {polars.__version__}"
    )


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def describe(meta: dict) -> str:
    rows = (
        f"{meta['kernels'] / 1e6:.1f} M kernels, {meta['api'] / 1e6:.1f} M API"
        if "kernels" in meta
        else f"{meta['events']:,} events"
    )
    ranks = f"{meta['ranks']} ranks, " if meta.get("ranks") else ""
    if (meta.get("pids") or 1) > 1:
        ranks += f"{meta['pids']} processes, "
    return f"{meta.get('kind', 'gpu-metrics')}, {ranks}{rows}"


def table(rows: list[tuple[str, dict, Run]], floors: dict[str, Run] | None = None) -> str:
    floors = floors or {}
    lines = [
        "| input | size | rows | tool | mode | wall s | CPU s | peak RSS MB | × floor | load | note |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, meta, run in rows:
        floor = floors.get(name)
        ratio = (
            run.wall_s / floor.wall_s
            if floor and floor.wall_s and run.wall_s and run.tool != "read-only floor"
            else None
        )
        lines.append(
            f"| {name} | {meta['bytes'] / 1e6:,.0f} MB | {describe(meta)} | {run.tool} | {run.mode} "
            f"| {fmt(run.wall_s, '.2f')} | {fmt(run.cpu_s, '.2f')} "
            f"| {fmt(run.rss_mb, ',.0f')} | {fmt(ratio, '.2f')} | {fmt(run.load, '.1f')} "
            f"| {run.note} |"
        )
    return "\n".join(lines)


def loader_table(rows: list[tuple[str, dict, Run]]) -> str:
    lines = [
        "| input | size | events | tool | mode | wall s | call s | CPU s | peak RSS MB | events/s | note |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, meta, run in rows:
        timed = run.call_s if run.call_s is not None else run.wall_s
        rate = meta["events"] / timed if timed and not run.note else None
        lines.append(
            f"| {name} | {meta['bytes'] / 1e6:,.0f} MB | {meta['events']:,} | {run.tool} | {run.mode} "
            f"| {fmt(run.wall_s, '.2f')} | {fmt(run.call_s, '.2f')} | {fmt(run.cpu_s, '.2f')} "
            f"| {fmt(run.rss_mb, ',.0f')} | {fmt(rate, ',.0f')} | {run.note} |"
        )
    return "\n".join(lines)


@dataclass
class Target:
    what: str
    bound: str
    measured: str
    met: bool | None  # None: not measured in this run


def targets(runs: list[tuple[str, dict, Run]]) -> list[Target]:
    """The targets of issues 12 and 26, read off this run's measurements: every input of
    about 1 GB (each kind), the 4 GB one, --all-steps against the read floor, the out-of-order
    twin against its ordered twin, re-analysis, and --jobs."""

    def find(name: str, tool: str, mode: str) -> Run | None:
        return next(
            (r for n, _m, r in runs if n == name and r.tool == tool and r.mode == mode), None
        )

    def failed(run: Run | None) -> bool:
        return run is None or run.wall_s is None or run.note.startswith(("exit", "did not"))

    inputs = {name: meta for name, meta, _run in runs if not meta.get("ranks")}
    out = []
    for name, meta in inputs.items():
        size = meta["bytes"] / 1e9
        kind = meta.get("kind", "gpu-metrics")
        cold = find(name, "traceclf analyze", "cold")
        wall = 4 if size > 3 else 3
        what = f"{size:.1f} GB {kind}, default mode, cold"
        if failed(cold):
            out.append(Target(what, f"< {wall} s, < 1 GB", "failed", False))
        else:
            text = f"{cold.wall_s:.2f} s, {cold.rss_mb:,.0f} MB"
            met = cold.wall_s < wall and cold.rss_mb < 1024
            out.append(Target(what, f"< {wall} s, < 1 GB", text, met))
        whole, floor = (
            find(name, "traceclf analyze --all-steps", "cold"),
            find(name, "read-only floor", "connectorx"),
        )
        if whole is not None and not failed(whole) and not failed(floor):
            ratio = whole.wall_s / floor.wall_s
            out.append(
                Target(
                    f"{size:.1f} GB {kind}, `--all-steps`, cold",
                    "≤ 1.5× read floor, < 2 GB",
                    f"{whole.wall_s:.2f} s = {ratio:.2f}× floor ({floor.wall_s:.2f} s), "
                    f"{whole.rss_mb:,.0f} MB",
                    ratio <= 1.5 and whole.rss_mb < 2048,
                )
            )
        if kind in SWAPPED and not failed(cold):
            twin = next(
                (
                    find(n, "traceclf analyze", "cold")
                    for n, m in inputs.items()
                    if m.get("kind") == "kernel-dense" and m.get("copies") == meta.get("copies")
                ),
                None,
            )
            if not failed(twin):
                ratio = cold.wall_s / twin.wall_s
                out.append(
                    Target(
                        f"{size:.1f} GB out-of-order vs its ordered twin, default mode",
                        "≤ 2× wall, < 1 GB",
                        f"{ratio:.2f}× ({cold.wall_s:.2f} s vs {twin.wall_s:.2f} s), "
                        f"{cold.rss_mb:,.0f} MB",
                        ratio <= 2 and cold.rss_mb < 1024,
                    )
                )
    warm = [
        run
        for _, meta, run in runs
        if run.mode == "warm" and run.tool.startswith("traceclf") and run.wall_s
    ]
    if warm:
        worst = max(run.wall_s for run in warm)
        out.append(
            Target(
                "re-analysis of an unchanged export (every input)",
                "< 0.5 s",
                f"{worst:.2f} s (slowest)",
                worst < 0.5,
            )
        )
    ranks = [(meta, run) for _, meta, run in runs if meta.get("ranks")]
    one = next((r for m, r in ranks if r.mode.endswith("--jobs 1")), None)
    two = next((r for m, r in ranks if r.mode.endswith("--jobs 2")), None)
    if one and two and one.wall_s and two.wall_s:
        ratio = two.wall_s / one.wall_s
        out.append(
            Target(
                f"{ranks[0][0]['ranks']} per-rank files, `--jobs 2` vs `--jobs 1`",
                "≤ 0.6× wall, every process < 1 GB",
                f"{ratio:.2f}× ({two.wall_s:.2f} s vs {one.wall_s:.2f} s), largest process {max(one.rss_mb, two.rss_mb):,.0f} MB",
                ratio <= 0.6 and max(one.rss_mb, two.rss_mb) < 1024,
            )
        )
    return out


def targets_table(items: list[Target]) -> str:
    lines = ["| target | bound | measured | met |", "|---|---|---|---|"]
    for t in items:
        met = "not measured" if t.met is None else ("yes" if t.met else "**no**")
        lines.append(f"| {t.what} | {t.bound} | {t.measured} | {met} |")
    lines.append(
        "| window-mode fractions vs `--all-steps`, every shared trace | within 0.01 "
        "| tested: tests/test_window.py | see the test run |"
    )
    return "\n".join(lines)


def save_runs(analysis: list, path: Path) -> None:
    """The end-to-end runs as JSON, for a later before/after comparison (``--before``)."""
    rows = [
        {
            "input": name,
            "bytes": meta["bytes"],
            "kind": meta.get("kind"),
            "ranks": meta.get("ranks"),
            "tool": run.tool,
            "mode": run.mode,
            "wall_s": run.wall_s,
            "rss_mb": run.rss_mb,
            "cpu_s": run.cpu_s,
            "load": run.load,
            "note": run.note,
        }
        for name, meta, run in analysis
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M"), "runs": rows}, indent=1
        )
    )


def comparison(analysis: list, before: dict) -> str:
    """Before (the runs saved in ``before``) vs now, for each input and traceclf mode; a
    mode the earlier traceclf did not have compares with its only (whole-capture) mode."""
    old = {(r["input"], r["tool"], r["mode"]): r for r in before["runs"]}
    lines = [
        f"Before: {before['when']} ({before.get('label', 'earlier traceclf')}); after: this run.",
        "",
        "| input | tool | mode | before wall s | after wall s | before RSS MB | after RSS MB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, _meta, run in analysis:
        if not run.tool.startswith("traceclf"):
            continue
        prev = old.get((name, run.tool, run.mode)) or old.get(
            (name, run.tool.replace(" --all-steps", ""), run.mode)
        )
        if prev is None:
            continue
        lines.append(
            f"| {name} | {run.tool} | {run.mode} | {fmt(prev['wall_s'], '.2f')} "
            f"| {fmt(run.wall_s, '.2f')} | {fmt(prev['rss_mb'], ',.0f')} | {fmt(run.rss_mb, ',.0f')} |"
        )
    return "\n".join(lines)


def meminfo_kb(field: str) -> int:
    """A /proc/meminfo field (``"MemTotal:"``, ...) in kB."""
    return next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith(field)
    )


def page_cache() -> str:
    """How much of the inputs the OS can keep cached: a VM whose host reclaims the page cache
    reads inputs larger than it partly from disk, which moves the default mode's rows most
    (they read scattered row ranges)."""
    cached_kb = meminfo_kb("Cached:")
    return (
        f"OS page cache {cached_kb / 2**20:.1f} GiB when written (inputs were just written or "
        'read; those larger than the cache are partly read from disk); "cold"/"warm" refer '
        "to traceclf's caches."
    )


def load_during(analysis: list) -> str:
    """The machine's 1-minute load average as the runs started, and when written."""
    loads = [run.load for _, _, run in analysis if run.load is not None]
    during = (
        f"{min(loads):.2f}–{max(loads):.2f} as the runs started (column load)" if loads else "-"
    )
    at_end = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"Load average (1 min) {during}; (1, 5, 15 min) when written: {at_end}."


def write_results(
    analysis: list,
    loader: list,
    floors: dict,
    command: str,
    goals: list[Target],
    befores: Sequence[dict] = (),
) -> None:
    text = "\n".join(
        [
            "# traceclf benchmark results",
            "",
            f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M')}.",
            f"Machine: {machine()}.",
            # Other work on the machine slows every row alike; this says whether there was any.
            load_during(analysis),
            page_cache(),
            "",
            "## Targets (issues 12 and 26)",
            "",
            targets_table(goals),
            "",
            "## End to end",
            "",
            "`traceclf analyze --format json --quiet` (default window mode, and `--all-steps`), "
            "the read-only floor, `nsys-ai diagnose --format json`; × floor = wall / the "
            "floor's wall on the same export.",
            "",
            table(analysis, floors) if analysis else "(skipped)",
            "",
        ]
        + [
            line
            for before in befores
            for line in ("## Before and after", "", comparison(analysis, before), "")
        ]
        + (
            ["## Loader (whole-capture trace model only)", "", loader_table(loader), ""]
            if loader
            else []
        )
    )
    (HERE / "RESULTS.md").write_text(text)


# The README's Performance table is written between these markers.
README_START = "<!-- bench.py: performance table -->"
README_END = "<!-- /bench.py -->"
README_ROWS = (  # (kind, size, tool, mode, label)
    ("kernel-dense", 1e9, "traceclf analyze", "cold", "cold"),
    ("out-of-order", 1e9, "traceclf analyze", "cold", "cold"),
    ("ep-comm", 1e9, "traceclf analyze", "cold", "cold"),
    ("few-long-steps", 1e9, "traceclf analyze", "cold", "cold"),
    ("nvtx-dense", 1.4e9, "traceclf analyze", "cold", "cold"),
    ("cuda-graph", 1e9, "traceclf analyze", "cold", "cold"),
    ("gpu-metrics", 1e9, "traceclf analyze", "cold", "cold"),
    ("kernel-dense", 2e9, "traceclf analyze", "cold", "cold"),
    ("kernel-dense", 4.3e9, "traceclf analyze", "cold", "cold"),
    ("kernel-dense", 1e9, "traceclf analyze", "warm", "warm (re-analysis)"),
    ("kernel-dense", 1e9, "traceclf analyze --all-steps", "cold", "`--all-steps`, cold"),
    ("out-of-order", 1e9, "traceclf analyze --all-steps", "cold", "`--all-steps`, cold"),
    ("ep-comm", 1e9, "traceclf analyze --all-steps", "cold", "`--all-steps`, cold"),
    ("cuda-graph", 1e9, "traceclf analyze --all-steps", "cold", "`--all-steps`, cold"),
    ("kernel-dense", 1e9, "traceclf analyze --all-steps", "warm", "`--all-steps`, warm"),
)


def readme_table(analysis: list, befores: Sequence[dict]) -> str:
    """Wall s / peak RSS MB of the README's rows, in each earlier run and this one."""

    def cell(wall: float | None, rss: float | None) -> str:
        return "-" if wall is None else f"{wall:.2f} / {rss:,.0f}"

    def near(kind: str | None, size: float, nbytes: float) -> bool:
        return abs(nbytes - size) / size < 0.3

    head = "| export | mode | " + " | ".join(
        f"{b.get('label', b['when'])}: wall s / RSS MB" for b in befores
    )
    lines = [head + " | now: wall s / RSS MB |", "|---|---|" + "---:|" * (len(befores) + 1)]
    for kind, size, tool, mode, label in README_ROWS:
        now = next(
            (
                (name, meta, run)
                for name, meta, run in analysis
                if meta.get("kind") == kind
                and not meta.get("ranks")
                and run.tool == tool
                and run.mode == mode
                and near(kind, size, meta["bytes"])
            ),
            None,
        )
        if now is None:
            continue
        name, meta, run = now
        earlier = []
        for before in befores:
            old = {(r["input"], r["tool"], r["mode"]): r for r in before["runs"]}
            prev = old.get((name, tool, mode)) or old.get(
                (name, tool.replace(" --all-steps", ""), mode)
            )
            earlier.append(cell(prev["wall_s"], prev["rss_mb"]) if prev else "-")
        what = f"{meta['bytes'] / 1e9:.1f} GB {kind}"
        lines.append(
            f"| {what} | {label} | " + " | ".join([*earlier, cell(run.wall_s, run.rss_mb)]) + " |"
        )
    ranks = [(meta, run) for _, meta, run in analysis if meta.get("ranks")]
    if len(ranks) == 2:
        (meta, one), (_, two) = ranks
        earlier = []
        for before in befores:
            rows = [r for r in before["runs"] if r.get("ranks")]
            earlier.append(
                " / ".join(fmt(r["wall_s"], ".1f") for r in rows[:2]) if len(rows) >= 2 else "-"
            )
        now = f"{fmt(one.wall_s, '.1f')} / {fmt(two.wall_s, '.1f')} (largest process {max(one.rss_mb or 0, two.rss_mb or 0):,.0f} MB)"
        lines.append(
            f"| {meta['ranks']} × {meta['bytes'] / meta['ranks'] / 1e6:,.0f} MB per-rank files "
            f"| `--jobs 1` / `--jobs 2` wall s | " + " | ".join([*earlier, now]) + " |"
        )
    return "\n".join(lines)


def update_readme(analysis: list, befores: Sequence[dict], goals: list[Target]) -> None:
    """Rewrite the README's Performance table (between the markers) from this run."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        return
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    body = "\n".join(
        [
            "",
            f"Measured {time.strftime('%Y-%m-%d')} by `benchmarks/bench.py` on {machine()}; "
            + load_during(analysis),
            "",
            readme_table(analysis, befores),
            "",
            "Targets (issues 12 and 26, checked by the benchmark, not by tests):",
            "",
            targets_table(goals),
            "",
        ]
    )
    readme.write_text(head + README_START + body + README_END + tail)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--inputs",
        default=DEFAULT_INPUTS,
        help=f"comma-separated KIND:SIZE inputs to build and time, KIND one of {', '.join(KINDS)} "
        f"(default: {DEFAULT_INPUTS}; 'none': only the per-rank files)",
    )
    parser.add_argument(
        "--sizes", help="shorthand for --inputs gpu-metrics:SIZE,... (the earlier benchmark)"
    )
    parser.add_argument(
        "--ranks",
        default=DEFAULT_RANKS,
        help=f"NxSIZE per-rank kernel-dense files timed with --jobs 1 and 2 (default {DEFAULT_RANKS}; "
        "'none' to skip)",
    )
    parser.add_argument(
        "--jobs",
        default="1,2",
        help="comma-separated --jobs values the per-rank files are timed with (default 1,2; "
        "more on a machine of more cores)",
    )
    parser.add_argument(
        "--source",
        type=Path,
        help="real export to replicate "
        "(default: fixtures/ or /work/shared/traces h100_host_launch_gpumetrics)",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild inputs that exist")
    parser.add_argument("--loader", action="store_true", help="also time the loader alone")
    parser.add_argument(
        "--nsys-ai",
        choices=("smallest", "all", "none"),
        default="smallest",
        help="run nsys-ai on the smallest input only (default), on all, or not at all",
    )
    parser.add_argument(
        "--before",
        type=Path,
        action="append",
        default=[],
        help="runs saved by an earlier benchmark (benchmarks/out/runs.json) to compare with "
        "(repeatable; benchmarks/before*.json hold earlier releases')",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="time each traceclf row N times and report the median run (default 1)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        metavar="LOAD",
        help="before each run, wait (up to 90 s) for the 1-minute load average to fall below "
        "LOAD (a shared machine)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the built inputs (default: delete those over 1.5 GB)",
    )
    args = parser.parse_args(argv)
    SETTLE["load"] = args.settle
    REPEAT["n"] = max(1, args.repeat)
    source = args.source or next((p for p in DEFAULT_SOURCES if p.exists()), None)
    if source is None:
        raise SystemExit("no source trace: pass --source")
    specs = (
        [f"gpu-metrics:{s}" for s in args.sizes.split(",")]
        if args.sizes
        else [s for s in args.inputs.split(",") if s.strip() and s.strip() != "none"]
    )
    all_steps = has_all_steps()
    compile_bytecode()
    analysis, loader, floors, built = [], [], {}, []
    nsys_ai_done = False
    for spec in specs:
        kind, _, label = spec.strip().partition(":")
        if kind not in KINDS:
            raise SystemExit(f"unknown input kind {kind!r} (one of {', '.join(KINDS)})")
        label = label.strip().upper()
        copies = None
        if kind in TWINS:  # the ordered twin's copies, so that both hold the same rows
            twin, twin_meta = build_input(
                source, parse_size(label), label, args.rebuild, "kernel-dense"
            )
            copies = twin_meta["copies"]
        if kind in EDITS:
            path, meta = edited_twin(twin, twin_meta, kind, args.rebuild, EDITS[kind])
        else:
            path, meta = build_input(
                source_of(kind, source), parse_size(label), label, args.rebuild, kind, copies
            )
        built.append(path)
        print(f"{path.name}: {meta['bytes'] / 1e6:,.0f} MB, {describe(meta)}", file=sys.stderr)
        # --all-steps reads the whole capture: past ALL_STEPS_MAX_BYTES it needs more memory
        # than the targets allow, and the default mode is what the big inputs are for
        whole = all_steps and meta["bytes"] <= ALL_STEPS_MAX_BYTES
        if whole:
            floor = floor_run(path)
            floors[path.name] = floor
            analysis.append((path.name, meta, floor))
        analysis += [(path.name, meta, run) for run in cli_runs(path, whole)]
        if args.loader:
            loader += [(path.name, meta, run) for run in loader_runs(path)]
        small = meta["bytes"] <= NSYS_AI_MAX_BYTES and not nsys_ai_done
        if args.nsys_ai == "all" or (args.nsys_ai == "smallest" and small):
            analysis += [(path.name, meta, run) for run in nsys_ai_runs(path, meta)]
            nsys_ai_done = True
        print(table(analysis[-5:], floors), file=sys.stderr)
    if args.ranks != "none":
        folder, meta = build_ranks(source, args.ranks, args.rebuild)
        jobs = [int(j) for j in args.jobs.split(",")]
        analysis += [(folder.name, meta, run) for run in rank_runs(folder, all_steps, jobs)]
        shutil.rmtree(folder, ignore_errors=True)
    goals = targets(analysis)
    command = " ".join(
        ["python benchmarks/bench.py", *(argv if argv is not None else sys.argv[1:])]
    )
    befores = [json.loads(path.read_text()) for path in args.before]
    write_results(analysis, loader, floors, command, goals, befores)
    update_readme(analysis, befores, goals)
    save_runs(analysis, OUT / "runs.json")
    print(table(analysis, floors))
    if loader:
        print(loader_table(loader))
    print(targets_table(goals))
    if not args.keep:  # disk is limited: the biggest inputs are rebuilt in a minute when needed
        for path in built:
            if path.exists() and path.stat().st_size > 1.5e9:
                path.unlink()
                path.with_suffix(".json").unlink(missing_ok=True)
    print(f"\nwritten to {HERE / 'RESULTS.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
