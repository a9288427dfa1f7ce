"""Valid exports load, whatever their optional metadata holds, and one file of several ranks
stays one run (issue 22, "Exports that do not load or are grouped wrongly").

- nsys 2022.2/2022.3 keep raw bytes (GpuInfo, NicInfo) in TARGET_INFO_SYSTEM_ENV's TEXT value
  column; only its Hostname row is read, as bytes;
- NVTX text, StringIds and names that are not UTF-8 are decoded with U+FFFD, and the report's
  ``capture.repaired_strings`` says how many;
- a number in a file name is a rank only when the name follows a rank pattern and the file
  holds one rank: ``ulysses_2gpu_1s_window.sqlite`` holding two ranks is one run of two.

Every odd export here is CONSTRUCTED: a copy of a real export (fixtures/) with bytes written
into it by sqlite3, as the older nsys versions and hostile producers leave them.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from conftest import fixture_trace
from helpers.cli import run_cli, run_cli_process
from helpers.files import copy_export
from realtraces import trace_path

GRAPHS = "h100_host_cudagraph"  # 0.7 MB, one rank, NVTX "step" ranges, compute-bound
# A GpuInfo value as nsys 2022.2 wrote it: "NVIDIA" and then bytes that are no UTF-8.
GPU_INFO = bytes.fromhex("4e5649444941fffe804131303020")


def constructed(tmp_path: Path, name: str, *edits: tuple[str, tuple]) -> Path:
    """CONSTRUCTED: a copy of the GRAPHS fixture with ``edits`` (SQL, parameters) applied."""
    path = copy_export(fixture_trace(GRAPHS), tmp_path / name)
    with sqlite3.connect(path) as con:
        for sql, params in edits:
            con.execute(sql, params)
    con.close()
    return path


def report(path: Path, *args: str) -> dict:
    result = run_cli_process("analyze", path, "-f", "json", "-q", "--no-cache", *args)
    # a Rust panic or a Python traceback would reach stderr even when the exit code is 0
    assert result.code == 0 and result.stderr == "", result.stderr
    return json.loads(result.stdout)


def test_system_env_with_bytes_that_are_not_utf8_loads(tmp_path: Path) -> None:
    """Constructed: a GpuInfo row whose TEXT value holds bytes that are not UTF-8 (nsys 2022.2
    and 2022.3 write them so); the export was refused as "corrupt or unreadable database"."""
    path = constructed(
        tmp_path,
        "env.sqlite",
        (
            "INSERT INTO TARGET_INFO_SYSTEM_ENV(globalVid, devStateName, name, nameEnum, value) "
            "VALUES (281474976710656, 'Local (CLI)', 'GpuInfo', 9999, CAST(? AS TEXT))",
            (GPU_INFO,),
        ),
    )
    plain = report(fixture_trace(GRAPHS))
    got = report(path)
    assert got["classification"] == plain["classification"]
    assert got["metrics"] == plain["metrics"]
    # only the Hostname row is read: the bad bytes are never decoded, so nothing is repaired
    assert got["capture"]["repaired_strings"] == {}


def test_hostname_that_is_not_utf8_is_repaired_and_counted(tmp_path: Path) -> None:
    from traceclf.ingest.devices import read_session
    from traceclf.ingest.reader import Reader
    from traceclf.ingest.schema import inspect_export

    path = constructed(
        tmp_path,
        "host.sqlite",
        (
            "UPDATE TARGET_INFO_SYSTEM_ENV SET value = CAST(? AS TEXT) WHERE name = 'Hostname'",
            (b"node\xff7",),
        ),
    )
    reader = Reader(inspect_export(path))
    assert read_session(reader)["host"] == "node\ufffd7"
    assert reader.repaired == {"TARGET_INFO_SYSTEM_ENV.value": 1}


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (
            (
                "UPDATE NVTX_EVENTS SET text = CAST(? AS TEXT) WHERE text = 'step 4'",
                (b"step\xff 4",),
            ),
            "NVTX_EVENTS.text",
        ),
        (
            (
                "UPDATE StringIds SET value = CAST(? AS TEXT) WHERE id = "
                "(SELECT shortName FROM CUPTI_ACTIVITY_KIND_KERNEL LIMIT 1)",
                (b"elementwise\xe9kernel",),
            ),
            "StringIds.value",
        ),
        (
            ("UPDATE TARGET_INFO_GPU SET name = CAST(? AS TEXT)", (b"NVIDIA \xc3\x28 H100",)),
            "TARGET_INFO_GPU.name",
        ),
    ],
    ids=["NVTX text", "kernel name in StringIds", "GPU name"],
)
def test_text_that_is_not_utf8_is_decoded_with_replacement_and_counted(
    tmp_path: Path, edit: tuple[str, tuple], where: str
) -> None:
    """Constructed: one string of the export holds bytes that are not UTF-8. It used to fail the
    whole read ("corrupt or unreadable database"), NVTX text with a Rust panic on stderr."""
    got = report(constructed(tmp_path, "text.sqlite", edit))
    assert got["classification"]["bound"] == "compute"
    assert got["capture"]["repaired_strings"] == {where: 1}
    shown = run_cli("analyze", tmp_path / "text.sqlite", "-f", "md", "-q", "--no-cache")
    assert shown.code == 0, shown.stderr
    assert f"{where} 1" in shown.stdout


def test_valid_exports_repair_nothing() -> None:
    assert report(fixture_trace("h100_comm_ep2"))["capture"]["repaired_strings"] == {}


@pytest.mark.parametrize(
    ("stem", "rank"),
    [
        ("run_rank3", [3]),
        ("trace_r1", [1]),
        ("prof_gpu0", [0]),
        ("rank_0", [0]),
        ("profile.rank12", [12]),
        ("node0_gpu3", [3]),
        ("ulysses_2gpu_1s_window", []),
        ("llama_8gpu_bs16", []),
        ("exp_r2s", []),
        ("node3", []),
    ],
)
def test_rank_numbers_come_from_rank_patterns_only(stem: str, rank: list[int]) -> None:
    from traceclf.pipeline.grouping import rank_in_name

    assert rank_in_name(stem) == rank


def test_one_file_of_two_ranks_named_like_a_rank_count_is_one_run(tmp_path: Path) -> None:
    """Constructed: the public two-GPU Ulysses export under a name with "_2gpu_1s" in it. It
    became two separate runs, "both are rank 1"."""
    path = copy_export(
        trace_path("ulysses_2gpu_forward_window"), tmp_path / "ulysses_2gpu_1s_window.sqlite"
    )
    got = report(path)
    assert "runs" not in got
    assert len(got["ranks"]) == 2
    assert got["grouping"]["decided_by"] == "one export"
