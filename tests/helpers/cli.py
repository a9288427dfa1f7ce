"""Run the ``traceclf`` command and capture what a user would see."""

from __future__ import annotations

import io
import resource
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from unittest import mock


@dataclass(frozen=True)
class CliResult:
    code: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()

    def __iter__(self):  # code, out, err = run_cli(...)
        return iter((self.code, self.stdout, self.stderr))


def run_cli(*args: str | Path) -> CliResult:
    """``traceclf ARGS`` in this process, through ``traceclf.cli.main`` (what the console
    script's entry point runs, so error handling and exit codes are the real ones; the entry
    point's own exit past running reads is tested in a fresh process). Environment variables
    are read from ``os.environ`` (use monkeypatch)."""
    from traceclf.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = ["traceclf", *map(str, args)]
    with mock.patch.object(sys, "argv", argv), redirect_stdout(out), redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return CliResult(code, out.getvalue(), err.getvalue())


def run_cli_process(
    *args: str | Path, timeout: float = 120, memory: int | None = None
) -> CliResult:
    """``traceclf ARGS`` in a fresh interpreter: also catches what bypasses Python's streams
    (a Rust panic message, an interpreter traceback). ``memory`` caps the child's address
    space (bytes)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    done = subprocess.run(
        [sys.executable, "-m", "traceclf", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit if memory is not None else None,
        check=False,
    )
    return CliResult(done.returncode, done.stdout, done.stderr)
