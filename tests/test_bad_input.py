"""Bad input of every kind ends in one clear line naming the file, exit code 2, and no change
to anything on disk: through the Python API and through ``traceclf analyze``."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import SMALL_TRACE, fixture_trace
from helpers.cli import CliResult, run_cli, run_cli_process
from helpers.fake_nsys import write_fake_nsys, write_fake_report
from helpers.files import (
    copy_export,
    corrupt_middle,
    drop_tables,
    file_state,
    folder_listing,
    garbled_header_page,
    plain_sqlite,
    truncated,
)

from traceclf.ingest.inputs import resolve_inputs
from traceclf.ingest.load import load_trace
from traceclf.ingest.schema import GPU_ACTIVITY_TABLES, META_TABLES, inspect_export
from traceclf.support.errors import TraceError


def real() -> Path:
    return fixture_trace(SMALL_TRACE)


def empty_folder(d: Path) -> Path:
    (d / "traces").mkdir()
    (d / "traces" / "notes.txt").write_text("profiles go here\n")
    return d / "traces"


def written(name: str, content: str | bytes) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        path = d / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    return make


def without_gpu_tables(d: Path) -> Path:
    return drop_tables(copy_export(real(), d / "cpu_only.sqlite"), GPU_ACTIVITY_TABLES)


def without_gpu_or_api_tables(d: Path) -> Path:
    """An export of a capture without CUDA tracing: no activity table at all."""
    path = copy_export(real(), d / "no_cuda.sqlite")
    with sqlite3.connect(path) as con:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    return drop_tables(path, [t for t in tables if t.startswith("CUPTI_ACTIVITY_KIND_")])


def set_up_calls_only(d: Path) -> Path:
    """What three public exports hold (a CUDA-Q tutorial, a cuBLASLt sample, a PyTorch run
    traced before its first kernel): CUDA calls that set up, none that issues GPU work."""
    path = without_gpu_tables(d)
    with sqlite3.connect(path) as con:
        con.execute(
            "DELETE FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE nameId NOT IN (SELECT id FROM "
            "StringIds WHERE value IN ('cuInit', 'cudaGetDeviceProperties_v12000'))"
        )
    return path


def graph_set_up_only(d: Path) -> Path:
    path = set_up_calls_only(d)
    with sqlite3.connect(path) as con:
        con.execute("UPDATE StringIds SET value = 'cudaGraphCreate_v10000' WHERE value = 'cuInit'")
    return path


def bare_nsys_tables(d: Path) -> Path:
    """What a public DynamicViT export holds (written by the nsys_cli wrapper of a capture
    that recorded nothing): nsys's string, thread and GPU tables, no metadata, no activity."""
    path = without_gpu_or_api_tables(d)
    return drop_tables(path, META_TABLES)


def fake_report(d: Path) -> Path:
    return write_fake_report(d / "run.nsys-rep", real())


@dataclass(frozen=True)
class Case:
    make: Callable[[Path], Path]  # builds the input inside the folder it is given
    problem: str  # what the one-line message must say
    nsys: str | None = None  # behaviour of the stand-in nsys; None: no nsys anywhere


