"""Hostile and odd input ends in a bounded, one-line answer (issue 13).

- rule files cannot exhaust the machine: alias bombs, huge format widths, exploding
  arithmetic, catastrophic regexes, FIFOs, deep nesting, huge integers, non-text keys and big
  files fail at load time with one line naming the file (and the rule), or stay cheap (item 5);
- exports that are being written (a WAL with committed pages, a hot journal) are refused
  clearly, and a view named like a CUPTI table is read like the table (item 9);
- what used to crash (missing kernel names, non-UTF-8 file names, malformed saved reports,
  an nsys that writes garbage) gives a report or one line (item 11);
- messages: unusable Dask addresses, unreadable folders, bad -o targets, usage errors, odd
  file names, symlink loops, --nsys ./nsys, reports named like options, thresholds that would
  disable the CI gate, and the JSON key order of the GPU-metric series (item 12);
- figures stay small for long runs and rule files are read once (item 13).

Every hostile file here is constructed inside the test (a copy of a small real export edited
with sqlite3, or a few lines of YAML). Cases that hung or exhausted memory before the fix run
in a child process under a memory limit and a timeout, so a regression fails instead of taking
the test run down with it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import fixture_trace
from helpers.cli import CliResult, run_cli, run_cli_process
from helpers.fake_nsys import write_fake_nsys, write_fake_report
from helpers.files import copy_export, file_state

TINY = "h100_host_input_stall"
GPU_METRICS_TRACE = "h100_comm_a2a_gpumetrics"
CHILD_MEMORY = 1536 << 20  # enough for `traceclf rules`; a bomb needs many times more
CHILD_TIMEOUT_S = 120  # a safety net against hangs, not a speed assertion


def tiny_copy(folder: Path, name: str = "run.sqlite") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return copy_export(fixture_trace(TINY), folder / name)


def assert_one_line_error(result: CliResult, *needles: str) -> None:
    assert result.code == 2, (result.code, result.stdout[-500:], result.stderr)
    assert len(result.stderr_lines) == 1, result.stderr
    assert result.stderr.startswith("traceclf: error: "), result.stderr
    assert "internal error" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def run_child(*args: str | Path, memory: int | None = CHILD_MEMORY) -> CliResult:
    """``traceclf ARGS`` in a child process with its address space capped at ``memory``; a
    child still running after CHILD_TIMEOUT_S fails the test."""
    try:
        return run_cli_process(*args, timeout=CHILD_TIMEOUT_S, memory=memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"traceclf {' '.join(map(str, args))} still ran after {CHILD_TIMEOUT_S} s")


# -- item 5: rule files that would exhaust the machine -------------------------------------------


def alias_bomb() -> str:
    """Nine levels of ten aliases: 10**9 strings once expanded (the "billion laughs")."""
    levels = ["fixes:", "  - &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join([*levels, "definitions:", "  boom: *a8", ""])


def rule_with(field: str, value: str) -> str:
    fields = {"id": "bomb", "wall": "host", "when": "True", "score": "0.1", "evidence": "x"}
    fields[field] = value
    return "rules:\n  - " + "\n    ".join(f"{k}: {v}" for k, v in fields.items()) + "\n"


BOMBS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "alias bomb": (lambda d: (d / "a.yaml").write_text(alias_bomb()), ("a.yaml", "alias")),
    "format precision": (
        lambda d: (d / "a.yaml").write_text(
            rule_with("evidence", "'{gpu_busy_frac:.1000000000f}'")
        ),
        ("a.yaml", "rule 'bomb'", "format"),
    ),
    "format width": (
        lambda d: (d / "a.yaml").write_text(rule_with("evidence", "'{gpu_busy_frac:>1000000000}'")),
        ("a.yaml", "rule 'bomb'", "format"),
    ),
    "990 unary minus signs": (
        lambda d: (d / "a.yaml").write_text(f"definitions:\n  u: '{'-' * 990}1'\n"),
        ("a.yaml", "definition 'u'", "nested"),
    ),
    "5000-deep YAML": (
        lambda d: (d / "a.yaml").write_text(f"definitions: {'[' * 5000}{']' * 5000}\n"),
        ("a.yaml", "nested"),
    ),
    "5000-digit integer": (
        lambda d: (d / "a.yaml").write_text(f"scoring:\n  meaningful: {'1' * 5000}\n"),
        ("a.yaml",),
    ),
    "non-text keys in a scoring map": (
        lambda d: (d / "a.yaml").write_text(
            "scoring:\n  time_share: {1: gpu_busy_frac, memory: 0, communication: 0, host: 0, "
            "compute: 0}\n"
        ),
        ("a.yaml", "text"),
    ),
    "FIFO as a rule file": (lambda d: os.mkfifo(d / "a.yaml"), ("a.yaml", "not a regular file")),
    "symlink to /dev/zero": (
        lambda d: (d / "a.yaml").symlink_to("/dev/zero"),
        ("a.yaml", "not a regular file"),
    ),
    "2 MB rule file": (
        lambda d: (d / "a.yaml").write_text("# padding\n" * 210_000 + "definitions: {}\n"),
        ("a.yaml", "MiB"),
    ),
}


@pytest.mark.parametrize("case", BOMBS)
def test_rule_file_bombs_fail_at_load_time_with_one_line(tmp_path: Path, case: str) -> None:
    make, needles = BOMBS[case]
    rules = tmp_path / "rules"
    rules.mkdir()
    make(rules)
    assert_one_line_error(run_child("rules", "--rules", rules), *needles)


def test_exploding_arithmetic_in_definitions_stays_cheap(tmp_path: Path) -> None:
    """Forty definitions that each square the one before: 3**(2**40) as an integer."""
    rules = tmp_path / "rules"
    rules.mkdir()
    squares = [f"  d{i}: d{i - 1} * d{i - 1}" for i in range(1, 41)]
    (rules / "a.yaml").write_text("\n".join(["definitions:", "  d0: 3", *squares, ""]))
    result = run_child(
        "analyze", tiny_copy(tmp_path / "run"), "--rules", rules, "-q", "--no-cache", memory=None
    )
    assert result.code == 0, result.stderr
    assert "HOST-bound" in result.stdout


def test_catastrophic_regex_in_gpu_families_stays_cheap(tmp_path: Path) -> None:
    """Backtracking engines take hours on this pattern and the real GPU name
    "NVIDIA H100 80GB HBM3 GH100"; a linear-time engine (or a refusal) does not."""
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "a.yaml").write_text(
        "gpu_families:\n  - family: slow\n    match: '^([A-Z0-9]+|[A-Z0-9 ]+)*!'\n"
    )
    result = run_child(
        "analyze", tiny_copy(tmp_path / "run"), "--rules", rules, "-q", "--no-cache", memory=None
    )
    assert result.code in (0, 2), result.stderr
    if result.code == 2:
        assert_one_line_error(result, "a.yaml", "gpu family 'slow'")


# -- item 9: exports being written, views ---------------------------------------------------------


def kernel_count(path: Path) -> int:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
        return con.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]


def test_wal_export_with_committed_changes_is_refused_not_read_stale(tmp_path: Path) -> None:
    """Constructed: a WAL-mode export whose last commit (half the kernels deleted) is still
    in run.sqlite-wal, copied while the writer is open (as a crash or a copy would leave it).
    Read with immutable=1 the export looked untouched."""
    work = tiny_copy(tmp_path / "writer")
    con = sqlite3.connect(work)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE rowid % 2 = 0")
    con.commit()
    (tmp_path / "run").mkdir()
    export = tmp_path / "run" / "run.sqlite"
    export.write_bytes(work.read_bytes())
    Path(f"{export}-wal").write_bytes(Path(f"{work}-wal").read_bytes())
    con.close()
    states = file_state(export), file_state(Path(f"{export}-wal"))
    result = run_cli("analyze", export, "-q", "--no-cache")
    assert_one_line_error(result, "run.sqlite", "-wal")
    assert "corrupt" not in result.stderr
    assert (file_state(export), file_state(Path(f"{export}-wal"))) == states


def test_hot_journal_is_reported_as_being_written_not_as_corrupt(tmp_path: Path) -> None:
    """Constructed: an export copied in the middle of a write transaction, with its hot
    rollback journal beside it."""
    work = tiny_copy(tmp_path / "writer")
    con = sqlite3.connect(work, isolation_level=None)
    con.execute("PRAGMA cache_size=1")  # spill the changed pages into the file
    con.execute("BEGIN")
    con.execute("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL")
    con.execute("UPDATE StringIds SET value = value || 'padding padding padding padding'")
    (tmp_path / "run").mkdir()
    export = tmp_path / "run" / "run.sqlite"
    export.write_bytes(work.read_bytes())
    Path(f"{export}-journal").write_bytes(Path(f"{work}-journal").read_bytes())
    con.execute("ROLLBACK")
    con.close()
    result = run_cli("analyze", export, "-q", "--no-cache")
    assert_one_line_error(result, "run.sqlite", "-journal")
    assert "corrupt" not in result.stderr


def test_view_named_like_a_cupti_table_is_refused_not_ignored(tmp_path: Path) -> None:
    """Constructed: the kernel table renamed and a view of it under the CUPTI name. It used to
    be skipped silently (zero kernels, a confident verdict); reading it would run SQL stored
    in the file (a recursive view never ends), so it is refused by name."""
    viewed = tiny_copy(tmp_path / "viewed")
    with sqlite3.connect(viewed) as con:
        con.execute("ALTER TABLE CUPTI_ACTIVITY_KIND_KERNEL RENAME TO KERNEL_ROWS")
        con.execute("CREATE VIEW CUPTI_ACTIVITY_KIND_KERNEL AS SELECT * FROM KERNEL_ROWS")
    con.close()
    result = run_cli("analyze", viewed, "-q", "--no-cache")
    assert_one_line_error(result, "run.sqlite", "CUPTI_ACTIVITY_KIND_KERNEL is a view")


# -- item 11: what used to crash ------------------------------------------------------------------


def without_string_table(path: Path) -> None:
    with sqlite3.connect(path) as con:
        con.execute("DROP TABLE StringIds")
    con.close()


def with_dangling_name_ids(path: Path) -> None:
    with sqlite3.connect(path) as con:
        con.execute(
            "DELETE FROM StringIds WHERE id IN (SELECT shortName FROM CUPTI_ACTIVITY_KIND_KERNEL "
            "UNION SELECT demangledName FROM CUPTI_ACTIVITY_KIND_KERNEL)"
        )
    con.close()


def loosened(path: Path, table: str, change: str) -> None:
    """``table`` rebuilt without its NOT NULL constraints (CREATE TABLE AS keeps none), then
    ``UPDATE table SET change`` run on it."""
    with sqlite3.connect(path) as con:
        con.execute(f"CREATE TABLE loose AS SELECT * FROM {table}")
        con.execute(f"UPDATE loose SET {change}")
        con.execute(f"DROP TABLE {table}")
        con.execute(f"ALTER TABLE loose RENAME TO {table}")
    con.close()


def with_null_name_ids(path: Path) -> None:
    """The kernel table rebuilt without its NOT NULL constraints, every name id NULL."""
    loosened(
        path,
        "CUPTI_ACTIVITY_KIND_KERNEL",
        "shortName = NULL, demangledName = NULL, mangledName = NULL",
    )


NAMELESS = {
    "StringIds dropped": without_string_table,
    "name ids deleted from StringIds": with_dangling_name_ids,
    "NULL name ids": with_null_name_ids,
}


@pytest.mark.parametrize("case", NAMELESS)
def test_kernels_without_names_render_in_every_format(tmp_path: Path, case: str) -> None:
    export = tiny_copy(tmp_path / "run")
    NAMELESS[case](export)
    for fmt in ("terminal", "md", "html"):
        output = tmp_path / f"report.{fmt}"
        result = run_cli("analyze", export, "-f", fmt, "-o", output, "-q", "--no-cache")
        assert result.code == 0, (fmt, result.stderr)
        assert "unknown kernel" in output.read_text(), fmt


@pytest.mark.parametrize("value", ["NULL", "'abc'"])
def test_cuda_calls_without_correlation_ids_are_analysed(tmp_path: Path, value: str) -> None:
    """Constructed (the input-stall trace, its CUDA calls' correlationIds emptied or made
    text; no real export lacks them): no kernel can be tied to its launch call, so steps come
    from a recurring kernel and the launch-starved split is unknown, not 0 (at 0 it had capped
    the input-bound score: 'MEMORY-bound, confidence 0.02'); the verdict stays host (input),
    as on the whole trace. It had been 'internal error: TypeError'."""
    export = tiny_copy(tmp_path / "run")
    loosened(export, "CUPTI_ACTIVITY_KIND_RUNTIME", f"correlationId = {value}")
    result = run_cli("analyze", export, "-f", "json", "-q", "--no-cache")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["classification"]["bound"] == "host"
    assert report["metrics"]["launch_starved_frac"] is None
    assert report["metrics"]["idle_input_frac"] > 0.9


def test_deeply_nested_nvtx_ranges_cost_what_their_rows_cost(tmp_path: Path) -> None:
    """Constructed: 100,000 NVTX ranges nested over the input-stall trace's whole span, in a
    child capped at 3 GiB of address space. Naming the range each of the longest gaps was in
    had joined every gap with every range open at its middle (gaps × depth rows: 6 GB at
    200,000); the innermost is found per gap now, and it is the deepest range."""
    export = tiny_copy(tmp_path / "run")
    depth = 100_000
    with sqlite3.connect(export) as con:
        (tid, lo, hi) = con.execute(
            "SELECT globalTid, min(start), max(end) FROM NVTX_EVENTS WHERE end IS NOT NULL"
        ).fetchone()
        con.executemany(
            "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, domainId) "
            "VALUES (?, ?, 59, ?, ?, 0)",
            ((lo - depth + i, hi + depth - i, f"level {i}", tid) for i in range(depth)),
        )
    con.close()
    result = run_child("analyze", export, "-f", "json", "-q", "--no-cache", memory=3 << 30)
    assert result.code == 0, result.stderr
    gaps = json.loads(result.stdout)["series"][0]["longest_gaps"]
    assert gaps and {g["nvtx"] for g in gaps} == {f"level {depth - 1}"}


def test_an_export_naming_more_processes_than_a_node_runs_is_one_line(tmp_path: Path) -> None:
    """Constructed: the input-stall trace's kernels copied over 1,100 processes (its rows
    name them; one kernel each). Each rank costs ~60 ms however little it ran: 50,000 had
    not finished in 300 s."""
    export = tiny_copy(tmp_path / "run")
    with sqlite3.connect(export) as con:
        columns = [r[1] for r in con.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)")]
        others = ", ".join(c for c in columns if c != "globalPid")
        con.execute(
            f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL ({others}, globalPid) "
            f"SELECT {others}, (1000 + n.value) << 24 FROM CUPTI_ACTIVITY_KIND_KERNEL, "
            "(WITH RECURSIVE n(value) AS (SELECT 0 UNION ALL SELECT value + 1 FROM n "
            "WHERE value < 3) SELECT value FROM n) AS n"
        )
        con.execute(
            "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET globalPid = (5000 + rowid) << 24 "
            "WHERE rowid <= 1100"
        )
    con.close()
    result = run_child("analyze", export, "-q", "--no-cache", memory=None)
    assert_one_line_error(result, "processes ran GPU work", "more than 1,024")


@pytest.mark.parametrize(
    ("change", "reason"),
    [("start = 'soon'", "nvtx.no_time"), ("end = start - 1", "nvtx.end_before_start")],
)
def test_nvtx_ranges_without_a_usable_time_are_counted(
    tmp_path: Path, change: str, reason: str
) -> None:
    """Constructed (the input-stall trace's NVTX table rebuilt without its NOT NULL
    constraints): ranges with a text start or an end before their start were dropped without
    a word, the steps found another way; like every other table's, they are counted."""
    export = tiny_copy(tmp_path / "run")
    with sqlite3.connect(export) as con:
        (ranges,) = con.execute("SELECT count(*) FROM NVTX_EVENTS WHERE end IS NOT NULL").fetchone()
    con.close()
    loosened(export, "NVTX_EVENTS", f"{change} WHERE end IS NOT NULL")
    result = run_cli("analyze", export, "-f", "json", "-q", "--no-cache")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["capture"]["unusable_rows"] == {reason: ranges}


