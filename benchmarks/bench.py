"""Benchmark traceclf (and nsys-ai, when installed) on large synthetic-but-real exports.

    .venv/bin/python benchmarks/bench.py [--sizes 100MB,1GB] [--source TRACE.sqlite]

Builds long exports by replicating a real trace's event rows in time (benchmarks/out/), then
times, each in a fresh process: the loader (``load_trace``, ``load_trace_cached`` cold and
warm), ``traceclf analyze`` cold and warm, and ``nsys-ai diagnose``. Prints a table and writes
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
from collections.abc import Sequence
from dataclasses import dataclass
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


def build_input(source: Path, target: int, label: str, rebuild: bool) -> tuple[Path, dict]:
    """A copy of ``source`` grown to at least ``target`` bytes by replicated event rows.

    Copy k shifts every time column by k x the event span and every correlationId by
    k x (max correlationId + 1), so API calls still pair with their GPU work and copies follow
    one another on the timeline like later steps of the same run.
    """
    dest = OUT / f"{source.stem}-{label}.sqlite"
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
    tables = [t for t in REPLICATED if t in present]
    span, corr = event_span(con, tables), max_correlation(con, tables) + 1
    statements = [
        copy_statement(
            con, t, REPLICATED[t], con.execute(f"SELECT max(rowid) FROM {t}").fetchone()[0] or 0
        )
        for t in tables
    ]
    started, copies = time.perf_counter(), 1
    while tmp.stat().st_size < target:
        con.execute("BEGIN")
        for statement in statements:
            con.execute(statement, {"dt": copies * span, "dc": copies * corr})
        con.execute("COMMIT")
        copies += 1
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
        "copies": copies,
        "events": count_events(con),
        "bytes": tmp.stat().st_size,
        "source": str(source),
        "build_s": round(time.perf_counter() - started, 1),
    }
    con.close()
    os.replace(tmp, dest)
    sidecar.write_text(json.dumps(meta, indent=1))
    print(file=sys.stderr)
    return dest, meta


# ------------------------------------------------------------------------------ measuring

# Runs a command and reports its wall time and the peak RSS of its biggest process. A fresh
# interpreter per run, so RUSAGE_CHILDREN holds this command's processes only.
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


@dataclass
class Run:
    tool: str
    mode: str
    wall_s: float | None
    cpu_s: float | None
    rss_mb: float | None
    call_s: float | None = None
    note: str = ""
    err: str = ""  # the tail of the command's stderr


def measure(
    tool: str, mode: str, cmd: Sequence[str], *, cwd: Path = ROOT, env: dict | None = None
) -> Run:
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
        return Run(tool, mode, None, None, None, note=f"did not finish: {str(e)[:120]}")
    run = Run(tool, mode, result["wall_s"], result["cpu_s"], result["rss_mb"], err=result["err"])
    if result["rc"] != 0:
        last = (result["err"].strip().splitlines() or ["?"])[-1]
        run.note = f"exit {result['rc']}: {last[:160]}"
    elif result["out"].startswith('{"call_s"'):
        run.call_s = json.loads(result["out"])["call_s"]
    return run


def clear_cache(path: Path, env: dict) -> None:
    shutil.rmtree(path.parent / (path.name + ".traceclf"), ignore_errors=True)
    shutil.rmtree(env["TRACECLF_CACHE_DIR"], ignore_errors=True)


def traceclf_env() -> dict:
    return {**os.environ, "TRACECLF_CACHE_DIR": str(OUT / "cache")}


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


def cli_runs(path: Path) -> list[Run]:
    env = traceclf_env()
    clear_cache(path, env)
    traceclf = str(Path(sys.executable).with_name("traceclf"))
    cmd = [traceclf, "analyze", str(path), "--format", "json", "--quiet"]
    return [
        measure("traceclf analyze", "cold", cmd, env=env),
        measure("traceclf analyze", "warm", cmd, env=env),
    ]


# nsys-ai asks DuckDB to download its sqlite extension at run time; offline that fails after
# network timeouts, and it goes on with Python's sqlite3 instead of its Parquet cache.
OFFLINE_NSYS_AI = (
    "offline: DuckDB sqlite extension download failed, fell back to sqlite3 (no cache)"
)


def nsys_ai_runs(path: Path) -> list[Run]:
    exe = Path(sys.executable).with_name("nsys-ai")
    if not exe.exists():
        return [Run("nsys-ai diagnose", "-", None, None, None, note="not installed")]
    # nsys-ai keeps sessions under the working directory and state under $HOME: keep both
    # inside benchmarks/out, and clear them so the first run is cold.
    work = OUT / "nsys-ai"
    shutil.rmtree(work, ignore_errors=True)
    (work / "home").mkdir(parents=True)
    env = {**os.environ, "HOME": str(work / "home")}
    cmd = [str(exe), "diagnose", str(path), "--format", "json"]
    runs = [measure("nsys-ai diagnose", mode, cmd, cwd=work, env=env) for mode in ("cold", "warm")]
    for run in runs:
        if not run.note and "Failed to download extension" in run.err:
            run.note = OFFLINE_NSYS_AI
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
    ram_kb = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    import polars

    return (
        f"{os.cpu_count()} CPUs (`nproc` {len(os.sched_getaffinity(0))}), {ram_kb / 2**20:.1f} GiB RAM, "
        f"{cpu}; Python {platform.python_version()}, polars {polars.__version__}"
    )


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[tuple[str, dict, Run]]) -> str:
    lines = [
        "| input | size | events | tool | mode | wall s | call s | CPU s | peak RSS MB | events/s | note |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, meta, run in rows:
        timed = run.call_s if run.call_s is not None else run.wall_s
        rate = (
            meta["events"] / timed
            if timed and not run.note.startswith(("exit", "did not"))
            else None
        )
        lines.append(
            f"| {name} | {meta['bytes'] / 1e6:,.0f} MB | {meta['events']:,} | {run.tool} | {run.mode} "
            f"| {fmt(run.wall_s, '.2f')} | {fmt(run.call_s, '.2f')} | {fmt(run.cpu_s, '.2f')} "
            f"| {fmt(run.rss_mb, ',.0f')} | {fmt(rate, ',.0f')} | {run.note} |"
        )
    return "\n".join(lines)


def write_results(loader: list, analysis: list, command: str) -> None:
    text = "\n".join(
        [
            "# traceclf benchmark results",
            "",
            f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M')}.",
            f"Machine: {machine()}.",
            # Other work on the machine slows every row alike; this says whether there was any.
            "Load average (1, 5, 15 min) when written: "
            + ", ".join(f"{x:.2f}" for x in os.getloadavg())
            + ".",
            'OS page cache warm (inputs were just written); "cold"/"warm" refer to traceclf\'s cache.',
            "",
            "## Loader (trace model only)",
            "",
            table(loader),
            "",
            "## End to end (`traceclf analyze --format json --quiet`, `nsys-ai diagnose --format json`)",
            "",
            table(analysis) if analysis else "(skipped)",
            "",
        ]
    )
    (HERE / "RESULTS.md").write_text(text)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default="100MB,1GB",
        help="comma-separated input sizes to build and time (default: 100MB,1GB)",
    )
    parser.add_argument(
        "--source",
        type=Path,
        help="real export to replicate "
        "(default: fixtures/ or /work/shared/traces h100_host_launch_gpumetrics)",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild inputs that exist")
    parser.add_argument(
        "--loader-only",
        action="store_true",
        help="time the loader only, not traceclf analyze / nsys-ai",
    )
    parser.add_argument("--no-nsys-ai", action="store_true", help="skip nsys-ai")
    args = parser.parse_args(argv)
    source = args.source or next((p for p in DEFAULT_SOURCES if p.exists()), None)
    if source is None:
        raise SystemExit("no source trace: pass --source")
    loader, analysis = [], []
    for label in args.sizes.split(","):
        label = label.strip().upper()
        path, meta = build_input(source, parse_size(label), label, args.rebuild)
        print(
            f"{path.name}: {meta['bytes'] / 1e6:,.0f} MB, {meta['events']:,} events, "
            f"{meta['copies']} copies",
            file=sys.stderr,
        )
        loader += [(path.name, meta, run) for run in loader_runs(path)]
        if not args.loader_only:
            analysis += [(path.name, meta, run) for run in cli_runs(path)]
            if not args.no_nsys_ai:
                analysis += [(path.name, meta, run) for run in nsys_ai_runs(path)]
    command = " ".join(
        ["python benchmarks/bench.py", *(argv if argv is not None else sys.argv[1:])]
    )
    write_results(loader, analysis, command)
    print(table(loader))
    if analysis:
        print(table(analysis))
    print(f"\nwritten to {HERE / 'RESULTS.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