CASES = {
    "missing path": Case(lambda d: d / "absent.sqlite", "no such file"),
    "folder without exports": Case(empty_folder, "no .sqlite or .nsys-rep"),
    "empty file": Case(written("empty.sqlite", b""), "empty file"),
    "text file": Case(written("notes.txt", "step 1 took 20 ms\n"), "neither an nsys report"),
    "text named .sqlite": Case(written("run.sqlite", "not a database\n"), "not an SQLite"),
    "truncated database": Case(lambda d: truncated(real(), d / "half.sqlite"), "truncated"),
    "corrupt pages": Case(lambda d: corrupt_middle(real(), d / "bad.sqlite"), "corrupt"),
    "garbled header page": Case(lambda d: garbled_header_page(real(), d / "hdr.sqlite"), "corrupt"),
    "SQLite but not nsys": Case(lambda d: plain_sqlite(d / "recipes.db"), "not an Nsight Systems"),
    "no GPU activity": Case(without_gpu_tables, "no GPU activity"),
    # CUDA calls traced, their GPU records lost (a public MPI export: 5,745 launches, no
    # kernel table): not "profile with CUDA tracing on"
    "GPU records lost": Case(without_gpu_tables, "CUDA API calls were traced but no kernel"),
    "no CUDA tracing": Case(without_gpu_or_api_tables, "profile with CUDA tracing on"),
    "no GPU work issued": Case(set_up_calls_only, "the CUDA calls traced issued no kernel"),
    # (a graph built but never launched issues no work: cudaGraphCreate is no launch)
    "graph built, never launched": Case(graph_set_up_only, "the CUDA calls traced issued no"),
    "nsys tables without metadata": Case(bare_nsys_tables, "export has no GPU activity"),
    "random .nsys-rep": Case(
        written("random.nsys-rep", os.urandom(4096)), "cannot open report file", nsys="export"
    ),
    "nsys missing": Case(fake_report, "nsys export --type sqlite --include-blobs=true -o "),
    "nsys export failing": Case(fake_report, "Importer error: the report file is damaged", "fail"),
    "nsys writes nothing": Case(fake_report, "produced no SQLite file", nsys="nofile"),
    "nsys failing beside the user's export": Case(
        lambda d: fake_report(plain_sqlite(d / "run.sqlite").parent), "Importer error", "fail"
    ),
}
# Cases a load of the file itself must reject, whatever checked it before.
SQLITE_CASES = (
    "empty file",
    "text named .sqlite",
    "truncated database",
    "corrupt pages",
    "garbled header page",
    "SQLite but not nsys",
    "no GPU activity",
    "nsys tables without metadata",
)


@pytest.fixture
def bad_input(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch) -> Path:
    """The case's input in tmp_path/in, with the case's nsys (or none) installed."""
    case: Case = CASES[request.param]
    folder = tmp_path / "in"
    folder.mkdir()
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-nsys-here"))
    monkeypatch.setenv("TRACECLF_CACHE_DIR", str(tmp_path / "cache"))
    if case.nsys is not None:
        nsys = write_fake_nsys(tmp_path / "nsys", tmp_path / "nsys.log", behaviour=case.nsys)
        monkeypatch.setenv("NSYS", str(nsys))
    return case.make(folder)


def assert_one_clear_line(message: str, path: Path, problem: str) -> None:
    assert len(message.splitlines()) == 1, message
    assert path.name in message, message
    assert problem in message, message
    assert "Traceback" not in message


def snapshot(path: Path) -> tuple:
    folder = path.parent
    state = file_state(path) if path.is_file() else None
    return folder_listing(folder), state


def analyze(path: Path) -> None:
    """What `traceclf analyze PATH` does with its input before any analysis."""
    for export in resolve_inputs([str(path)], quiet=True):
        inspect_export(export)
        load_trace(export)


@pytest.mark.parametrize("bad_input", CASES, indirect=True)
def test_api_raises_one_line_trace_error(bad_input: Path, request) -> None:
    case = CASES[request.node.callspec.params["bad_input"]]
    before = snapshot(bad_input)
    with pytest.raises(TraceError) as err:
        analyze(bad_input)
    assert_one_clear_line(str(err.value), bad_input, case.problem)
    assert snapshot(bad_input) == before


@pytest.mark.parametrize("bad_input", SQLITE_CASES, indirect=True)
def test_load_trace_alone_raises_trace_error(bad_input: Path) -> None:
    """Also without inspect_export's page check: damage met while reading the tables."""
    with pytest.raises(TraceError) as err:
        load_trace(bad_input)
    assert_one_clear_line(str(err.value), bad_input, "")


def assert_cli_rejects(result: CliResult, path: Path, problem: str) -> None:
    assert result.code == 2, result
    assert result.stdout == ""
    (line,) = result.stderr_lines
    assert line.startswith("traceclf: error: "), line
    assert_one_clear_line(line, path, problem)


@pytest.mark.parametrize("bad_input", CASES, indirect=True)
def test_cli_exits_2_with_one_line(bad_input: Path, request) -> None:
    case = CASES[request.node.callspec.params["bad_input"]]
    before = snapshot(bad_input)
    assert_cli_rejects(run_cli("analyze", bad_input), bad_input, case.problem)
    assert snapshot(bad_input) == before