def test_copies_of_a_size_no_copy_has_are_counted_not_summed(tmp_path: Path) -> None:
    """Constructed (the memcpy table rebuilt, every size -100): negative bytes per step had
    reached the report; the sizes are unknown, counted, and the copies' time still counts."""
    export = tiny_copy(tmp_path / "run")
    with sqlite3.connect(export) as con:
        (copies,) = con.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY").fetchone()
    con.close()
    loosened(export, "CUPTI_ACTIVITY_KIND_MEMCPY", "bytes = -100")
    result = run_cli("analyze", export, "-f", "json", "-q", "--no-cache")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["capture"]["unusable_rows"] == {"memcpy.implausible_bytes": copies}
    m = report["metrics"]
    assert all(v >= 0 for k, v in m.items() if "bytes" in k and isinstance(v, float | int))
    assert m["copy_frac"] > 0


def test_non_utf8_file_name_is_analysed(tmp_path: Path) -> None:
    """A file name that is not UTF-8 is reported with its byte written out (``\\xff``) in
    every format, the per-rank tables (CSV, --export-dir) and valid JSON included: polars and
    JSON cannot hold the lone surrogate Python keeps for the byte."""
    folder = tmp_path / "run"
    folder.mkdir()
    name = os.fsdecode(b"rank\xff.sqlite")
    copy_export(fixture_trace(TINY), folder / name)
    result = run_cli_process("analyze", folder / name, "-q", "--no-cache")
    assert result.code == 0, result.stderr
    assert "HOST-bound" in result.stdout
    shown = "rank\\xff.sqlite"
    for fmt in ("csv", "json", "md"):
        result = run_cli_process("analyze", folder / name, "-q", "--no-cache", "-f", fmt)
        assert result.code == 0, (fmt, result.stderr)
        assert shown in result.stdout.replace("\\\\", "\\"), fmt
    report = json.loads(
        run_cli_process("analyze", folder / name, "-q", "--no-cache", "-f", "json").stdout
    )
    assert report["ranks"][0]["file"].endswith(shown)
    tables = tmp_path / "tables"
    result = run_cli_process(
        "analyze", folder / name, "-q", "--no-cache", "--export-dir", tables, "-f", "json"
    )
    assert result.code == 0, result.stderr
    assert shown in (tables / "ranks.csv").read_text()


