"""How a run ends when the system or the cluster is against it (issue 29, "Hangs, leaks and
unbounded cost", "Crashes and wrong answers").

- SIGTERM stops ``--jobs`` workers, the resource tracker, a running ``nsys export`` and its
  helper, and removes the temporary export, as Ctrl-C does;
- a ``--jobs`` worker killed mid-analysis, a Dask scheduler without workers, and a Dask cluster
  whose only worker dies end in one line, never an internal error or a silent wait;
- a stdout that is not UTF-8, a memory limit below what polars and connectorx reserve, and
  library warnings under ``-q`` end in a report or one line, not a traceback;
- a regular expression too large for the engine is called too large, not blamed on
  look-around.

The stand-in nsys and the exports (copies of small real ones in fixtures/) are CONSTRUCTED.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from conftest import fixture_trace
from helpers.cli import CliResult, run_cli, run_cli_process
from helpers.fake_nsys import write_fake_nsys, write_fake_report
from helpers.files import copy_export

TINY = "h100_host_input_stall"
BIGGER = "h100_host_launch_gpumetrics"  # 42 MB: a few seconds of work per export
CHILD_TIMEOUT_S = 120

psutil = pytest.importorskip("psutil")


def one_line_error(result: CliResult, *needles: str) -> None:
    assert result.code == 2, (result.code, result.stderr)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("traceclf: error: "), result.stderr
    assert "internal error" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def start(*args: str | Path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "traceclf", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def workers_of(proc: subprocess.Popen) -> list:
    """The --jobs workers of a traceclf process (not its resource tracker)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if "spawn_main" in " ".join(_cmdline(c))]


