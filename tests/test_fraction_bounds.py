"""Every share a report gives is a share, within [0, 1]. A fuzzing run of odd exports found
three over 1: a communicator's exposed time over the mean step (1.03 with a third of the step
ranges unnamed), the host's waits over the window (62 with every CUDA call 100 s long; 1.80 on
a public export), a top kernel's summed time over the window (1.77 with collectives running
on two streams at once). Each case is CONSTRUCTED: a copy of a small real export
(fixtures/) edited with sqlite3; each number is checked against an independent reading of
the export or of another measure, and the real fixtures' reports are walked for any share out
of bounds."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from conftest import FIXTURES, fixture_trace
from helpers.cli import run_cli
from helpers.files import copy_export
from test_hostile_exports import strict_json

# Signed on purpose: a kernel's slowdown beside communication (faster there: negative).
SIGNED = {"slowdown_frac"}

NCCL_KERNELS = "SELECT id FROM StringIds WHERE value LIKE 'ncclDevKernel%'"
CASES = {
    "a third of the step ranges unnamed": (
        "h100_nccl_overlap",
        "UPDATE NVTX_EVENTS SET text = 'x' WHERE text LIKE 'step %' AND rowid % 3 = 0",
    ),
    "half of the step ranges unnamed": (
        "h100_nccl_overlap",
        "UPDATE NVTX_EVENTS SET text = 'x' WHERE text LIKE 'step %' AND rowid % 2 = 1",
    ),
    "every CUDA call 100 s long": (
        "h100_memory_offload",
        'UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET "end" = start + 100000000000',
    ),
    "every memory event a free": (
        "h100_memory_offload",
        "UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET memoryOperationType = 1",
    ),
    "collectives on two streams at once": (
        "h100_nccl_overlap",
        f"CREATE TABLE k AS SELECT * FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE shortName IN "
        f"({NCCL_KERNELS})",
        'UPDATE k SET streamId = streamId + 100, start = start + 1000, "end" = "end" + 1000, '
        "correlationId = correlationId + 10000000",
        "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL SELECT * FROM k",
        "DROP TABLE k",
    ),
}


def shares(node, path: str = "") -> list[tuple[str, float]]:
    """Every number a report gives under a key ending in ``frac``, with where it is."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key.endswith("frac") and isinstance(value, int | float) and key not in SIGNED:
                found.append((f"{path}.{key}", value))
            found += shares(value, f"{path}.{key}")
    elif isinstance(node, list):
        for item in node:
            found += shares(item, f"{path}[]")
    return found


def out_of_bounds(report: dict) -> list[tuple[str, float]]:
    return [(where, v) for where, v in shares(report) if not 0 <= v <= 1]


def report_of(path: Path) -> dict:
    result = run_cli("analyze", path, "-f", "json", "-q", "--no-cache")
    assert result.code == 0, result.stderr
    return strict_json(result.stdout)


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    made = {}
    for case, (source, *sql) in CASES.items():
        path = copy_export(fixture_trace(source), tmp_path_factory.mktemp("odd") / "run.sqlite")
        with sqlite3.connect(path) as con:
            for statement in sql:
                con.execute(statement)
        made[case] = path, report_of(path)
    return made


@pytest.mark.parametrize("case", CASES)
def test_an_odd_export_gives_no_share_over_1(odd, case: str) -> None:
    _path, report = odd[case]
    assert out_of_bounds(report) == []


@pytest.mark.parametrize("case", ["a third of the step ranges unnamed"])
def test_a_communicators_exposed_share_is_of_the_window(odd, case: str) -> None:
    """One communicator of one kind: its exposed share is the kind's (communication.by_kind,
    measured apart), not its exposed ms per step over the steps' mean (1.03 here)."""
    _path, report = odd[case]
    for run in report["runs"]:  # (two processes, each a run of its own)
        (group,) = run["communication"]["groups"]
        (kind,) = group["kinds"]
        assert group["exposed_frac"] == pytest.approx(run["comm_by_kind"][kind]["exposed_frac"])
    # (the old reading, exposed ms per step over the steps' mean, passed 1 on one of them)
    assert any(
        g["exposed_ms_per_step"] > run["metrics"]["step_time_ms"]
        for run in report["runs"]
        for g in run["communication"]["groups"]
    )


def test_frees_alone_are_no_peak(odd) -> None:
    """Frees of memory allocated before the capture take the level below its start: the peak
    was that negative level (-87% of capacity, and a memory verdict on it)."""
    _path, report = odd["every memory event a free"]
    assert report["metrics"]["peak_memory_bytes"] == 0
    assert report["metrics"]["peak_memory_frac"] == 0


def test_waits_longer_than_the_window_are_all_of_it(odd) -> None:
    _path, report = odd["every CUDA call 100 s long"]
    assert report["metrics"]["wait_call_frac"] == 1.0


def test_a_top_kernels_share_is_the_time_one_of_it_runs(odd) -> None:
    """Independent: each top kernel's instances on rank 0 clipped to the window and united in
    Python, over the window's length (one span: a short capture)."""
    path, report = odd["collectives on two streams at once"]
    lo, hi = report["steps"]["window_ns"]
    rank = report["ranks"][0]
    con = sqlite3.connect(path)
    for kernel in rank["top_kernels"]:
        rows = con.execute(
            "SELECT k.start, k.end FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
            "ON s.id = k.shortName WHERE s.value = ? AND (k.globalPid >> 24) & 16777215 = ? "
            "AND k.start < ? AND k.end > ? ORDER BY k.start",
            (kernel["name"], rank["pid"], hi, lo),
        ).fetchall()
        covered, reach = 0, lo
        for start, end in rows:
            start, end = max(start, lo), min(end, hi)
            if end > reach:
                covered, reach = covered + end - max(start, reach), end
        assert kernel["frac"] == pytest.approx(covered / (hi - lo), rel=1e-12)
    assert rank["top_kernels"][0]["total_ns"] > hi - lo  # (their sum: more than the window)
    con.close()


@pytest.mark.parametrize("export", sorted(p.name for p in FIXTURES.glob("*.sqlite")))
def test_the_real_fixtures_give_no_share_out_of_bounds(export: str) -> None:
    assert out_of_bounds(report_of(FIXTURES / export)) == []