def test_names_of_a_megabyte_cost_what_a_long_name_costs(tmp_path: Path) -> None:
    """Constructed: four kernel names, the GPU's name and NVTX ranges' text of 1 MB each
    (markup, newlines, escapes). Each was kept whole in every row that repeats it: a 411 MB
    JSON report from a 14 MB export. Now any text over MAX_TEXT characters is cut there, with
    a mark saying how long it was."""
    from traceclf.ingest.utf8 import MAX_TEXT

    export = tiny_copy(tmp_path / "run")
    big = '<&|`"\n\x1b' * 150_000  # (1.05 M characters)
    with sqlite3.connect(export) as con:
        ids = [i for (i,) in con.execute(
            "SELECT DISTINCT demangledName FROM CUPTI_ACTIVITY_KIND_KERNEL LIMIT 4")]  # fmt: skip
        con.executemany(
            "UPDATE StringIds SET value = ? WHERE id = ?", [("K" + big, i) for i in ids]
        )
        con.execute(
            "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, domainId) "
            "SELECT start + 1000, end - 1000, eventType, ?, globalTid, domainId FROM NVTX_EVENTS "
            "WHERE end IS NOT NULL",
            ("N" + big,),
        )
        con.execute("UPDATE TARGET_INFO_GPU SET name = ?", ("G" + big,))
    result = run_cli("analyze", export, "-f", "json", "-q", "--no-cache")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    assert len(result.stdout) < 10_000_000
    names = [k["name"] for k in report["ranks"][0]["top_kernels"]]
    cut = [n for n in names if n.startswith("K")]
    assert cut and all(len(n) <= MAX_TEXT + 30 for n in cut)
    mark = f"… ({len(big) + 1} characters)"
    assert all(n.endswith(mark) for n in cut)
    assert report["gpus"][0]["name"].endswith(mark)