@pytest.mark.parametrize(
    "bad_input", ["corrupt pages", "garbled header page", "random .nsys-rep"], indirect=True
)
def test_cli_process_prints_nothing_else(bad_input: Path, request) -> None:
    """In a real process: no Rust panic text, no interpreter traceback on stderr."""
    case = CASES[request.node.callspec.params["bad_input"]]
    before = snapshot(bad_input)
    assert_cli_rejects(run_cli_process("analyze", bad_input), bad_input, case.problem)
    assert snapshot(bad_input) == before


def test_one_bad_file_among_good_ones_is_named(tmp_path: Path) -> None:
    good = copy_export(real(), tmp_path / "rank_0.sqlite")
    bad = truncated(real(), tmp_path / "rank_1.sqlite")
    result = run_cli("analyze", good, bad)
    assert_cli_rejects(result, bad, "truncated")
    assert good.name not in result.stderr


def test_unexpanded_glob_without_matches(tmp_path: Path) -> None:
    pattern = tmp_path / "rank_*.sqlite"
    with pytest.raises(TraceError, match="no file matches"):
        resolve_inputs([str(pattern)])
    assert_cli_rejects(run_cli("analyze", pattern), pattern, "no file matches")


def copies_only(d: Path) -> Path:
    """A process that only copied (a public export: 540 memcpy rows, no kernel)."""
    path = copy_export(real(), d / "copies.sqlite")
    return drop_tables(path, ["CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_GRAPH_TRACE"])


def test_exports_without_gpu_work_beside_ranks_are_left_out(tmp_path: Path) -> None:
    """A folder of per-rank exports that also holds a launcher's (CUDA set up, no GPU work:
    refused by the check of the export) and a process's that only copied (refused once
    loaded): the ranks are analysed, the others named on stderr and in the report
    (``capture.skipped_inputs``, the "Left out" row), and the verdict is the rank's alone."""
    import json

    folder = tmp_path / "run"
    folder.mkdir()
    copy_export(real(), folder / "rank_0.sqlite")
    set_up_calls_only(tmp_path).rename(folder / "launcher.sqlite")
    copies_only(tmp_path).rename(folder / "copier.sqlite")
    # another tool's database in the folder (a public set held a DLProf one) had failed the run
    plain_sqlite(folder / "recipes.sqlite")
    before = snapshot(folder / "launcher.sqlite")
    both = run_cli("analyze", "--format", "json", "--no-cache", folder)
    alone = run_cli("analyze", "--format", "json", "--no-cache", folder / "rank_0.sqlite")
    assert both.code == 0 and alone.code == 0, both
    (line,) = [x for x in both.stderr_lines if "launcher.sqlite" in x]
    assert "the CUDA calls traced issued no kernel" in line and "left out" in line
    (line,) = [x for x in both.stderr_lines if "copier.sqlite" in x]
    with sqlite3.connect(folder / "copier.sqlite") as con:
        (rows,) = con.execute(
            "SELECT (SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY) "
            "+ (SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMSET)"
        ).fetchone()
    assert f"no kernel ran in this capture (only {rows} memcpy/memset rows)" in line
    report, single = json.loads(both.stdout), json.loads(alone.stdout)
    left = {Path(e["path"]).name: e["problem"] for e in report["capture"]["skipped_inputs"]}
    assert set(left) == {"launcher.sqlite", "copier.sqlite", "recipes.sqlite"}
    assert "issued no kernel" in left["launcher.sqlite"]
    assert "not an Nsight Systems export" in left["recipes.sqlite"]
    assert report["capture"]["inputs"] == 1 and single["capture"]["skipped_inputs"] == []
    assert report["classification"] == single["classification"]
    assert [Path(i["path"]).name for i in report["inputs"]] == ["rank_0.sqlite"]
    md = run_cli("analyze", "--format", "md", "--no-cache", folder).stdout
    assert "Left out" in md and "launcher.sqlite" in md and "copier.sqlite" in md
    assert snapshot(folder / "launcher.sqlite") == before


def test_export_that_only_copied_is_bad_input_alone(tmp_path: Path) -> None:
    path = copies_only(tmp_path)
    assert_cli_rejects(run_cli("analyze", path), path, "no kernel ran in this capture")


