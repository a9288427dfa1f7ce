""".nsys-rep inputs: nsys is found, run once per report version, and never touches the report.

A stand-in nsys (helpers/fake_nsys.py) "exports" a fake report by copying the real export it
names, and logs each run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import SMALL_TRACE, fixture_trace
from helpers.cli import run_cli
from helpers.fake_nsys import help_calls, invocations, write_fake_nsys, write_fake_report
from helpers.files import copy_export, file_state, folder_listing

from traceclf.ingest.exportstamp import is_export_of
from traceclf.ingest.inputs import resolve_inputs
from traceclf.ingest.load import load_trace
from traceclf.ingest.nsys import export_report, find_nsys, report_key
from traceclf.support.errors import TraceError

OTHER_TRACE = "h100_host_input_stall"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No nsys anywhere and a private cache dir; returns tmp_path."""
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setenv("TRACECLF_CACHE_DIR", str(tmp_path / "user-cache"))
    return tmp_path


@pytest.fixture
def log(env: Path) -> Path:
    return env / "nsys.log"


@pytest.fixture
def nsys(env: Path, log: Path) -> Path:
    """A stand-in nsys under a name that no PATH search would find."""
    (env / "tools").mkdir()
    return write_fake_nsys(env / "tools" / "nsys-2025.3", log)


@pytest.fixture
def report(env: Path) -> Path:
    folder = env / "runs"
    folder.mkdir()
    return write_fake_report(folder / "run.nsys-rep", fixture_trace(SMALL_TRACE))


def kernels_of(path: Path) -> int:
    return load_trace(path).kernels.height


def test_found_via_nsys_argument(env: Path, report: Path, nsys: Path, log: Path) -> None:
    (export,) = resolve_inputs([str(report)], nsys=nsys)
    assert export.parent == env / "user-cache"  # into the cache, not beside the report
    assert export.name.startswith("run-") and export.suffix == ".sqlite"
    assert kernels_of(export) == kernels_of(fixture_trace(SMALL_TRACE))
    (call,) = invocations(log)
    assert call.startswith("export --type sqlite --output ") and call.endswith(str(report))


def test_export_asks_for_nvtx_payload_blobs_once_per_nsys(
    env: Path, report: Path, nsys: Path, log: Path
) -> None:
    """An nsys whose ``export --help`` lists --include-blobs (2025.3) exports with
    ``--include-blobs=true``: NCCL's message sizes and communicators reach the export only so.
    Its help is asked once, however many reports it exports."""
    other = write_fake_report(report.with_name("other.nsys-rep"), fixture_trace(SMALL_TRACE))
    resolve_inputs([str(report)], nsys=nsys)
    resolve_inputs([str(other)], nsys=nsys)
    calls = invocations(log)
    assert len(calls) == 2
    assert all(" --include-blobs=true " in call for call in calls)
    assert help_calls(log) == 1


def test_older_nsys_exports_without_the_blobs_option(env: Path, report: Path, log: Path) -> None:
    """An nsys whose help does not list --include-blobs (it would reject it) exports without
    it, and the export is read as usual."""
    older = write_fake_nsys(env / "nsys-2023.4", log, blobs=False)
    (export,) = resolve_inputs([str(report)], nsys=older)
    (call,) = invocations(log)
    assert "--include-blobs" not in call
    assert kernels_of(export) == kernels_of(fixture_trace(SMALL_TRACE))


def test_found_via_environment(report: Path, nsys: Path, log: Path, monkeypatch) -> None:
    monkeypatch.setenv("NSYS", str(nsys))
    assert find_nsys() == nsys
    resolve_inputs([str(report)])
    assert len(invocations(log)) == 1


def test_found_on_path(env: Path, report: Path, log: Path, monkeypatch) -> None:
    bin_dir = env / "bin"
    bin_dir.mkdir()
    write_fake_nsys(bin_dir / "nsys", log)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert find_nsys() == bin_dir / "nsys"
    resolve_inputs([str(report)])
    assert len(invocations(log)) == 1


def test_explicit_nsys_that_does_not_exist_is_not_replaced(
    env: Path, report: Path, nsys: Path, monkeypatch
) -> None:
    monkeypatch.setenv("NSYS", str(nsys))
    assert find_nsys(env / "nowhere" / "nsys") is None
    with pytest.raises(TraceError, match="nowhere/nsys is not an executable"):
        resolve_inputs([str(report)], nsys=env / "nowhere" / "nsys")