def saved_report(folder: Path) -> Path:
    path = folder / "before.json"
    result = run_cli(
        "analyze", tiny_copy(folder / "run"), "-f", "json", "-o", path, "-q", "--no-cache"
    )
    assert result.code == 0, result.stderr
    return path


def edited(source: Path, path: Path, change: Callable[[dict], object]) -> Path:
    """Constructed: a saved report edited by hand or by a broken producer."""
    data = json.loads(source.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


MALFORMED_REPORTS: dict[str, Callable[[dict], object]] = {
    "steps is a list": lambda d: d.update(steps=[1, 2, 3]),
    "mean_ms is a string": lambda d: d["steps"].update(mean_ms="371.2"),
    "mean_ms is NaN": lambda d: d["steps"].update(mean_ms=math.nan),
    "cv is infinite": lambda d: d["steps"].update(cv=math.inf),
    "classification is a list": lambda d: d.update(classification=["host"]),
    "gpus hold a string": lambda d: d.update(gpus=["H100"]),
    "metrics hold text": lambda d: d.update(metrics="fast"),
    # step times no run can have (under nsys's 1 ns): an "improvement" from a negative
    # baseline, a percentage of 300 digits from 1e-300 ms, before they were refused
    "step times are negative": lambda d: d["steps"].update(mean_ms=-5, median_ms=-5),
    "step times are zero": lambda d: d["steps"].update(mean_ms=0, median_ms=0),
    "step times are 1e-300 ms": lambda d: d["steps"].update(mean_ms=1e-300, median_ms=1e-300),
}


# A broken mean step time must make the verdict "inconclusive" (said so, in every format),
# never a silent "no significant change" (an infinite CV only loses the noise band).
GATE_CASES = (
    "steps is a list",
    "mean_ms is a string",
    "mean_ms is NaN",
    "step times are negative",
    "step times are zero",
    "step times are 1e-300 ms",
)


def test_compare_says_a_saved_report_is_of_a_newer_contract(tmp_path: Path) -> None:
    """Constructed: a saved report claiming report_version 99 was compared without a word."""
    before = saved_report(tmp_path)
    after = edited(before, tmp_path / "v99.json", lambda d: d.update(report_version=99))
    result = run_cli("compare", before, after, "-f", "json")
    assert result.code == 0, result.stderr
    notes = json.loads(result.stdout)["notes"]
    assert any("v99.json: report version 99, newer than this traceclf's (2)" in n for n in notes)
    same = json.loads(run_cli("compare", before, before, "-f", "json").stdout)["notes"]
    assert not any("newer" in n for n in same)


def test_compare_names_a_report_of_several_runs_as_such(tmp_path: Path) -> None:
    """A saved report of several runs (--runs) was refused as "not a traceclf report"."""
    before = saved_report(tmp_path)
    runs = tmp_path / "runs.json"
    made = run_cli("analyze", "--runs", before.parent / "run", fixture_trace("h100_comm_ep2"),
                   "-f", "json", "-o", runs, "-q", "--no-cache")  # fmt: skip
    assert made.code == 0, made.stderr
    result = run_cli("compare", before, runs)
    assert_one_line_error(result, "runs.json", "a report of 2 runs")


@pytest.mark.parametrize("case", [c for c in GATE_CASES if c.startswith("step times")])
def test_compare_refuses_a_baseline_with_a_step_time_no_run_can_have(
    tmp_path: Path, case: str
) -> None:
    """The baseline side too: inconclusive (exit 3), the report named in the one line."""
    after = saved_report(tmp_path)
    before = edited(after, tmp_path / "before-edited.json", MALFORMED_REPORTS[case])
    gate = run_cli("compare", before, after)
    assert gate.code == 3 and "before-edited.json" in gate.stderr, gate.stderr


@pytest.mark.parametrize("case", MALFORMED_REPORTS)
def test_compare_with_a_malformed_saved_report_neither_crashes_nor_passes_silently(
    tmp_path: Path, case: str
) -> None:
    before = saved_report(tmp_path)
    after = edited(before, tmp_path / "after.json", MALFORMED_REPORTS[case])
    for fmt in ("terminal", "md", "json"):
        # a comparison that cannot be made exits 3 with one line saying why (issue 24)
        gate = run_cli("compare", before, after, "-f", fmt)
        assert (gate.code, len(gate.stderr.splitlines())) in ((0, 0), (3, 1)), gate.stderr
        result = run_cli("compare", before, after, "-f", fmt, "--allow-inconclusive")
        assert result.code == 0 and result.stderr == "", (fmt, result.stderr)
        if fmt == "json" and case in GATE_CASES:
            assert json.loads(result.stdout)["verdict"] == "inconclusive"
            assert gate.code == 3


GARBAGE_NSYS = """#!{python}
import sys
args = sys.argv[1:]
out = args[args.index("--output") + 1]
with open(out, "w") as f:
    f.write("Export completed, but this is not a database\\n" * 10)
"""


def test_nsys_that_writes_something_else_than_sqlite_is_one_line(tmp_path: Path) -> None:
    nsys = tmp_path / "nsys"
    nsys.write_text(GARBAGE_NSYS.format(python=sys.executable))
    nsys.chmod(0o755)
    report = write_fake_report(tmp_path / "run.nsys-rep", fixture_trace(TINY))
    result = run_cli("analyze", report, "--nsys", nsys, "-q", "--no-cache")
    assert_one_line_error(result, "run.nsys-rep", "not an SQLite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nsys", "run.nsys-rep"]


# -- item 12: messages ------------------------------------------------------------------------------


@pytest.fixture
def fake_server() -> Iterator[Callable[[bytes | None], str]]:
    """``start(reply)``: a TCP server on 127.0.0.1 that answers every connection with
    ``reply`` and closes it, or (``None``) accepts and never answers; returns its address."""
    servers: list[socket.socket] = []

    def start(reply: bytes | None) -> str:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)
        held: list[socket.socket] = []

        def serve() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                if reply is None:
                    held.append(conn)
                    continue
                try:
                    conn.recv(65536)
                    conn.sendall(reply)
                finally:
                    conn.close()

        threading.Thread(target=serve, daemon=True).start()
        return f"tcp://127.0.0.1:{server.getsockname()[1]}"

    yield start
    for server in servers:
        server.close()


def closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


HTTP_REPLY = b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/html\r\n\r\n<html>bad</html>\r\n"


@pytest.mark.parametrize("server", ["HTTP server", "silent server", "closed port"])
def test_a_dask_address_without_a_scheduler_is_one_line_within_the_timeout(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_server: Callable[[bytes | None], str],
    server: str,
) -> None:
    pytest.importorskip("distributed")
    monkeypatch.setenv("TRACECLF_DASK_TIMEOUT", "1")
    address = {
        "HTTP server": lambda: fake_server(HTTP_REPLY),
        "silent server": lambda: fake_server(None),
        "closed port": closed_port,
    }[server]()
    result = run_child(
        "analyze", tiny_copy(tmp_path / "run"), "--dask", address, "-q", "--no-cache", memory=None
    )
    # Whatever answers (or does not), the message names the address and says how long it waited.
    assert_one_line_error(result, address, "Dask scheduler", "1 s")


def test_unreadable_folder_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ranks"
    tiny_copy(folder, "rank_0.sqlite")
    if os.geteuid() == 0:  # root reads any folder: make listing this one fail as it would
        real_listdir = os.listdir

        def listdir(path="."):
            if Path(path) == folder:
                raise PermissionError(13, "Permission denied", str(path))
            return real_listdir(path)

        monkeypatch.setattr(os, "listdir", listdir)
    folder.chmod(0o300)
    try:
        result = run_cli("analyze", folder, "-q", "--no-cache")
    finally:
        folder.chmod(0o755)
    assert_one_line_error(result, "ranks", "Permission denied")