def _cmdline(process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def gone(processes: list) -> bool:
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


# -- signals --------------------------------------------------------------------------------------


def test_sigterm_stops_every_worker_and_the_resource_tracker(tmp_path: Path) -> None:
    """SIGTERM to `traceclf analyze --jobs 2` killed only the parent: the workers (~180 MB
    each) and the resource tracker stayed."""
    files = [copy_export(fixture_trace(BIGGER), tmp_path / f"rank_{i}.sqlite") for i in range(2)]
    proc = start("analyze", *files, "--jobs", "2", "-q", "--no-cache", "-f", "json")
    workers = wait_for(lambda: len(w := workers_of(proc)) == 2 and w)
    family = psutil.Process(proc.pid).children(recursive=True)  # workers and tracker
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "traceclf: terminated"
    assert wait_for(lambda: gone(family), 30), [p.pid for p in family]
    assert len(workers) == 2


@pytest.mark.parametrize(
    ("interrupt", "code", "word"), [("term", 143, "terminated"), ("int", 130, "aborted")]
)
def test_a_signal_that_lands_while_a_class_is_made_is_still_a_signal(
    interrupt: str, code: int, word: str, monkeypatch, capsys
) -> None:
    """SIGTERM during an import (a loaded machine: the signal came while RuleSet, a dataclass,
    was being made) reached the user as "internal error: RuntimeError: Error calling
    __set_name__ on 'Field' instance" and exit 2: Python 3.11 wraps what a signal handler
    raises there. It is the signal's exit. CONSTRUCTED: the CLI raises that wrapped error."""
    import traceclf.cli as cli_module
    from traceclf.support.process import Terminated

    def wrapped(*_args, **_kwargs):
        try:
            raise Terminated() if interrupt == "term" else KeyboardInterrupt()
        except KeyboardInterrupt as e:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance 'x'") from e

    monkeypatch.setattr(cli_module.cli, "main", wrapped)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # (leave pytest's handlers be)
    with pytest.raises(SystemExit) as stop:
        cli_module.main()
    assert stop.value.code == code
    assert capsys.readouterr().err.strip() == f"traceclf: {word}"


def test_sigterm_stops_nsys_and_removes_the_temporary_export(tmp_path: Path) -> None:
    """SIGTERM during `nsys export` left nsys, its helper and a temporary file (SIGINT did
    not)."""
    hanging = write_fake_nsys(tmp_path / "nsys", tmp_path / "nsys.log", behaviour="hang")
    (tmp_path / "rep").mkdir()
    report = write_fake_report(tmp_path / "rep" / "run.nsys-rep", fixture_trace(TINY))
    cache = tmp_path / "cache"
    proc = start("analyze", report, "--nsys", hanging, "--cache-dir", cache, "-q")
    (pid_file,) = wait_for(lambda: list(cache.glob(".traceclf-export-*/*.pid")))
    pids = [int(p) for p in wait_for(lambda: pid_file.read_text().split())]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert wait_for(lambda: gone([psutil.Process(p) for p in pids if psutil.pid_exists(p)]), 30)
    assert [p.name for p in cache.iterdir() if not p.name.startswith("rules-")] == []
    assert [p.name for p in report.parent.iterdir()] == ["run.nsys-rep"]


def test_sigterm_while_nsys_is_asked_for_its_options_stops_it_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """SIGTERM while `nsys export --help` ran (the probe for --include-blobs) left nsys's
    helper running and an empty export folder in the cache."""
    log = tmp_path / "nsys.log"
    hanging = write_fake_nsys(tmp_path / "nsys", log, behaviour="hang_help")
    (tmp_path / "rep").mkdir()
    report = write_fake_report(tmp_path / "rep" / "run.nsys-rep", fixture_trace(TINY))
    cache = tmp_path / "cache"
    proc = start("analyze", report, "--nsys", hanging, "--cache-dir", cache, "-q")
    pid_file = log.with_name(log.name + ".help.pid")
    pids = [int(p) for p in wait_for(lambda: pid_file.exists() and pid_file.read_text().split())]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert wait_for(lambda: gone([psutil.Process(p) for p in pids if psutil.pid_exists(p)]), 30)
    assert [p.name for p in cache.iterdir() if not p.name.startswith("rules-")] == []


def test_a_killed_worker_is_one_line_naming_the_file(tmp_path: Path) -> None:
    """A --jobs worker killed mid-analysis (the OOM killer, kill -9) was "internal error:
    BrokenProcessPool" without a file name."""
    files = [copy_export(fixture_trace(BIGGER), tmp_path / f"rank_{i}.sqlite") for i in range(2)]
    proc = start("analyze", *files, "--jobs", "2", "-q", "--no-cache", "-f", "json")
    workers = wait_for(lambda: len(w := workers_of(proc)) == 2 and w)
    workers[0].kill()
    out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    one_line_error(CliResult(proc.returncode, out, err), "worker process died", "rank_")


# -- Dask -----------------------------------------------------------------------------------------


@pytest.fixture
def scheduler():
    """A Dask scheduler with no worker of its own."""
    distributed = pytest.importorskip("distributed")
    import logging

    with distributed.LocalCluster(
        n_workers=0, processes=True, dashboard_address=None, silence_logs=logging.CRITICAL
    ) as cluster:
        yield cluster.scheduler_address


def test_a_dask_scheduler_without_workers_is_one_line(
    tmp_path: Path, scheduler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--dask at a scheduler with no workers waited forever in silence."""
    monkeypatch.setenv("TRACECLF_DASK_TIMEOUT", "2")
    export = copy_export(fixture_trace(TINY), tmp_path / "run.sqlite")
    result = run_cli_process("analyze", export, "--dask", scheduler, "-q", "--no-cache",
                             timeout=CHILD_TIMEOUT_S)  # fmt: skip
    one_line_error(result, scheduler, "no worker")


def test_a_dask_cluster_whose_only_worker_dies_is_one_line(
    tmp_path: Path, scheduler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only worker (no nanny to restart it) dies while it analyses: the task waited
    forever for a worker that never came."""
    monkeypatch.setenv("TRACECLF_DASK_TIMEOUT", "2")
    worker = subprocess.Popen(
        [sys.executable, "-c", "from distributed.cli.dask_worker import main; main()",
         scheduler, "--no-nanny", "--nthreads", "1", "--no-dashboard"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        from distributed import Client

        with Client(scheduler, timeout="30s") as client:
            client.wait_for_workers(1, timeout=60)
            export = copy_export(fixture_trace(BIGGER), tmp_path / "run.sqlite")
            found: list[CliResult] = []
            run = threading.Thread(
                target=lambda: found.append(
                    run_cli_process(
                        "analyze",
                        export,
                        "--dask",
                        scheduler,
                        "-q",
                        "--no-cache",
                        timeout=CHILD_TIMEOUT_S,
                    )
                )
            )
            run.start()
            wait_for(lambda: any(client.processing().values()))  # the task is on the worker
            worker.kill()
            run.join(CHILD_TIMEOUT_S)
        one_line_error(found[0], scheduler, "lost its workers")
    finally:
        worker.kill()
        worker.wait()


# -- the process' surroundings --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["terminal", "md", "json"])
def test_a_stdout_that_is_not_utf8_gets_the_report(tmp_path: Path, fmt: str) -> None:
    """LC_ALL=C without Python's UTF-8 mode, or PYTHONIOENCODING=ascii: every report was an
    internal UnicodeEncodeError."""
    export = copy_export(fixture_trace(TINY), tmp_path / "run.sqlite")
    env = os.environ | {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
                        "PYTHONIOENCODING": "ascii"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "traceclf", "analyze", export, "-f", fmt, "-q", "--no-cache"],
        capture_output=True, env=env, timeout=CHILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == b"", done.stderr
    text = done.stdout.decode("ascii")  # nothing but ASCII reached it
    if fmt == "json":
        assert json.loads(text)["classification"]["bound"] == "host"
    else:
        assert "HOST-bound" in text


@pytest.mark.parametrize("mib", [512, 1024, 1536])
def test_a_memory_limit_below_what_the_libraries_reserve_is_one_line(
    tmp_path: Path, mib: int
) -> None:
    """ulimit -v below ~2 GB: the connectorx import failed ("internal error"), a 48-line
    traceback, or a Rust abort (exit 134)."""
    export = copy_export(fixture_trace(TINY), tmp_path / "run.sqlite")
    result = run_cli_process("analyze", export, "-q", "--no-cache", timeout=CHILD_TIMEOUT_S,
                             memory=mib << 20)  # fmt: skip
    one_line_error(result, "memory limit", f"{mib} MiB", "2 GiB")


def test_library_warnings_stay_off_stderr_with_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A polars warning raised during the analysis reached stderr under -q; traceclf's own
    warnings still do."""
    import polars as pl

    from traceclf.measures import compute

    summary = compute.kernel_summary

    def warning_summary(*args, **kwargs):
        warnings.warn(
            "a constructed polars warning", pl.exceptions.PerformanceWarning, stacklevel=1
        )
        return summary(*args, **kwargs)

    monkeypatch.setattr(compute, "kernel_summary", warning_summary)
    export = copy_export(fixture_trace(TINY), tmp_path / "run.sqlite")
    quiet = run_cli("analyze", export, "-q", "--no-cache", "--step-range", "nomatch")
    assert quiet.code == 0
    assert all(line.startswith("traceclf: warning: ") for line in quiet.stderr_lines), quiet.stderr
    assert "polars warning" not in quiet.stderr


def test_a_regex_too_large_is_not_blamed_on_look_around() -> None:
    result = run_cli("analyze", "x.sqlite", "--step-range", "a{1000}{1000}")
    one_line_error(result, "too large")
    assert "look-around" not in result.stderr