def test_exported_once_then_reused(report: Path, nsys: Path, log: Path) -> None:
    before = file_state(report)
    first = resolve_inputs([str(report)], nsys=nsys)
    second = resolve_inputs([str(report)], nsys=nsys)
    assert first == second
    assert len(invocations(log)) == 1
    assert is_export_of(first[0], report_key(report))
    assert file_state(report) == before
    assert sorted(p.name for p in report.parent.iterdir()) == ["run.nsys-rep"]


def test_existing_traceclf_export_beside_the_report_is_reused(
    report: Path, nsys: Path, log: Path
) -> None:
    """Exports that earlier versions of traceclf wrote beside the report are still used."""
    (cached,) = resolve_inputs([str(report)], nsys=nsys)
    beside = report.with_suffix(".sqlite")
    cached.rename(beside)
    assert resolve_inputs([str(report)], nsys=nsys) == [beside]
    assert len(invocations(log)) == 1


def test_users_newer_export_beside_the_report_is_reused(
    report: Path, nsys: Path, log: Path
) -> None:
    theirs = copy_export(fixture_trace(SMALL_TRACE), report.with_suffix(".sqlite"))
    assert resolve_inputs([str(report)], nsys=nsys) == [theirs]
    assert invocations(log) == []


def test_reexported_when_the_report_changes(report: Path, nsys: Path, log: Path) -> None:
    (export,) = resolve_inputs([str(report)], nsys=nsys)
    assert kernels_of(export) == kernels_of(fixture_trace(SMALL_TRACE))
    write_fake_report(report, fixture_trace(OTHER_TRACE))  # the run was profiled again
    (export,) = resolve_inputs([str(report)], nsys=nsys)
    assert len(invocations(log)) == 2
    assert kernels_of(export) == kernels_of(fixture_trace(OTHER_TRACE))


def test_cache_dir_dot_exports_into_the_current_folder(
    report: Path, nsys: Path, monkeypatch
) -> None:
    monkeypatch.chdir(report.parent)
    (export,) = resolve_inputs([str(report)], nsys=nsys, cache_dir=Path("."))
    assert export.parent == report.parent and export.name != "run.sqlite"


def test_read_only_folder_exports_into_cache_dir(
    env: Path, report: Path, nsys: Path, log: Path
) -> None:
    cache_dir = env / "explicit-cache"
    listing = folder_listing(report.parent)
    report.parent.chmod(0o555)  # no write bit: left alone even by root
    try:
        (export,) = resolve_inputs([str(report)], nsys=nsys, cache_dir=cache_dir)
        assert export.parent == cache_dir
        assert resolve_inputs([str(report)], nsys=nsys, cache_dir=cache_dir) == [export]
        assert len(invocations(log)) == 1
        before = file_state(report)
        assert folder_listing(report.parent) == listing

        write_fake_report(report, fixture_trace(OTHER_TRACE))  # profiled again, same name
        (newer,) = resolve_inputs([str(report)], nsys=nsys, cache_dir=cache_dir)
        assert len(invocations(log)) == 2
        assert kernels_of(newer) == kernels_of(fixture_trace(OTHER_TRACE))
        assert list(cache_dir.iterdir()) == [newer]  # the old version's export is gone
        assert file_state(report) != before and folder_listing(report.parent) == listing
    finally:
        report.parent.chmod(0o755)


def test_users_own_export_beside_the_report_is_kept(report: Path, nsys: Path) -> None:
    theirs = copy_export(fixture_trace(OTHER_TRACE), report.with_suffix(".sqlite"))
    old = report.stat().st_mtime_ns - 10**9
    os.utime(theirs, ns=(old, old))  # older than the report: not its export
    before = file_state(theirs)
    (export,) = resolve_inputs([str(report)], nsys=nsys)
    assert export.parent == report.parent.parent / "user-cache"
    assert kernels_of(export) == kernels_of(fixture_trace(SMALL_TRACE))
    assert file_state(theirs) == before


def test_folder_with_report_and_its_export_yields_one(report: Path, nsys: Path, log: Path) -> None:
    (cached,) = resolve_inputs([str(report)], nsys=nsys)
    assert resolve_inputs([str(report.parent)]) == [cached]  # no nsys needed for the second look
    theirs = copy_export(fixture_trace(SMALL_TRACE), report.with_suffix(".sqlite"))
    assert resolve_inputs([str(report.parent)]) == [theirs]
    assert resolve_inputs([str(report), str(theirs)]) == [theirs]
    assert len(invocations(log)) == 1