def test_exports_all_without_gpu_work_are_bad_input(tmp_path: Path) -> None:
    """The error names the first input as the user named them (one that only copied, refused
    once loaded), then the others (one refused by the check of the export)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = copies_only(tmp_path / "a"), set_up_calls_only(tmp_path / "b")
    result = run_cli("analyze", first, second)
    assert_cli_rejects(result, first, f"nor does any other input hold GPU work to judge ({second})")


def test_kernels_naming_no_process_stay_bad_input_beside_ranks(tmp_path: Path) -> None:
    """CONSTRUCTED: GPU rows without their process column (a damaged or generated table) are
    not an export without GPU work: beside a good rank they stop the run, naming the file."""
    good = copy_export(real(), tmp_path / "rank_0.sqlite")
    bad = copy_export(real(), tmp_path / "rank_1.sqlite")
    with sqlite3.connect(bad) as con:
        for table in ("KERNEL", "MEMCPY", "MEMSET"):
            con.execute(f"ALTER TABLE CUPTI_ACTIVITY_KIND_{table} DROP COLUMN globalPid")
        # (rows of another table left out besides, as a public export of this kind has)
        con.execute('UPDATE NVTX_EVENTS SET "end" = start - 1 WHERE rowid % 5 = 0')
    result = run_cli("analyze", "--no-cache", good, bad)
    assert_cli_rejects(result, bad, "kernel and copy rows name no process")


def test_inputs_left_out_of_several_runs_are_listed_once(tmp_path: Path) -> None:
    """Two unrelated captures (two runs) and a launcher's export: the launcher is listed once,
    under the runs' summary (``grouping.skipped_inputs``), not in each run's capture block;
    a second analysis, whose report comes from the cache, warns again."""
    import json

    folder = tmp_path / "runs"
    folder.mkdir()
    copy_export(real(), folder / "a.sqlite")
    copy_export(fixture_trace("h100_memory_offload"), folder / "b.sqlite")
    set_up_calls_only(tmp_path).rename(folder / "launcher.sqlite")
    cache = tmp_path / "cache"
    first = run_cli("analyze", "--format", "json", "--cache-dir", cache, folder)
    assert first.code == 0, first
    out = json.loads(first.stdout)
    assert len(out["runs"]) == 2
    (left,) = out["grouping"]["skipped_inputs"]
    assert Path(left["path"]).name == "launcher.sqlite"
    assert all(run["capture"]["skipped_inputs"] == [] for run in out["runs"])
    md = run_cli("analyze", "--format", "md", "--cache-dir", cache, folder)
    assert md.stdout.count("launcher.sqlite") == 1 and "Left out:" in md.stdout
    with warnings.catch_warnings():  # (in this process, a warning said once is said again)
        warnings.simplefilter("always")
        again = run_cli("analyze", "--format", "json", "--cache-dir", cache, folder)
    assert json.loads(again.stdout) == out
    assert any("launcher.sqlite" in line and "left out" in line for line in again.stderr_lines)


def without_column(src: Path, dst: Path, table: str, column: str) -> Path:
    path = copy_export(src, dst)
    with sqlite3.connect(path) as con:
        con.execute(f'ALTER TABLE {table} DROP COLUMN "{column}"')
    return path


def test_an_error_while_another_read_runs_is_said(tmp_path: Path) -> None:
    """A table that lacks a column fails its read on the main thread while the host tables are
    read on another: that read holds descriptor 2 (Rust panics are kept off it), and the
    message went into the held file, never written (a fuzzing run: exit 2, stderr empty, 26
    times in 27). Three runs, each in a real process; the race needs the second lane (two
    CPUs): the test below makes it certain."""
    path = without_column(
        fixture_trace("h100_host_input_stall"),
        tmp_path / "no_sync_end.sqlite",
        "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",
        "end",
    )
    for _ in range(3):
        assert_cli_rejects(run_cli_process("analyze", path, "--no-cache"), path, "lacks column")


@pytest.mark.parametrize("reading", [True, False])
def test_a_stop_while_a_read_runs_skips_the_shutdown_that_would_abort(reading: bool) -> None:
    """The interpreter's shutdown stops a daemon thread when it next takes the interpreter's
    lock; a read in connectorx's Rust code does so on its way back, and that aborted the
    process (exit -6 for 2 in about 1 run of 20 of the test above). The entry point ends the
    process at once when a ``traceclf-`` daemon thread is still at work, output flushed; a
    shutdown hook shows whether the interpreter's shutdown ran. Without such a thread it
    runs, as always."""
    script = (
        "import atexit, sys, threading\n"
        "from traceclf.support.process import exit_past_reads\n"
        "atexit.register(lambda: print('shutdown ran'))\n"
        f"if {reading}:\n"
        "    threading.Thread(target=threading.Event().wait, name='traceclf-host-side',\n"
        "                     daemon=True).start()\n"
        "def main():\n"
        "    print('report', end='')\n"
        "    sys.stderr.write('traceclf: error: run.sqlite: lacks column end')\n"
        "    sys.exit(2)\n"
        "exit_past_reads(main)\n"
    )
    done = python_script(script)
    assert done.returncode == 2
    assert done.stdout == ("report" if reading else "reportshutdown ran\n")
    assert done.stderr == "traceclf: error: run.sqlite: lacks column end"


def python_script(script: str) -> subprocess.CompletedProcess:
    """``script`` run by a fresh interpreter, its output as text."""
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )


def test_the_message_is_written_though_a_read_holds_descriptor_2() -> None:
    """The same, made certain: a thread inside a read (``panics_hidden``) that never ends, and
    the main thread failing meanwhile."""
    script = (
        "import threading\n"
        "from traceclf.cli.options import fail\n"
        "from traceclf.support.panics import panics_hidden\n"
        "inside = threading.Event()\n"
        "def read():\n"
        "    with panics_hidden():\n"
        "        inside.set()\n"
        "        threading.Event().wait()\n"
        "threading.Thread(target=read, daemon=True).start()\n"
        "inside.wait()\n"
        "fail('run.sqlite: table X lacks column end')\n"
    )
    done = python_script(script)
    assert done.returncode == 2
    assert done.stderr == "traceclf: error: run.sqlite: table X lacks column end\n"


def test_a_read_after_the_message_takes_descriptor_2_no_more() -> None:
    """A reader thread goes on reading once the main thread has said why it stops: its next
    read took descriptor 2 again, and what the main thread wrote next (a traceback with
    TRACECLF_DEBUG) went into the held file, lost at exit (9 runs in 40 of a racing script).
    Made certain: a read begun after :func:`release` that never ends."""
    script = (
        "import os\n"
        "from traceclf.support.panics import panics_hidden, release\n"
        "release()\n"
        "with panics_hidden():\n"
        "    os.write(2, b'written after the message\\n')\n"
        "    os._exit(2)\n"
    )
    done = python_script(script)
    assert done.stderr == "written after the message\n"


@pytest.mark.parametrize(
    "args",
    [["kernels", b"\x80abc"], ["analyze", b"run.sqlite", "--step-range", b"\x80"]],
    ids=["a kernel name", "a step pattern"],
)
def test_text_arguments_that_are_not_utf8_are_usage_errors(args: list) -> None:
    """A fuzzing run: bytes that are not UTF-8 reached polars as lone surrogates (an internal
    UnicodeEncodeError). Now one line and exit 2, before anything is read."""
    done = subprocess.run(
        [sys.executable, "-m", "traceclf", *args], capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 2
    (line,) = done.stderr.decode().splitlines()
    assert line.startswith("traceclf: error: Invalid value for ") and "not valid UTF-8" in line


def test_export_trace_finds_an_export_whose_name_is_not_utf8(tmp_path: Path) -> None:
    """The report names the export with its odd byte written out (``bad\\x80name.sqlite``);
    --export-trace opened the file by that text and said "no such file"."""
    path = copy_export(real(), tmp_path / os.fsdecode(b"bad\x80name.sqlite"))
    out = tmp_path / "window.json"
    result = run_cli("analyze", path, "-q", "--no-cache", "--export-trace", out)
    assert result.code == 0, result.stderr
    assert json.loads(out.read_text())["traceEvents"]
