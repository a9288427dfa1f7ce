"""The public exports in fixtures/external are scrubbed copies: the environment their authors'
captures recorded (login names, SSH client addresses, launcher secrets, install paths, CPU and
perf details) was never ours to redistribute, so none of it may be in the files, not even in
SQLite pages freed when the rows were deleted."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from conftest import FIXTURES

EXTERNAL = sorted((FIXTURES / "external").glob("*.sqlite"))
# TARGET_INFO_SYSTEM_ENV rows that describe the person's machine and session, not the capture
PRIVATE_ROWS = ("DeviceEnvironment", "CpuInfo", "TargetInstallDir", "LinuxPerfInfo")
# Variables of a login environment; none may appear anywhere in the file's bytes
ENV_MARKERS = (b"SSH_CLIENT=", b"SSH_CONNECTION=", b"LOGNAME=", b"USER=", b"HOME=", b"PMI_")


def test_there_are_external_exports() -> None:
    assert len(EXTERNAL) == 3


@pytest.mark.parametrize("export", EXTERNAL, ids=lambda p: p.stem)
def test_no_capture_environment(export: Path) -> None:
    con = sqlite3.connect(f"file:{export.resolve()}?mode=ro", uri=True)
    try:
        names = {n for (n,) in con.execute("SELECT name FROM TARGET_INFO_SYSTEM_ENV")}
        # deleted rows survive in free pages until the file is vacuumed
        (free_pages,) = con.execute("PRAGMA freelist_count").fetchone()
    finally:
        con.close()
    assert not names & set(PRIVATE_ROWS)
    assert free_pages == 0
    raw = export.read_bytes()
    assert [m for m in ENV_MARKERS if m in raw] == []