def test_folder_with_stale_export_reexports(report: Path, nsys: Path, log: Path) -> None:
    resolve_inputs([str(report)], nsys=nsys)
    write_fake_report(report, fixture_trace(OTHER_TRACE))
    (export,) = resolve_inputs([str(report.parent)], nsys=nsys)
    assert len(invocations(log)) == 2
    assert kernels_of(export) == kernels_of(fixture_trace(OTHER_TRACE))


def test_natural_order_across_reports_and_exports(env: Path, nsys: Path) -> None:
    folder = env / "ranks"
    folder.mkdir()
    for rank in (10, 2, 1):
        write_fake_report(folder / f"rank_{rank}.nsys-rep", fixture_trace(SMALL_TRACE))
    copy_export(fixture_trace(SMALL_TRACE), folder / "rank_3.sqlite")
    names = [p.name.split("-")[0] for p in resolve_inputs([str(folder)], nsys=nsys)]
    assert names == ["rank_1", "rank_2", "rank_3.sqlite", "rank_10"]


def test_concurrent_exports_of_one_report_both_succeed(report: Path, env: Path) -> None:
    slow = write_fake_nsys(env / "slow-nsys", env / "slow.log", delay=0.3)
    results: list[Path | BaseException] = []

    def run() -> None:
        try:
            results.append(export_report(report, nsys=slow, quiet=True))
        except BaseException as e:  # reported by the assertion below
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and isinstance(results[0], Path)
    assert kernels_of(results[0]) == kernels_of(fixture_trace(SMALL_TRACE))
    assert sorted(p.name for p in report.parent.iterdir()) == ["run.nsys-rep"]
    assert list(results[0].parent.iterdir()) == [results[0]]  # no temporary left behind


def test_cli_without_nsys_says_how_to_export(report: Path) -> None:
    before = file_state(report)
    result = run_cli("analyze", report)
    assert result.code == 2
    (line,) = result.stderr_lines
    assert line.startswith(f"traceclf: error: {report}: nsys not found")
    sqlite = report.with_suffix(".sqlite")
    assert f"nsys export --type sqlite --include-blobs=true -o {sqlite} {report}" in line
    assert "--nsys" in line and "NSYS" in line
    assert file_state(report) == before


def test_cli_shows_first_line_of_a_failing_nsys(env: Path, report: Path, log: Path) -> None:
    failing = write_fake_nsys(env / "failing-nsys", log, behaviour="fail")
    before = folder_listing(report.parent), file_state(report)
    result = run_cli("analyze", "--nsys", failing, report)
    assert result.code == 2
    (line,) = result.stderr_lines
    assert line.endswith(
        "nsys export failed (exit 3): Importer error: the report file is damaged (status 0x17)"
    )
    assert (folder_listing(report.parent), file_state(report)) == before  # no temp file left


def test_interrupt_stops_nsys_and_cleans_up(env: Path, report: Path) -> None:
    hanging = write_fake_nsys(env / "hanging-nsys", env / "hang.log", behaviour="hang")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from traceclf.ingest.nsys import export_report
        export_report(Path({str(report)!r}), nsys=Path({str(hanging)!r}), quiet=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    cache_dir = env / "user-cache"
    # (nsys exports into a folder of its own: .traceclf-export-*, removed with what it holds)
    (pid_file,) = _wait_for(lambda: list(cache_dir.glob(".traceclf-export-*/*.pid")))
    pids = [int(p) for p in _wait_for(lambda: pid_file.read_text().split())]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert _wait_for(lambda: not any(map(_alive, pids)))  # nsys and the helper it started
    leftovers = {p.name for p in cache_dir.iterdir()} - {pid_file.name}
    assert leftovers == set()  # the half-written temporary export was removed
    assert [p.name for p in report.parent.iterdir()] == [report.name]


def test_cli_analyzes_a_report(report: Path, nsys: Path) -> None:
    result = run_cli("analyze", "--nsys", nsys, "--format", "json", "--no-cache", "-q", report)
    assert result.code == 0, result.stderr
    (entry,) = json.loads(result.stdout)["inputs"]
    assert entry["path"] == str(report)  # the name the user gave, not the cached export
    assert entry["ranks"] == 2


def _wait_for(condition, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