def test_output_targets_that_cannot_be_written_are_one_line(tmp_path: Path) -> None:
    export = tiny_copy(tmp_path / "run")
    for output, needle in (("/proc/traceclf-report.json", "cannot write"), ("", "output")):
        result = run_cli("analyze", export, "-f", "json", "-o", output, "-q", "--no-cache")
        assert_one_line_error(result, needle)
    assert sorted(p.name for p in export.parent.iterdir()) == ["run.sqlite"]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_full_disk_on_output_is_one_line(tmp_path: Path) -> None:
    """A private copy of /dev/full: every write fails with ENOSPC."""
    export = tiny_copy(tmp_path / "run")
    full = tmp_path / "full"
    os.mknod(full, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    result = run_cli("analyze", export, "-f", "json", "-o", full, "-q", "--no-cache")
    assert_one_line_error(result, "No space left on device")
    assert stat.S_ISCHR(full.lstat().st_mode)
    # the files that go with the report stay unwritten: the device is written first (they
    # had been renamed into place before its write failed)
    tables, trace = tmp_path / "tables", tmp_path / "window.json"
    result = run_cli(
        "analyze", export, "-o", full, "-q", "--no-cache",
        "--export-dir", tables, "--export-trace", trace,
    )  # fmt: skip
    assert_one_line_error(result, "No space left on device")
    assert not tables.exists() and not trace.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
@pytest.mark.parametrize("args", [("analyze", "-q", "--no-cache"), ("rules",)])
def test_a_full_disk_on_standard_output_is_one_line(tmp_path: Path, args: tuple) -> None:
    """stdout redirected to a private copy of /dev/full: one line naming it, exit 2 (it had
    been 'internal error: OSError')."""
    export = tiny_copy(tmp_path / "run")
    full = tmp_path / "full"
    os.mknod(full, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    command = [
        sys.executable,
        "-m",
        "traceclf",
        args[0],
        *([export] if args[0] == "analyze" else []),
    ]
    with full.open("w") as stdout:
        done = subprocess.run(
            [*command, *args[1:]], stdout=stdout, stderr=subprocess.PIPE, text=True, check=False
        )
    assert_one_line_error(CliResult(done.returncode, "", done.stderr), "standard output")
    assert "No space left on device" in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("analyze", "x.sqlite", "--bogus"),
        ("analyze",),
        ("analyze", "x.sqlite", "-f", "pdf"),
        ("analyze", "x.sqlite", "--jobs", "0"),
        ("analyze", "x.sqlite", "--export-format", "parquet"),
        ("compare", "a.json"),
        ("nonsense",),
    ],
)
def test_usage_errors_are_one_line(args: tuple[str, ...]) -> None:
    result = run_cli(*args)
    assert_one_line_error(result)
    assert "--help" in result.stderr


