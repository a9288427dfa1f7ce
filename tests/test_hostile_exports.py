"""What an export holds can neither run SQL, hang the analysis, crash it nor flip its answer
(issue 29: "Runs SQL or hangs on what the export holds", "Crashes and wrong answers").

- values read from an export reach SQL only after a strict type check (GPU-metric ids);
- a view named like a table traceclf reads is refused whatever the case of its name;
- NULL, REAL, TEXT or BLOB values in a time column are left out and counted
  (``capture.unusable_rows``), never "corrupt database" or an internal error;
- times no capture has (a kernel from -2^63 to 2^63-1) and allocations of 2^62 bytes are left
  out and counted instead of flipping the verdict or the peak memory;
- all-zero-length kernels give a report that is valid JSON (no NaN);
- invalid UTF-8 in NVTX text and a file that changes while it is read end in one line, with
  no Rust panic on stderr; an export being written is said to be so, not called corrupt.

Every odd export here is CONSTRUCTED: a copy of a small real export (fixtures/) edited with
sqlite3. Cases that hung run in a child process under a timeout.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import fixture_trace
from helpers.cli import CliResult, run_cli, run_cli_process
from helpers.files import copy_export

TINY = "h100_host_input_stall"  # host-bound, NVTX "batch" steps, 470 KB
METRICS = "h100_comm_a2a_gpumetrics"  # GPU metrics (SMs Active, Tensor Active)
CHILD_TIMEOUT_S = 120  # a safety net against hangs, not a speed assertion
ENDLESS = "(WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c)"


def strict_json(text: str):
    """``json.loads`` that refuses NaN and Infinity (which no JSON parser but Python's takes)."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def child(*args: str | Path) -> CliResult:
    try:
        return run_cli_process(*args, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"traceclf {' '.join(map(str, args))} still ran after {CHILD_TIMEOUT_S} s")


def edited(tmp_path: Path, *sql: str, source: str = TINY, name: str = "run.sqlite") -> Path:
    """CONSTRUCTED: a copy of a real export with ``sql`` applied."""
    path = copy_export(fixture_trace(source), tmp_path / name)
    con = sqlite3.connect(path)
    try:
        for statement in sql:
            con.execute(statement)
        con.commit()
    finally:
        con.close()
    return path


def analysed(path: Path) -> dict:
    result = child("analyze", path, "-f", "json", "-q", "--no-cache")
    assert result.code == 0 and result.stderr == "", result.stderr
    return strict_json(result.stdout)


def one_line_error(result: CliResult, *needles: str) -> None:
    assert result.code == 2, (result.code, result.stderr)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("traceclf: error: "), result.stderr
    assert "internal error" not in result.stderr and "panicked" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


# -- SQL from the export ----------------------------------------------------------------------


def _metric_ids_as_text(value: str) -> tuple[str, ...]:
    """The metric descriptions rebuilt with a TEXT metricId column, one id set to ``value``."""
    return (
        "CREATE TABLE m AS SELECT * FROM TARGET_INFO_GPU_METRICS",
        "DROP TABLE TARGET_INFO_GPU_METRICS",
        "CREATE TABLE TARGET_INFO_GPU_METRICS (typeId INTEGER, sourceId INTEGER, "
        "typeName TEXT, metricId TEXT, metricName TEXT)",
        "INSERT INTO TARGET_INFO_GPU_METRICS "
        "SELECT typeId, sourceId, typeName, metricId, metricName FROM m",
        "DROP TABLE m",
        f"UPDATE TARGET_INFO_GPU_METRICS SET metricId = '{value.replace(chr(39), chr(39) * 2)}' "
        "WHERE metricName = 'SMs Active [Throughput %]'",
    )


@pytest.mark.parametrize("value", [ENDLESS, "not a number"], ids=["endless CTE", "wrong type"])
def test_gpu_metric_ids_never_reach_sql_unchecked(tmp_path: Path, value: str) -> None:
    """Constructed: TARGET_INFO_GPU_METRICS with a TEXT metricId. Pasted into ``metricId IN
    (...)`` the recursive query spun forever; the wrong type crashed with a SchemaError. Ids
    that are not integers describe no metric traceclf reads: the run goes on without them."""
    path = edited(tmp_path, *_metric_ids_as_text(value), source=METRICS)
    report = analysed(path)
    assert report["capture"]["gpu_metrics"] is False
    assert (
        report["classification"]["bound"]
        == analysed(fixture_trace(METRICS))["classification"]["bound"]
    )


@pytest.mark.parametrize("name", ["target_info_system_env", "Target_Info_System_Env"])
def test_a_view_named_like_a_read_table_in_any_case_is_refused(tmp_path: Path, name: str) -> None:
    """Constructed: the system-environment table replaced by an endless view under the same
    name in another case (SQLite resolves names whatever their case). It hung the analysis."""
    path = edited(
        tmp_path,
        "DROP TABLE TARGET_INFO_SYSTEM_ENV",
        f"CREATE VIEW {name} AS SELECT 'Hostname' AS name, {ENDLESS} AS value",
    )
    one_line_error(child("analyze", path, "-q", "--no-cache"), "run.sqlite", f"{name} is a view")


# -- odd values in event tables ----------------------------------------------------------------


FIRST_KERNEL = "rowid = (SELECT min(rowid) FROM CUPTI_ACTIVITY_KIND_KERNEL)"
WITHOUT_CONSTRAINTS = (  # the kernel table rebuilt without NOT NULL, as a damaged export has it
    "CREATE TABLE k AS SELECT * FROM CUPTI_ACTIVITY_KIND_KERNEL",
    "DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL",
    "ALTER TABLE k RENAME TO CUPTI_ACTIVITY_KIND_KERNEL",
)
ODD_TIMES = {
    "NULL start": (*WITHOUT_CONSTRAINTS, f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = NULL WHERE {FIRST_KERNEL}"),
    "REAL start": (f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = start + 0.5 WHERE {FIRST_KERNEL}",),
    "TEXT start": (f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'soon' WHERE {FIRST_KERNEL}",),
    "BLOB start": (f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = x'00ff' WHERE {FIRST_KERNEL}",),
    "TEXT end of a CUDA call": (
        "UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET \"end\" = 'later' "
        "WHERE rowid = (SELECT min(rowid) FROM CUPTI_ACTIVITY_KIND_RUNTIME)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ODD_TIMES)
def test_a_time_of_another_type_is_left_out_and_counted(tmp_path: Path, case: str) -> None:
    """Constructed: one row's time is NULL, REAL, TEXT or a BLOB. NULL worked; REAL and TEXT
    refused the export as corrupt (with a Rust panic), TEXT and BLOB starts were an internal
    ValueError. The row is left out, and said so; the verdict stays."""
    report = analysed(edited(tmp_path, *ODD_TIMES[case]))
    table = "api" if "CUDA call" in case else "kernels"
    assert report["capture"]["unusable_rows"] == {f"{table}.no_time": 1}
    assert report["classification"]["bound"] == "host"


def test_whole_numbers_stored_as_real_are_read_as_the_integers(tmp_path: Path) -> None:
    """Constructed: the kernel table rebuilt with REAL start and end columns holding whole
    numbers, as pandas writes a table back. Each row was left out as having no time, and the
    export refused; now they are the integers, and the report is the export's own."""
    path = copy_export(fixture_trace(TINY), tmp_path / "run.sqlite")
    with sqlite3.connect(path) as con:
        table = "CUPTI_ACTIVITY_KIND_KERNEL"
        names = [row[1] for row in con.execute(f"PRAGMA table_info({table})")]
        typed = ", ".join(f'"{n}" REAL' if n in ("start", "end") else f'"{n}"' for n in names)
        con.execute(f"CREATE TABLE k ({typed})")
        con.execute(f"INSERT INTO k SELECT * FROM {table}")
        con.execute(f"DROP TABLE {table}")
        con.execute(f"ALTER TABLE k RENAME TO {table}")
        (kind,) = con.execute(f"SELECT DISTINCT typeof(start) FROM {table}").fetchone()
    con.close()
    assert kind == "real"
    report, original = analysed(path), analysed(fixture_trace(TINY))
    assert report["capture"]["unusable_rows"] == {}
    assert report["metrics"] == original["metrics"]


def test_profiler_overhead_rows_without_a_time_are_left_out(tmp_path: Path) -> None:
    """Constructed: one row of nsys's own work (PROFILER_OVERHEAD) with its end NULL. Those
    rows alone were not checked as every timed table's are: on the public export where a
    fuzzing run found it, the NULL became a garbage time and host attribution's interval
    arithmetic an internal ValueError. Left out and counted like the rest; the verdict stays."""
    first = "rowid = (SELECT min(rowid) FROM PROFILER_OVERHEAD)"
    report = analysed(
        edited(
            tmp_path,
            "CREATE TABLE o AS SELECT * FROM PROFILER_OVERHEAD",
            "DROP TABLE PROFILER_OVERHEAD",
            "ALTER TABLE o RENAME TO PROFILER_OVERHEAD",
            f'UPDATE PROFILER_OVERHEAD SET "end" = NULL WHERE {first}',
        )
    )
    assert report["capture"]["unusable_rows"] == {"overhead.no_time": 1}
    assert report["classification"]["bound"] == "host"


def test_a_graph_replay_without_a_correlation_id_beside_collectives(tmp_path: Path) -> None:
    """Constructed: a CUDA-graph export whose kernels are all named as NCCL's, one graph
    replay's correlationId NULL. That one null made the critical path's correlationIds floats,
    and the join with the collectives' ids an internal SchemaError (a fuzzing run)."""
    report = analysed(
        edited(
            tmp_path,
            "UPDATE StringIds SET value = 'ncclKernel_AllToAll' "
            "WHERE id IN (SELECT demangledName FROM CUPTI_ACTIVITY_KIND_KERNEL)",
            "CREATE TABLE g AS SELECT * FROM CUPTI_ACTIVITY_KIND_GRAPH_TRACE",
            "DROP TABLE CUPTI_ACTIVITY_KIND_GRAPH_TRACE",
            "ALTER TABLE g RENAME TO CUPTI_ACTIVITY_KIND_GRAPH_TRACE",
            "UPDATE CUPTI_ACTIVITY_KIND_GRAPH_TRACE SET correlationId = NULL WHERE rowid = 7",
            source="h100_host_cudagraph",
        )
    )
    assert report["classification"]["bound"] in {"memory", "communication", "host", "compute"}


def test_a_rank_of_copies_alone_is_analysed_without_a_warning(tmp_path: Path) -> None:
    """Constructed: one rank of h100_comm_ep2 without its kernels (copies only). Its device,
    unknown, was compared with the device map's: polars warned on stderr that a comparison
    with None is always null (a fuzzing run)."""
    kernels = "CUPTI_ACTIVITY_KIND_KERNEL"
    path = edited(
        tmp_path,
        f"DELETE FROM {kernels} WHERE globalPid = (SELECT min(globalPid) FROM {kernels})",
        source="h100_comm_ep2",
    )
    result = child("analyze", path, "-f", "json", "--no-cache")  # (not -q: warnings shown)
    assert result.code == 0 and "Warning" not in result.stderr, result.stderr


def test_gpu_rows_all_before_the_capture_are_damage_not_an_idle_process(tmp_path: Path) -> None:
    """Constructed: every kernel, copy and memset of the capture 10,000 s before its start (a
    rank file whose clock was shifted, a fuzzing run). With every row left out no process had
    GPU work, and the file was called one whose rows "name no process" (among several files:
    left out with a warning, as a launcher's export); now the rows left out and why."""
    shifted = [
        f'UPDATE {t} SET start = start - 10000000000000, "end" = "end" - 10000000000000'
        for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
                  "CUPTI_ACTIVITY_KIND_MEMSET")
    ]  # fmt: skip
    result = child("analyze", edited(tmp_path, *shifted), "-q", "--no-cache")
    one_line_error(result, "run.sqlite", "no usable kernel row", "implausible time")


def test_rows_unusable_for_several_reasons_count_once(tmp_path: Path) -> None:
    """Constructed: 64 kernels with start and end negated (an end before the start, and
    times no capture has). Each was counted under both reasons (128 for 64 rows dropped);
    now under the first it has."""
    report = analysed(
        edited(
            tmp_path,
            'UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = -start, "end" = -"end" '
            "WHERE rowid <= 64",
        )
    )
    assert report["capture"]["unusable_rows"] == {"kernels.end_before_start": 64}


def test_nvtx_ranges_never_closed_are_counted(tmp_path: Path) -> None:
    """Constructed: every other NVTX range's end NULL (as a range still open when the capture
    stopped has). They were left out without a word, though the step ranges among them
    merged two steps into one; now the report counts them (``nvtx.no_end``)."""
    path = edited(tmp_path, 'UPDATE NVTX_EVENTS SET "end" = NULL WHERE rowid % 2 = 0')
    with sqlite3.connect(path) as con:
        (open_ranges,) = con.execute(
            'SELECT count(*) FROM NVTX_EVENTS WHERE "end" IS NULL AND eventType IN (59, 60)'
        ).fetchone()
    report = analysed(path)
    assert open_ranges > 0
    assert report["capture"]["unusable_rows"] == {"nvtx.no_end": open_ranges}


def test_an_export_whose_kernel_rows_are_all_unusable_says_so(tmp_path: Path) -> None:
    """Constructed: every kernel ends before it starts. The run was refused as one where
    "no kernel ran (only 140 memcpy/memset rows)"; now the rows left out, and why."""
    path = edited(tmp_path, 'UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET "end" = start - 5')
    with sqlite3.connect(path) as con:
        (kernels,) = con.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()
    result = run_cli("analyze", path, "-q", "--no-cache")
    assert result.code == 2 and len(result.stderr.splitlines()) == 1
    assert f"no usable kernel row in this capture ({kernels} left out: end before start: " in (
        result.stderr
    )


def test_a_kernel_spanning_every_time_is_left_out(tmp_path: Path) -> None:
    """Constructed: one kernel from -2^63 to 2^63-1. It covered every step: the host-bound
    trace (0.92) read compute-bound (0.95)."""
    report = analysed(
        edited(
            tmp_path,
            "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = -9223372036854775808, "
            f'"end" = 9223372036854775807 WHERE {FIRST_KERNEL}',
        )
    )
    assert report["capture"]["unusable_rows"] == {"kernels.implausible_time": 1}
    assert report["classification"]["bound"] == "host"


def test_an_allocation_of_2_to_the_62_bytes_is_left_out(tmp_path: Path) -> None:
    """Constructed: one memory event of 2^62 bytes put peak_memory_frac at 5.4e7."""
    plain = analysed(fixture_trace(TINY))["metrics"]["peak_memory_frac"]
    report = analysed(
        edited(
            tmp_path,
            "UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET bytes = 4611686018427387904 "
            "WHERE rowid = (SELECT min(rowid) FROM CUDA_GPU_MEMORY_USAGE_EVENTS)",
        )
    )
    assert report["capture"]["unusable_rows"] == {"memory.implausible_bytes": 1}
    assert 0 < report["metrics"]["peak_memory_frac"] <= plain


def test_zero_length_kernels_give_valid_json(tmp_path: Path) -> None:
    """Constructed: every kernel ends where it starts. The report held NaN, which is not JSON."""
    report = analysed(edited(tmp_path, 'UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET "end" = start'))
    assert report["report_version"] == 2


def test_nvtx_text_that_is_not_utf8_prints_no_panic(tmp_path: Path) -> None:
    """Constructed: an NVTX label with a byte that is not UTF-8 printed a 4-line connectorx
    panic (and failed the export); now it is read with U+FFFD."""
    path = edited(tmp_path)
    con = sqlite3.connect(path)
    con.execute(
        "UPDATE NVTX_EVENTS SET text = CAST(? AS TEXT) WHERE text LIKE 'batch %'", (b"batch\xff",)
    )
    con.commit()
    con.close()
    report = analysed(path)
    assert report["capture"]["repaired_strings"]["NVTX_EVENTS.text"] >= 1


def test_a_file_truncated_while_it_is_read_is_one_line(tmp_path: Path) -> None:
    """Constructed: the export is cut to its first pages while the loader reads it (simulated
    by truncating it just before the read of the kernel table). It printed a connectorx
    panic; the message says the file changed, not that it is corrupt."""
    script = tmp_path / "cut.py"
    export = copy_export(fixture_trace(TINY), tmp_path / "run.sqlite")
    script.write_text(
        "import os, sys\n"
        "from traceclf.ingest import load\n"
        "read = load.Reader.read\n"
        "def cut(self, logical, *a, **k):\n"
        "    if logical == 'kernels':\n"
        f"        os.truncate({str(export)!r}, 8192)\n"
        "    return read(self, logical, *a, **k)\n"
        "load.Reader.read = cut\n"
        "from traceclf.cli import main\n"
        f"sys.argv = ['traceclf', 'analyze', {str(export)!r}, '-q', '--no-cache']\n"
        "main()\n"
    )
    import sys

    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
    )
    result = CliResult(done.returncode, done.stdout, done.stderr)
    one_line_error(result, "run.sqlite", "changed while traceclf read it")


def test_an_export_being_written_is_said_to_be_so(tmp_path: Path) -> None:
    """Constructed: an export that a writer is still growing (its first half, then more bytes
    every 20 ms while traceclf looks at it). It was called a truncated or corrupt database."""
    data = fixture_trace(TINY).read_bytes()
    export = tmp_path / "run.sqlite"
    export.write_bytes(data[: len(data) // 2])
    stop = threading.Event()

    def grow() -> None:
        with export.open("ab") as f:
            for offset in range(len(data) // 2, len(data), 4096):
                if stop.wait(0.02):
                    return
                f.write(data[offset : offset + 4096])
                f.flush()

    writer = threading.Thread(target=grow, daemon=True)
    writer.start()
    try:
        time.sleep(0.05)
        result = run_cli("analyze", export, "-q", "--no-cache")
    finally:
        stop.set()
        writer.join()
    one_line_error(result, "run.sqlite", "still being written")


def test_an_unforeseen_failure_names_its_file(tmp_path: Path) -> None:
    """CONSTRUCTED (an adversarial review's case): StringIds rebuilt by a tool without column
    types, its ids made text. What no check foresees still ends in one line and exit 2, and
    now names the export, among others that are fine: the run failed as "internal error"
    without saying which file."""
    bad = edited(
        tmp_path,
        "CREATE TABLE s AS SELECT * FROM StringIds",
        "DROP TABLE StringIds",
        'CREATE TABLE StringIds ("id", "value")',
        "INSERT INTO StringIds SELECT 's' || id, value FROM s",
        "DROP TABLE s",
        name="bad.sqlite",
    )
    good = copy_export(fixture_trace(TINY), tmp_path / "good.sqlite")
    result = child("analyze", good, bad, "-f", "json", "-q", "--no-cache", "--runs")
    assert result.code == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"traceclf: error: {bad}: internal error: "), line


@pytest.mark.parametrize("size", [-5, 0, 2**62])
def test_a_gpu_size_no_gpu_has_is_unknown(tmp_path: Path, size: int) -> None:
    """CONSTRUCTED: the GPU's SM count and memory set to a size no GPU has. -5 SMs and -1 bytes
    were echoed, and the report said "peak device memory -80789367500% of capacity"; now they
    are unknown, as a missing table's are, and what they scale is null."""
    path = edited(tmp_path, f"UPDATE TARGET_INFO_GPU SET smCount = {size}, totalMemory = {size}")
    report = analysed(path)
    (gpu,) = report["gpus"]
    assert gpu["sm_count"] is None and gpu["memory_bytes"] is None
    assert report["metrics"]["peak_memory_frac"] is None
    assert report["metrics"]["small_grid_kernel_frac"] is None
    assert (
        report["classification"]["bound"]
        == analysed(fixture_trace(TINY))["classification"]["bound"]
    )


@pytest.mark.parametrize("value", [5000, 9223372036854775807, -1e9])
def test_gpu_metric_samples_outside_a_percentage_are_left_out(tmp_path: Path, value) -> None:
    """CONSTRUCTED: every sample of the metrics read set to a value no percentage has. 5000 was
    averaged into "SMs active 5000%" in the evidence (sm_active_mean 50.0); now such samples
    are left out as negative ones were, and no mean is made of none."""
    path = edited(tmp_path, f"UPDATE GPU_METRICS SET value = {value}", source=METRICS)
    metrics = analysed(path)["metrics"]
    assert metrics["sm_active_mean"] is None and metrics["tensor_active_mean"] is None
