"""NCCL rank ids from the JSON payloads of NVTX rows (traceclf/ingest/session.py), found by a
scan of their own or, under step sampling, by pass 1's scan of the NVTX table
(traceclf/ingest/nvtx_rows.py): the same ranks either way.

No shared trace has payloads exported as JSON (their NCCL payloads are binary), so the rows
are constructed: a copy of the host-launch fixture with communicator-init payloads written
into some of its NVTX rows, scattered over the table, and other JSON that names no rank.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from conftest import FIXTURES

from traceclf.ingest import nvtx_rows, session
from traceclf.ingest.reader import Reader
from traceclf.ingest.schema import inspect_export
from traceclf.model.taxonomy import bundled
from traceclf.pipeline.analysis import AnalysisOptions, analyze_export
from traceclf.pipeline.twopass import event_rows

SOURCE = FIXTURES / "h100_host_launch_gpumetrics_trimmed.sqlite"
# (rowid, payload): ranks 5, 2 and 7 in rowid order, among payloads that name none
PAYLOADS = [
    (40, {"Rank": 5, "No. of ranks": 8}),
    (900, {"other": 1}),
    (1500, {"NCCL communicator ID": 9, "rank": 2}),
    (2200, {"Rank": "not a number"}),
    (2800, {"Rank": 7}),
]


@pytest.fixture(scope="module")
def with_payloads(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("payloads") / "payloads.sqlite"
    shutil.copy(SOURCE, path)
    with sqlite3.connect(path) as con:
        for rowid, payload in PAYLOADS:
            con.execute(
                "UPDATE NVTX_EVENTS SET jsonText = ? WHERE rowid = ?", (json.dumps(payload), rowid)
            )
    return path


def test_the_scan_finds_every_rank_named(with_payloads) -> None:
    assert session.nccl_ranks(with_payloads) == [2, 5, 7]
    assert session.session_info(with_payloads)["nccl_ranks"] == [2, 5, 7]
    assert session.session_info(with_payloads, payloads=False)["nccl_ranks"] == []


@pytest.mark.parametrize("cap", [None, 1, 3], ids=["all", "first", "first-three"])
def test_pass_one_finds_the_rows_the_scan_reads(with_payloads, cap, monkeypatch) -> None:
    """In blocks of 300 rowids (ten queries), with and without a cap on the rows kept: the
    same rows, so the same ranks (the first row alone names rank 5)."""
    monkeypatch.setattr(nvtx_rows, "SCAN_ROWS", 300)
    if cap is not None:
        monkeypatch.setattr(nvtx_rows, "MAX_PAYLOAD_ROWS", cap)
        monkeypatch.setattr(session, "MAX_PAYLOAD_ROWS", cap)
    _rows, rowids, _long = nvtx_rows.step_rows(
        Reader(inspect_export(with_payloads)), bundled().nvtx["step"]
    )
    named = [r for r, p in PAYLOADS if "Rank" in json.dumps(p) or "rank" in json.dumps(p)]
    assert rowids == named[:cap]
    assert session.nccl_ranks(with_payloads, rowids) == session.nccl_ranks(with_payloads)
    assert session.nccl_ranks(with_payloads, rowids) == {None: [2, 5, 7], 1: [5], 3: [2, 5]}[cap]


def test_an_export_without_payload_rows_reads_none(with_payloads) -> None:
    assert session.nccl_ranks(with_payloads, []) == []
    assert session.nccl_ranks(SOURCE) == []


@pytest.mark.parametrize("sampled", [False, True], ids=["whole", "step-sampling"])
def test_the_job_evidence_names_the_ranks(with_payloads, sampled, monkeypatch) -> None:
    """Read whole, the payloads are found by a scan of their own; under step sampling, by
    pass 1's (the rows then read by rowid)."""
    asked: list = []
    read = session._nccl_ranks
    monkeypatch.setattr(session, "_nccl_ranks", lambda con, r=None: asked.append(r) or read(con, r))
    budget = event_rows(with_payloads) // 3 if sampled else None
    opts = AnalysisOptions(quiet=True, use_cache=False, row_budget=budget)
    assert analyze_export(with_payloads, opts).job["nccl_ranks"] == [2, 5, 7]
    assert asked == [[40, 1500, 2200, 2800] if sampled else None]