def test_names_too_long_for_the_file_system_are_one_line(tmp_path: Path) -> None:
    long = tmp_path / ("x" * 300)
    result = run_cli("analyze", f"{long}.sqlite")
    assert_one_line_error(result, "File name too long")
    result = run_cli("analyze", fixture_trace(TINY), "-q", "--export-dir", long)
    assert_one_line_error(result, "--export-dir", "File name too long")


def test_file_names_are_echoed_with_their_control_characters_escaped(tmp_path: Path) -> None:
    name = tmp_path / "no\nsuch\x1b[2J\x07.sqlite"
    result = run_cli("analyze", name)
    assert_one_line_error(result)
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr


def test_symlink_loop_and_broken_link_are_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "a.sqlite").symlink_to(tmp_path / "b.sqlite")
    (tmp_path / "b.sqlite").symlink_to(tmp_path / "a.sqlite")
    (tmp_path / "dangling.sqlite").symlink_to(tmp_path / "gone.sqlite")
    assert_one_line_error(run_cli("analyze", tmp_path / "a.sqlite"), "a.sqlite", "loop")
    result = run_cli("analyze", tmp_path / "dangling.sqlite")
    assert_one_line_error(result, "dangling.sqlite", "broken symbolic link", "gone.sqlite")


def test_nsys_given_as_a_relative_path_is_that_file_not_one_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_fake_nsys(tmp_path / "nsys", tmp_path / "nsys.log")
    write_fake_report(tmp_path / "run.nsys-rep", fixture_trace(TINY))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    result = run_cli("analyze", "run.nsys-rep", "--nsys", "./nsys", "-q", "--no-cache")
    assert result.code == 0, result.stderr
    assert len((tmp_path / "nsys.log").read_text().splitlines()) == 1


STRICT_NSYS = """#!{python}
import shutil, sys
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(repr(args) + "\\n")
if args[:5] != ["export", "--type", "sqlite", "--output", args[4]] or len(args) != 6:
    sys.exit("usage: nsys export --type sqlite --output OUT REP")
if args[5].startswith("-"):
    sys.exit("unrecognised option " + args[5])
lines = open(args[5]).read().splitlines()
shutil.copyfile(lines[1], args[4])
"""


def test_report_named_like_an_option_reaches_nsys_as_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nsys, log = tmp_path / "nsys", tmp_path / "nsys.log"
    nsys.write_text(STRICT_NSYS.format(python=sys.executable, log=str(log)))
    nsys.chmod(0o755)
    write_fake_report(tmp_path / "-x.nsys-rep", fixture_trace(TINY))
    monkeypatch.chdir(tmp_path)
    result = run_cli("analyze", "--nsys", nsys, "-q", "--no-cache", "--", "-x.nsys-rep")
    assert result.code == 0, (result.stderr, log.read_text())


@pytest.mark.parametrize("threshold", ["nan", "inf", "-inf", "-0.1"])
def test_compare_threshold_that_would_disable_the_gate_is_refused(
    tmp_path: Path, threshold: str
) -> None:
    before = saved_report(tmp_path)
    assert_one_line_error(run_cli("compare", before, before, "--threshold", threshold), "threshold")


def test_gpu_metric_series_have_a_fixed_key_order(tmp_path: Path) -> None:
    export = copy_export(fixture_trace(GPU_METRICS_TRACE), tmp_path / "run.sqlite")
    result = run_cli("analyze", export, "-f", "json", "-q", "--no-cache")
    assert result.code == 0, result.stderr
    series = [s["gpu_metrics"] for s in json.loads(result.stdout)["series"]]
    assert any(series)
    for metrics in series:
        assert list(metrics) == sorted(metrics)


# -- item 13: resources -----------------------------------------------------------------------------


def test_step_timeline_of_thousands_of_steps_draws_a_bounded_number_of_bars(
    tmp_path: Path,
) -> None:
    from traceclf import api

    report = api.analyze(tiny_copy(tmp_path / "run"), use_cache=False)
    rows = report.series[0]["step_breakdown"]
    report.series[0]["step_breakdown"] = [rows[i % len(rows)] | {"index": i} for i in range(20_000)]
    figure = api.figures(report)["step_timeline"]
    bars = sum(len(ax.patches) for ax in figure.axes)
    assert bars <= 4 * 500, f"{bars} bars for 20,000 steps"


def test_rule_files_are_read_once_per_analysis(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    mine = rules / "mine.yaml"
    mine.write_text("definitions:\n  my_busy: gpu_busy_frac\n")
    opened: list[str] = []
    watching = [True]

    def hook(event: str, args: tuple) -> None:
        if watching[0] and event == "open" and args and str(args[0]) == str(mine):
            opened.append(event)

    sys.addaudithook(hook)  # cannot be removed: `watching` turns it off
    try:
        result = run_cli("analyze", tiny_copy(tmp_path / "run"), "--rules", rules, "-q")
    finally:
        watching[0] = False
    assert result.code == 0, result.stderr
    assert len(opened) == 1, f"{mine.name} opened {len(opened)} times"
