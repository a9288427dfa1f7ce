"""Step sampling (default) against --all-steps on real traces, and the reader under it.

A capture whose event rows fit the row budget is read whole, so on the shared traces the
default mode *is* --all-steps. To test the two-pass reader on them, the budget is set just
under each trace's rows: pass 1 finds the steps and chooses them, pass 2 reads only their
rows by rowid range, and every fraction must still be within 0.01 of --all-steps (the
independent computation: the whole capture, every step projected by the full NVTX → CUDA call
→ GPU join). A smaller budget makes it analyse a sample of the steady steps.

Exports built here (shuffled tables, negative rowids, unusable rows) are constructed from a
real one; each test says what it changes.
"""

from __future__ import annotations

import itertools
import shutil
import sqlite3
from functools import cache
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import FIXTURES

from traceclf.ingest import reader, rowindex
from traceclf.ingest.load import load_trace
from traceclf.ingest.rowindex import RowIndex
from traceclf.ingest.schema import inspect_export
from traceclf.measures import intervals
from traceclf.model.taxonomy import bundled
from traceclf.pipeline import pass2, twopass
from traceclf.pipeline.analysis import AnalysisOptions, analyze_inputs
from traceclf.pipeline.twopass import event_rows
from traceclf.report.contract import Report

EXTERNAL = FIXTURES / "external"
TRACES = sorted(FIXTURES.glob("*.sqlite")) + sorted(EXTERNAL.glob("*.sqlite"))
TOLERANCE = 0.01


@cache
def analysed(path: Path, budget: int | None) -> Report:
    """The report of ``path``: every step (budget None), or step sampling with ``budget``."""
    opts = AnalysisOptions(use_cache=False, quiet=True, jobs=1)
    if budget is None:
        opts = AnalysisOptions(use_cache=False, quiet=True, jobs=1, all_steps=True)
    else:
        opts = AnalysisOptions(use_cache=False, quiet=True, jobs=1, row_budget=budget)
    return analyze_inputs([str(path)], opts)


def fractions(report: Report) -> dict[str, float | None]:
    return {
        k: v for k, v in report.metrics.items() if k.endswith("_frac") and not isinstance(v, bool)
    }


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_default_mode_matches_all_steps(path: Path) -> None:
    default = analyze_inputs([str(path)], AnalysisOptions(use_cache=False, quiet=True, jobs=1))
    assert default.metrics == analysed(path, None).metrics  # it fits the budget: read whole
    assert default.steps["analysed"] == default.steps["used"]


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_two_pass_read_matches_all_steps(path: Path) -> None:
    everything, window = analysed(path, None), analysed(path, int(event_rows(path) * 0.95))
    assert window.steps["count"] == everything.steps["count"]
    assert window.steps["used"] == everything.steps["used"]
    assert window.steps["analysed"] == everything.steps["used"]  # all steady steps fitted
    expected, got = fractions(everything), fractions(window)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        if value is None:
            assert got[name] is None, name
        else:
            assert got[name] == pytest.approx(value, abs=TOLERANCE), name
    assert window.classification["bound"] == everything.classification["bound"]


@pytest.mark.parametrize("name", ["h100_comm_ep2", "h100_memory_offload", "h100_host_input_stall"])
def test_sampled_steps_are_spread_and_keep_the_verdict(name: str) -> None:
    path = FIXTURES / f"{name}.sqlite"
    everything, sample = analysed(path, None), analysed(path, event_rows(path) // 3)
    assert 0 < sample.steps["analysed"] < sample.steps["used"] == everything.steps["used"]
    assert sample.classification["bound"] == everything.classification["bound"]
    # the analysed steps reach from the start of the steady state to its end
    steady = [i for i, s in enumerate(sample.ranks[0]["steps"]["steady"]) if s]
    breakdown = sample.series[0]["step_breakdown"]
    indexes = [row["index"] for row in breakdown]
    assert len(indexes) == sample.ranks[0]["steps"]["analysed"]
    assert indexes[0] == steady[0] and indexes[-1] >= steady[-1] - 1


def periods_of_one_kernel(tmp_path: Path, n: int) -> Path:
    """CONSTRUCTED from h100_compute_low_occupancy: its graphs and CUDA calls dropped and its
    kernels replaced by ``n`` copies of its first, one every 10 µs (2 µs each): a capture whose
    only step anchor is a recurring kernel, ``n`` periods of it, within the row budget."""
    path = Path(shutil.copy(FIXTURES / "h100_compute_low_occupancy.sqlite", tmp_path / "p.sqlite"))
    columns = [
        row[1]
        for row in sqlite3.connect(path).execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)")
    ]
    copied = (
        ", ".join(
            {"start": "k.start + i * 10000", "end": "k.start + i * 10000 + 2000"}.get(c, f"k.{c}")
            for c in columns
        )
        .replace("k.correlationId", "i + 1")
        .replace("k.graphNodeId", "NULL")
    )
    with sqlite3.connect(path) as con:
        con.executescript(
            "CREATE TEMP TABLE k AS SELECT * FROM CUPTI_ACTIVITY_KIND_KERNEL LIMIT 1;"
            "DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL; DROP TABLE CUPTI_ACTIVITY_KIND_RUNTIME;"
            "DELETE FROM CUPTI_ACTIVITY_KIND_GRAPH_TRACE; DELETE FROM CUDA_GRAPH_EVENTS;"
            f"WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {n - 1})"
            f" INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL SELECT {copied} FROM n, temp.k;"
        )
    con.close()
    return path


def test_a_capture_read_whole_analyses_no_more_steps_than_a_sampled_one(tmp_path: Path) -> None:
    """Within the row budget a capture is read whole, but no more than STEP_BUDGET steady steps
    are analysed, in the runs step sampling chooses: a million 10 µs periods of one kernel (1 M
    rows, within the budget) had analysed a million steps, 41 s and 8 GB, for a report of a
    million step rows. The same export read by step sampling (its budget just under its rows)
    analyses the same steps and measures the same; --all-steps analyses every one."""
    path = periods_of_one_kernel(tmp_path, 3000)
    whole = analyze_inputs([str(path)], AnalysisOptions(use_cache=False, quiet=True, jobs=1))
    sampled = analysed(path, 2000)
    assert whole.capture["read_path"] == "whole" and sampled.capture["read_path"] != "whole"
    assert whole.steps["count"] == 3000 and whole.steps["source"] == "pattern"
    assert whole.steps["analysed"] == twopass.STEP_BUDGET == sampled.steps["analysed"]
    assert [row["index"] for row in whole.series[0]["step_breakdown"]] == [
        row["index"] for row in sampled.series[0]["step_breakdown"]
    ]
    assert whole.steps["window_ns"] == sampled.steps["window_ns"]
    assert fractions(whole) == pytest.approx(fractions(sampled), abs=1e-6)
    assert analysed(path, None).steps["analysed"] == whole.steps["used"]


def test_ranks_read_whole_analyse_the_same_steps(monkeypatch) -> None:
    """The ranks of an export read whole, capped as a sampled read's are (the cap lowered to
    4 of h100_comm_ep2's 8 steady steps), analyse the same steps, so that their collectives
    are matched as --all-steps matches them: one group of like ranks."""
    monkeypatch.setattr(twopass, "STEP_BUDGET", 4)
    path = FIXTURES / "h100_comm_ep2.sqlite"
    capped = analyze_inputs([str(path)], AnalysisOptions(use_cache=False, quiet=True, jobs=1))
    chosen = [[row["index"] for row in series["step_breakdown"]] for series in capped.series]
    assert len(chosen) == 2 and chosen[0] == chosen[1] and len(chosen[0]) == 4
    assert capped.steps["analysed"] == 4 and capped.steps["used"] == 8
    everything = analysed(path, None)
    assert capped.cross_rank["rank_groups"] == everything.cross_rank["rank_groups"] == [[0, 1]]
    assert capped.cross_rank["collectives_matched"] > 0


def test_steady_ranges_that_differ_are_capped_to_the_steps_every_rank_has() -> None:
    """CONSTRUCTED step tables (no export has a rank whose warm-up lasts longer than the
    other's by this much): 400 steps each, steady from position 1 on one rank and 9 on the
    other. Capped at 256 each on its own, they would share 192 steps; capped alike, both
    analyse the same 256 of the steps both have steady; one rank alone is capped within its
    own steady range, and a rank with no more steps than the cap keeps them all."""
    from traceclf.steps.plan import at_most_alike
    from traceclf.steps.settings import bundled_settings
    from traceclf.steps.steady import Steps

    def steps(first: int, n: int = 400) -> Steps:
        table = pl.DataFrame(
            {
                "index": range(n),
                "name": ["step"] * n,
                "gpu_start": [i * 1000 for i in range(n)],
                "gpu_end": [i * 1000 + 900 for i in range(n)],
                "duration": [1000] * n,
                "complete": [i < n - 1 for i in range(n)],
                "steady": [first <= i < n - 1 for i in range(n)],
                "outlier": [False] * n,
            }
        )
        return Steps("nvtx", table, (first * 1000, (n - 1) * 1000), "step")

    def chosen(s: Steps) -> list[int]:
        return s.table.filter(pl.col("analysed"))["index"].to_list()

    settings = bundled_settings()
    a, b = at_most_alike([steps(1), steps(9)], 256, settings)
    assert chosen(a) == chosen(b) and len(chosen(a)) == 256
    assert min(chosen(a)) == 9 and max(chosen(a)) == 398
    assert a.spans == b.spans and a.wall == 256 * 1000
    (alone,) = at_most_alike([steps(1)], 256, settings)
    assert len(chosen(alone)) == 256 and min(chosen(alone)) == 1
    few = steps(1, 100)
    assert at_most_alike([few], 256, settings) == [few]


@pytest.mark.parametrize("third", [False, True], ids=["whole", "a third"])
def test_ranks_measured_two_at_a_time_report_as_one_at_a_time(third: bool, monkeypatch) -> None:
    """Without --all-steps the ranks of one export are measured two at a time where two
    cores may be kept busy (traceclf/support/cpus.py: two_at_a_time): the report is the one
    measured a rank after another, read whole (it fits the budget) or at a third of its
    rows."""
    from traceclf.support import cpus

    path = FIXTURES / "h100_comm_ep2.sqlite"
    budget = event_rows(path) // 3 if third else None
    reports = []
    for n in (1, 2):
        monkeypatch.setattr(cpus, "cpus", lambda n=n: n)
        opts = AnalysisOptions(use_cache=False, quiet=True, jobs=1, row_budget=budget)
        reports.append(analyze_inputs([str(path)], opts).to_dict())
    assert len(reports[0]["ranks"]) == 2
    assert reports[0] == reports[1]


def paired_collectives(path: Path, budget: int | None, monkeypatch) -> tuple[set, Report]:
    """The collective kernels each matched instance pairs, as sets of (rank, start ns), and the
    report: what :func:`traceclf.measures.collectives.matched` returned, caught on its way."""
    from traceclf.measures import collectives

    caught = []

    def spy(ranks):
        caught.append(collectives.matched.__wrapped__(ranks))
        return caught[-1]

    spy.__wrapped__ = collectives.matched  # type: ignore[attr-defined]
    monkeypatch.setattr(collectives, "matched", spy)
    opts = AnalysisOptions(use_cache=False, quiet=True, jobs=1, all_steps=budget is None)
    if budget is not None:
        opts = AnalysisOptions(use_cache=False, quiet=True, jobs=1, row_budget=budget)
    report = analyze_inputs([str(path)], opts)
    monkeypatch.undo()
    (m,) = caught
    full = collectives._full(m.instances)
    pairs = full.group_by("ordinal", "kind", "instance").agg(pl.struct("rank", "start"))
    return {frozenset((d["rank"], d["start"]) for d in row) for row in pairs["rank"]}, report


@pytest.mark.parametrize("name", ["h100_comm_ep2", "h100_nccl_groups"])
def test_sampled_ranks_analyse_the_same_steps_and_pair_collectives_as_all_steps(
    name: str, monkeypatch
) -> None:
    """Two ranks of one export, a third of the rows: both ranks analyse the same steps, and
    every instance matched pairs the kernels that ``--all-steps`` (every collective in one
    sequence) pairs. Each rank's list holds only its analysed runs, whose edges hold
    different collectives: numbered from the first, the ranks' sequences drift run by run
    (a 1.1 GB two-rank export read "rank 1 3,442,188 ms per step late" with 117 ms steps)."""
    path = FIXTURES / f"{name}.sqlite"
    everything, _ = paired_collectives(path, None, monkeypatch)
    sampled, report = paired_collectives(path, event_rows(path) // 3, monkeypatch)
    assert 0 < report.steps["analysed"] < report.steps["used"]
    steps = [[row["index"] for row in s["step_breakdown"]] for s in report.series]
    assert len(steps) == 2 and steps[0] == steps[1]
    assert len(sampled) >= 2 * report.steps["analysed"]  # two or more collectives a step
    assert sampled <= everything
    assert report.cross_rank["late_arrivals_left_out"] == 0
    # the report says where they were matched
    from traceclf.render.content import budget_rows

    across = dict(budget_rows(report))["Across ranks"]
    assert f"{len(sampled)} collectives matched" in across
    assert "steps sampled: where every rank's analysed steps meet" in across


# ------------------------------------------------------------------------- the reader


def copy_of(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copy(FIXTURES / f"{name}.sqlite", tmp_path / f"{name}.sqlite"))


def rewrite(con: sqlite3.Connection, table: str, columns: list[str], rows: list) -> None:
    """Replace ``table``'s rows with ``rows`` (values of ``columns``), at rowids 1, 2, ... in
    the order given: rows written as nsys would have flushed them."""
    con.execute(f"DELETE FROM {table}")
    names = ", ".join(f'"{c}"' for c in columns)
    marks = ", ".join("?" * (len(columns) + 1))
    con.executemany(
        f"INSERT INTO {table} (rowid, {names}) VALUES ({marks})",
        [(i + 1, *row) for i, row in enumerate(rows)],
    )


def reorder(path: Path, table: str, order: str) -> None:
    """Rewrite ``table`` with its rows inserted in ``order`` (an SQL ORDER BY), so their rowids
    no longer follow ``start``; the rows themselves are unchanged."""
    with sqlite3.connect(path) as con:
        con.execute(f"CREATE TABLE tmp AS SELECT * FROM {table} ORDER BY {order}")
        con.execute(f"DELETE FROM {table}")
        con.execute(f"INSERT INTO {table} SELECT * FROM tmp")
        con.execute("DROP TABLE tmp")


def test_rowindex_bounds_match_a_scan(tmp_path: Path) -> None:
    path = FIXTURES / "h100_comm_ep2_overlap.sqlite"
    table = "CUPTI_ACTIVITY_KIND_RUNTIME"
    with rowindex.connect(path) as con:
        index = RowIndex.build(con, table, samples=64)
        starts = np.array([r[0] for r in con.execute(f"SELECT start FROM {table} ORDER BY rowid")])
        assert index is not None and index.ordered and index.rows == len(starts)
        rng = np.random.default_rng(7)
        for lo, hi in np.sort(rng.integers(starts[0] - 10, starts[-1] + 10, (50, 2)), axis=1):
            after, upto = index.bounds(int(lo), int(hi))
            inside = np.flatnonzero((starts >= lo) & (starts <= hi)) + 1  # rowids are 1..n
            if len(inside):
                assert after < inside[0] and upto >= inside[-1]
                assert upto - after == len(inside)  # and nothing more: exact by binary search


def test_rowindex_bounds_hold_across_missing_rowids(tmp_path: Path) -> None:
    """Constructed: CUDA calls with a block of rows deleted and every 7th row gone (rowids no
    longer dense): each search ends, and the rowid range holds exactly the rows in time."""
    path = copy_of(tmp_path, "h100_comm_ep2_overlap")
    table = "CUPTI_ACTIVITY_KIND_RUNTIME"
    with sqlite3.connect(path) as con:
        con.execute(f"DELETE FROM {table} WHERE rowid BETWEEN 1000 AND 3000 OR rowid % 7 = 0")
    with rowindex.connect(path) as con:
        index = RowIndex.build(con, table, samples=64)
        rows = np.array(con.execute(f"SELECT rowid, start FROM {table} ORDER BY rowid").fetchall())
        assert index is not None and index.ordered
        rng = np.random.default_rng(11)
        for lo, hi in np.sort(rng.integers(rows[0, 1] - 10, rows[-1, 1] + 10, (80, 2)), axis=1):
            after, upto = index.bounds(int(lo), int(hi))
            inside = rows[(rows[:, 1] >= lo) & (rows[:, 1] <= hi), 0]
            in_range = rows[(rows[:, 0] > after) & (rows[:, 0] <= upto), 0]
            assert np.array_equal(in_range, inside)


def test_shuffled_rows_are_seen_and_read_by_filtered_scan(tmp_path: Path) -> None:
    """Constructed: the kernel rows of a graph-stepped trace (exact GPU steps from pass 1)
    in random order: the sampled order check fails, pass 2 scans with a time filter."""
    path = copy_of(tmp_path, "h100_compute_low_occupancy")
    reorder(path, "CUPTI_ACTIVITY_KIND_KERNEL", "random()")
    with rowindex.connect(path) as con:
        assert not RowIndex.build(con, "CUPTI_ACTIVITY_KIND_KERNEL").ordered
    original = FIXTURES / "h100_compute_low_occupancy.sqlite"
    budget = int(event_rows(original) * 0.95)
    read = twopass.load_sampled(path, bundled(), budget=budget)
    assert read.plans  # step sampling, not a whole read
    assert read.trace.kernels["start"].is_sorted()
    assert fractions(analysed(path, budget)) == fractions(analysed(original, budget))


def test_shuffled_calls_are_read_by_filtered_scan(tmp_path: Path) -> None:
    """Constructed: CUDA calls in random order, so NVTX steps cannot be projected by rowid
    range before reading: warm-up is decided on the steps' CPU durations, the calls are read
    by a filtered scan on time (never the whole capture), and the verdict and the time shares
    are still --all-steps'. (Fewer complete steps are analysed, 3 of 8 here, so the critical
    path's blocking shares and the short-kernel share move more, and the share of the step
    spread that host pauses explain needs 3 steps: not compared.)"""
    path = copy_of(tmp_path, "h100_comm_ep2")
    # (a fixed shuffle, not random(): the same rows in the same order on every run)
    reorder(path, "CUPTI_ACTIVITY_KIND_RUNTIME", "(rowid * 2654435761) % 1000003")
    budget = event_rows(path) // 2
    read = twopass.load_sampled(path, bundled(), budget=budget)
    assert read.plans and read.trace.read_path == "filtered_scan"
    assert read.trace.api.height < load_trace(path).api.height
    window, everything = analysed(path, budget), analysed(FIXTURES / "h100_comm_ep2.sqlite", None)
    assert window.capture["read_path"] == "filtered_scan"
    assert window.classification["bound"] == everything.classification["bound"]
    moved = {"blocking_frac", "blocking_comm_frac", "attribution_residual_frac"}
    moved |= {"short_kernel_frac", "step_spread_pause_frac"}
    for name, value in fractions(everything).items():
        if value is not None and name not in moved:
            assert fractions(window)[name] == pytest.approx(value, abs=TOLERANCE), name


def swap_blocks(path: Path, table: str, rows: int) -> None:
    """Rewrite ``table`` with each pair of blocks of ``rows`` rows in reverse order (block 1,
    block 0, block 3, block 2, ...), as nsys writes when it flushes buffers out of order."""
    block = f"((rowid - 1) / {rows})"
    reorder(path, table, f"{block} + 1 - 2 * ({block} % 2), rowid")


def test_tables_out_of_order_in_blocks_are_read_in_pieces(tmp_path: Path) -> None:
    """Constructed: CUDA calls and kernels written in swapped blocks. One scan finds each
    table's ordered pieces; the steps are projected and read by rowid ranges within them,
    so the analysis is that of the export in order."""
    name = "h100_comm_ep2"
    path = copy_of(tmp_path, name)
    swap_blocks(path, "CUPTI_ACTIVITY_KIND_RUNTIME", 1000)
    swap_blocks(path, "CUPTI_ACTIVITY_KIND_KERNEL", 300)
    with rowindex.connect(path) as con:
        index = RowIndex.build(con, "CUPTI_ACTIVITY_KIND_RUNTIME")
        assert not index.ordered
        pieces = rowindex.scan_pieces(con, index, reader.Reader(inspect_export(path)).sql)
        assert pieces is not None and len(pieces.pieces) > 5
        starts = con.execute("SELECT rowid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME").fetchall()
        ids, times = np.array(starts).T
        for lo, hi in np.quantile(times, [[0.1, 0.2], [0.33, 0.34], [0.5, 0.9]]).astype(int):
            ranges = pieces.ranges(int(lo), int(hi))
            got = np.zeros(len(ids), dtype=bool)
            for after, upto in ranges:
                got |= (ids > after) & (ids <= upto)
            assert np.array_equal(got, (times >= lo) & (times <= hi))
    budget = event_rows(path) // 2
    read = twopass.load_sampled(path, bundled(), budget=budget)
    assert read.plans and read.trace.read_path == "ordered_pieces"
    assert read.trace.kernels["start"].is_sorted() and read.trace.api["start"].is_sorted()
    original = FIXTURES / f"{name}.sqlite"
    assert twopass.load_sampled(original, bundled(), budget=budget).trace.read_path == (
        "rowid_ranges"
    )
    window = analysed(path, budget)
    assert window.capture["read_path"] == "ordered_pieces"
    assert window.metrics == analysed(original, budget).metrics
    with sqlite3.connect(path) as con:  # a time of another type: that row is no time
        con.execute("UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET start = 'x' WHERE rowid = 5")
    assert twopass.load_sampled(path, bundled(), budget=budget).trace.read_path == (
        "ordered_pieces"
    )


@pytest.mark.parametrize("holes", [False, True])
def test_order_scan_is_exact_in_small_blocks_with_or_without_holes(
    tmp_path: Path, monkeypatch, holes: bool
) -> None:
    """Constructed: CUDA calls in swapped blocks, scanned in blocks of 1,000 rows (each read
    as one rowid range per core on its own thread), with every 13th row deleted or not (a
    block with holes reads its rowids; a dense one has them from positions): each time range
    is exactly the rowid ranges the pieces give."""
    path = copy_of(tmp_path, "h100_comm_ep2")
    table = "CUPTI_ACTIVITY_KIND_RUNTIME"
    swap_blocks(path, table, 700)
    if holes:
        with sqlite3.connect(path) as con:
            con.execute(f"DELETE FROM {table} WHERE rowid % 13 = 0")
    monkeypatch.setattr(rowindex, "SCAN_ROWS", 1000)
    with rowindex.connect(path) as con:
        index = RowIndex.build(con, table)
        pieces = rowindex.scan_pieces(con, index, reader.Reader(inspect_export(path)).sql)
        assert pieces is not None and len(pieces.pieces) > 5
        ids, times = np.array(con.execute(f"SELECT rowid, start FROM {table}").fetchall()).T
        rng = np.random.default_rng(3)
        for lo, hi in np.sort(rng.choice(times, (40, 2)), axis=1):
            got = np.zeros(len(ids), dtype=bool)
            for after, upto in pieces.ranges(int(lo), int(hi)):
                got |= (ids > after) & (ids <= upto)
            assert np.array_equal(got, (times >= lo) & (times <= hi))


def test_rows_out_of_order_between_samples_are_caught_after_reading(tmp_path: Path) -> None:
    """Constructed: two kernel rows that no sample hits trade places, so the samples look in
    order but a rowid range read holds rows out of start order: that table is read again
    with a filtered scan, and nothing is lost."""
    name = "h100_compute_low_occupancy"
    path = copy_of(tmp_path, name)
    table = "CUPTI_ACTIVITY_KIND_KERNEL"
    with sqlite3.connect(path) as con:
        n = con.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0]
        sampled = set(np.unique(np.linspace(1, n, num=min(rowindex.SAMPLES, n)).round()).tolist())
        a = next(r for r in range(n // 2, n) if r not in sampled and r + 1 not in sampled)
        cols = [c[1] for c in con.execute(f"PRAGMA table_info('{table}')")]
        rows = {
            r: con.execute(f"SELECT * FROM {table} WHERE rowid = {r}").fetchone()
            for r in (a, a + 1)
        }
        sets = ", ".join(f'"{c}" = ?' for c in cols)
        con.execute(f"UPDATE {table} SET {sets} WHERE rowid = {a}", rows[a + 1])
        con.execute(f"UPDATE {table} SET {sets} WHERE rowid = {a + 1}", rows[a])
    with rowindex.connect(path) as con:
        assert RowIndex.build(con, table).ordered  # the samples do not show it
    budget = int(event_rows(path) * 0.95)
    read = twopass.load_sampled(path, bundled(), budget=budget)
    assert read.plans and read.trace.kernels["start"].is_sorted()
    assert read.trace.kernels.height == load_trace(path).kernels.height
    original = FIXTURES / f"{name}.sqlite"
    assert fractions(analysed(path, budget)) == fractions(analysed(original, budget))


def test_rows_with_rowid_at_or_below_zero_are_read(tmp_path: Path, monkeypatch) -> None:
    """Constructed: kernel rowids shifted to start at -99. Partitioned reads (forced for this
    small table) and step sampling's rowid ranges must still read every row."""
    path = copy_of(tmp_path, "h100_comm_ep2")
    table = "CUPTI_ACTIVITY_KIND_KERNEL"
    with sqlite3.connect(path) as con:
        con.execute(f"UPDATE {table} SET rowid = rowid - 100")
        rows = con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        assert con.execute(f"SELECT count(*) FROM {table} WHERE rowid <= 0").fetchone()[0] == 100
    monkeypatch.setattr(reader, "PARTITION_MIN_ROWS", 1)
    assert load_trace(path).kernels.height == rows
    budget = int(event_rows(path) * 0.95)
    window = twopass.load_sampled(path, bundled(), budget=budget)
    assert window.plans
    lo, hi = window.trace.read_spans[0][0], window.trace.read_spans[-1][1]
    everything = load_trace(path).kernels.filter((pl.col("start") <= hi) & (pl.col("end") >= lo))
    assert window.trace.kernels.height >= everything.height


def test_unusable_rows_are_counted_and_left_out(tmp_path: Path) -> None:
    """Constructed: 3 kernels ending before they start, 2 kernels and 1 memcpy with no
    process, 4 CUDA calls with no thread (times are NOT NULL in the nsys schema)."""
    path = copy_of(tmp_path, "h100_comm_ep2")
    with sqlite3.connect(path) as con:
        con.execute(
            'UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET "end" = start - 1 WHERE rowid IN (10, 11, 12)'
        )
        con.execute(
            "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET globalPid = NULL WHERE rowid IN (20, 21)"
        )
        con.execute("UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET globalPid = NULL WHERE rowid = 5")
        con.execute(
            "UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET globalTid = NULL WHERE rowid IN (30, 31, 32, 33)"
        )
        kernels_total = con.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
    trace = load_trace(path)
    assert trace.unusable_rows == {
        "api.no_process": 4,
        "kernels.end_before_start": 3,
        "kernels.no_process": 2,
        "memcpy.no_process": 1,
    }
    assert trace.kernels.height == kernels_total - 5
    report = analyze_inputs([str(path)], AnalysisOptions(use_cache=False, quiet=True))
    assert report.inputs[0]["unusable_rows"] == trace.unusable_rows


def test_host_tables_of_the_window_are_the_rows_a_filtered_scan_finds() -> None:
    """The OS runtime calls, samples and scheduling of the analysed steps: the rows the
    filtered scan of each table finds, on the slow-loader capture (tables out of order)."""
    from traceclf.ingest.hosttables import read_host_side
    from traceclf.ingest.reader import Reader

    path = FIXTURES / "h100_host_slow_loader.sqlite"
    read = twopass.load_sampled(path, bundled(), budget=event_rows(path) // 3)
    assert read.plans and read.trace.read_spans
    scanned = read_host_side(
        Reader(inspect_export(path)),
        read.trace.api["global_tid"].unique().to_list(),
        read.trace.read_spans,
    )
    for name in ("osrt", "samples", "sched"):
        got, want = getattr(read.trace, name), getattr(scanned, name)
        assert not want.is_empty(), name
        assert got.equals(want), name


def test_a_host_read_begun_early_is_taken_only_for_the_same_threads_and_spans() -> None:
    """Step sampling begins the host side's read once the CUDA calls are read, beside the
    GPU's rows (traceclf/ingest/assemble.py: begin_host_read). Calls read again that other
    threads made (a rescan), or other spans, begin the read anew, after the first is done:
    the trace holds the rows of the threads its calls name, and no read is left running."""
    from traceclf.ingest.assemble import begin_host_read
    from traceclf.ingest.hosttables import read_host_side
    from traceclf.ingest.reader import Reader

    path = FIXTURES / "h100_host_slow_loader.sqlite"
    reader = Reader(inspect_export(path))
    calls = reader.read("api")
    threads = calls["global_tid"].unique().sort()
    spans = ((0, 1 << 62),)
    begun = begin_host_read(reader, calls, spans)
    assert begun.threads == frozenset(threads.to_list())
    assert begin_host_read(reader, calls, spans, begun) is begun
    main = begun.future.result().osrt["global_tid"].mode()[0]  # (the busiest CUDA thread)
    fewer = calls.filter(pl.col("global_tid") == main)
    again = begin_host_read(reader, fewer, spans, begun)
    assert again is not begun and begun.future.done()
    assert again.threads == frozenset([main])
    osrt = again.future.result().osrt
    assert not osrt.is_empty() and osrt.equals(read_host_side(reader, [main], spans).osrt)
    elsewhere = begin_host_read(reader, calls, ((0, 1),), begun)
    assert elsewhere is not begun and elsewhere.future.result().osrt.is_empty()


def test_a_late_block_of_host_rows_that_the_order_check_misses_is_read(tmp_path: Path) -> None:
    """CONSTRUCTED from the slow-loader capture: its OS runtime calls rewritten as nsys flushes
    thread buffers in a long capture, the main CUDA thread's calls in start order with a block
    of five calls of the second CUDA thread (calls of the analysed steps) written early in the
    table, between two of the rows the order check samples. The samples are in start order
    (the check is fooled, as on the 4.3 GB benchmark input, where a rowid-range read left out
    17 of 96 waits of the autograd thread), and the five calls are read all the same."""
    src = FIXTURES / "h100_host_slow_loader.sqlite"
    budget = event_rows(src) // 3
    spans = twopass.load_sampled(src, bundled(), budget=budget).trace.read_spans
    path = copy_of(tmp_path, "h100_host_slow_loader")
    with sqlite3.connect(path) as con:
        calls = dict(  # OS runtime calls of each thread that made CUDA calls
            con.execute(
                "SELECT globalTid, count(*) FROM OSRT_API WHERE globalTid IN "
                "(SELECT globalTid FROM CUPTI_ACTIVITY_KIND_RUNTIME) GROUP BY globalTid"
            ).fetchall()
        )
        main, second = sorted(calls, key=calls.__getitem__, reverse=True)[:2]
        columns = [r[1] for r in con.execute("PRAGMA table_info(OSRT_API)")]
        keep, start = ", ".join(f'"{c}"' for c in columns), columns.index("start")
        outer = "coalesce(nestingLevel, 0) = 0"
        mains = con.execute(
            f"SELECT {keep} FROM OSRT_API WHERE globalTid = ? ORDER BY rowid", (main,)
        ).fetchall()
        block = con.execute(
            f"SELECT {keep} FROM OSRT_API WHERE globalTid = ? AND {outer} "
            f"AND {reader.overlap_clause(list(spans))} ORDER BY start LIMIT 5",
            (second,),
        ).fetchall()
        assert len(block) == 5
        n = len(mains) + len(block)
        sampled = np.unique(np.linspace(1, n, num=min(rowindex.SAMPLES, n)).round()).astype(int)
        # between two samples a tenth of the way in: rows of that time, long before the block's
        at = next(int(a) for a, b in itertools.pairwise(sampled) if a > n // 10 and b - a > 5)
        rows = mains[:at] + block + mains[at:]
        rewrite(con, "OSRT_API", columns, rows)
        index = RowIndex.build(con, "OSRT_API")
        assert index is not None and index.ordered  # what the samples show
        assert block[0][start] > mains[at][start]  # what they do not: it is out of order
    con.close()
    read = twopass.load_sampled(path, bundled(), budget=budget)
    assert read.trace.read_spans == spans
    got = read.trace.osrt.filter(pl.col("global_tid") == second)["start"].to_list()
    assert {row[start] for row in block} <= set(got)


def test_a_late_block_of_cuda_calls_that_the_order_check_misses_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CONSTRUCTED from the slow-loader capture: its CUDA calls rewritten as nsys flushes a
    thread's buffer late, five kernel launches of the second CUDA thread made inside the
    analysed steps moved to a later place in the table, between two analysed spans (outside
    every rowid range read) and between two of the rows the order check samples (as in a multi-process capture, whose
    calls hold blocks of each process's threads). The samples are in start order, the rows
    read are too; the kernels read name calls between the first and the last call read of
    their span, and the calls are read again by a filtered scan."""
    src = FIXTURES / "h100_host_slow_loader.sqlite"
    budget = event_rows(src) // 3
    untouched = twopass.load_sampled(src, bundled(), budget=budget).trace
    spans = untouched.read_spans
    path = copy_of(tmp_path, "h100_host_slow_loader")
    with sqlite3.connect(path) as con:
        table = "CUPTI_ACTIVITY_KIND_RUNTIME"
        columns = [r[1] for r in con.execute(f"PRAGMA table_info({table})")]
        keep = ", ".join(f'"{c}"' for c in columns)
        threads = con.execute(
            f"SELECT globalTid FROM {table} GROUP BY globalTid ORDER BY count(*) DESC"
        ).fetchall()
        second = threads[1][0]
        rows = con.execute(f"SELECT rowid, {keep} FROM {table} ORDER BY rowid").fetchall()
        launched = {
            c for (c,) in con.execute("SELECT correlationId FROM CUPTI_ACTIVITY_KIND_KERNEL")
        }
        corr, start = (columns.index(c) + 1 for c in ("correlationId", "start"))
        inside = reader.overlap_clause(list(spans), "start + 1")
        block_ids = {
            r
            for (r,) in con.execute(
                f"SELECT rowid FROM {table} WHERE globalTid = ? AND {inside} ORDER BY start",
                (second,),
            )
            if rows[r - 1][corr] in launched
        }
        block_ids = set(sorted(block_ids)[:5])
        assert len(block_ids) == 5
        block = [r for r in rows if r[0] in block_ids]
        rest = [r for r in rows if r[0] not in block_ids]
        # written later, where the calls read by rowid range are not: in the middle of a gap
        # between analysed spans after the block's own, and between two sampled rowids
        merged = sorted(spans)
        gaps = [(a[1] + b[0]) // 2 for a, b in itertools.pairwise(merged) if a[1] < b[0]]
        mid = next(t for t in gaps if t > block[-1][start])
        at = next(i for i, r in enumerate(rest) if r[start] >= mid)
        sampled = set(np.linspace(1, len(rows), num=rowindex.SAMPLES).round().astype(int))
        while sampled & set(range(at, at + len(block) + 2)):
            at += 1
        moved = [*rest[:at], *block, *rest[at:]]
        rewrite(con, table, columns, [row[1:] for row in moved])
        index = RowIndex.build(con, table)
        assert index is not None and index.ordered  # what the samples show
        assert block[0][start] < rest[at - 1][start]  # what they do not: it is out of order
    con.close()
    flagged = []
    unread = pass2.unread_calls

    def spy(calls, work, spans):
        flagged.append(unread(calls, work, spans).height)
        return unread(calls, work, spans)

    monkeypatch.setattr(pass2, "unread_calls", spy)
    read = twopass.load_sampled(path, bundled(), budget=budget)
    assert read.trace.read_spans == spans
    assert flagged == [5]  # the rows read were in order: the launches gave them away
    assert read.trace.read_path == "rescanned"
    got = set(read.trace.api.filter(pl.col("global_tid") == second)["correlation_id"])
    assert {row[corr] for row in block} <= got
    # and no more than the rowid ranges of the capture as written stand for: the calls that
    # start inside the spans (a filtered scan also finds those that began before one)
    order = ["start", "correlation_id"]
    assert read.trace.api.sort(order).equals(untouched.api.sort(order))


def test_unread_calls_are_the_launches_numbered_among_the_calls_read() -> None:
    """CONSTRUCTED frames: GPU work whose call number lies between the first and the last
    call of its process that started inside a span, with no such call read, is flagged; work
    of calls numbered outside that range, of a call read, or of another process is not."""
    calls = pl.DataFrame(
        {
            "start": [5, 10, 20, 30, 100, 110, 12],
            "pid": [1, 1, 1, 1, 1, 1, 2],
            "correlation_id": [1, 2, 4, 6, 20, 22, 3],
        }
    )
    work = pl.DataFrame(
        {
            "pid": [1, 1, 1, 1, 1, 2, 1, 1],
            "correlation_id": [2, 3, 5, 7, 21, 5, 1, 15],
        }
    )
    got = pass2.unread_calls(calls, [work], [(8, 40), (90, 120)])
    # 3 and 5: between calls 2 and 6 of span one; 21: between 20 and 22 of span two. Not 1
    # or 2 (their calls were read), 7 and 15 (numbered after span one's last call inside it
    # and before span two's first) or pid 2's 5 (pid 2's only call is 3).
    assert sorted(got["correlation_id"]) == [3, 5, 21]
    assert set(got["pid"]) == {1}
    # a span's ends belong to it: calls starting at 10 and 30 bracket 3 and 5 as before
    assert sorted(pass2.unread_calls(calls, [work], [(10, 30)])["correlation_id"]) == [3, 5]
    # calls, none inside a span: nothing brackets the work
    assert pass2.unread_calls(calls, [work], [(200, 300)]).is_empty()
    assert pass2.unread_calls(calls.clear(), [work], [(8, 40)]).is_empty()


def test_overlap_clause_finds_the_rows_a_test_of_every_span_finds() -> None:
    """The filtered scan's test (a search over the sorted, merged spans in nested CASEs) keeps
    exactly the rows that overlap one of the spans as given: overlapping, touching, empty and
    inverted spans, rows of no length and rows without an end. (Constructed rows: the cases
    no real trace has all at once.)"""
    rng = np.random.default_rng(7)
    con = sqlite3.connect(":memory:")
    con.execute('CREATE TABLE t (start INTEGER, "end" INTEGER)')
    starts = rng.integers(0, 1000, 3000)
    ends = starts + rng.choice([0, 0, 1, 5, 50, 300], 3000)
    rows = [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)] + [(10, None)]
    con.executemany("INSERT INTO t VALUES (?, ?)", rows)
    for _ in range(500):
        lo = rng.integers(0, 1000, int(rng.integers(1, 14)))
        spans = [(int(a), int(a + rng.choice([-2, 0, 1, 3, 20, 100, 400]))) for a in lo]
        (got,) = con.execute(
            f"SELECT count(*) FROM t WHERE {reader.overlap_clause(spans)}"
        ).fetchone()
        want = sum(
            1 for s, e in rows if e is not None and any(s < hi and e > lo for lo, hi in spans)
        )
        assert got == want, spans


def test_clip_of_rows_in_start_order_cuts_them_as_a_search_among_the_spans_does(
    monkeypatch,
) -> None:
    """``intervals.clip`` to several spans cuts rows flagged in start order span by span
    (slices); the rows, their order and their clipped times are those of the search among the
    spans that it makes for fewer rows or rows in any order, including rows across a gap
    between spans (kept once per span: then it searches), rows in the gaps, rows of no length
    and touching spans. (Constructed rows: the cases no real trace has all at once.)"""
    rng = np.random.default_rng(11)
    sliced = []
    original = intervals._clip_sorted
    monkeypatch.setattr(
        intervals, "_clip_sorted", lambda df, spans: sliced.append(1) or original(df, spans)
    )
    for trial in range(2000):
        n = int(rng.integers(1, 40))
        start = np.sort(rng.integers(0, 100, n))
        end = start + rng.integers(0, 30 if trial % 3 else 3, n)
        rows = pl.DataFrame({"start": start, "end": end, "row": np.arange(n)})
        rows = rows.with_columns(pl.col("start").set_sorted())
        bounds = np.sort(rng.choice(np.arange(130), 2 * int(rng.integers(2, 5)), replace=False))
        spans = [(int(a), int(b)) for a, b in zip(bounds[::2], bounds[1::2], strict=True)]
        if trial % 7 == 0:  # touching spans
            spans[1] = (spans[0][1], max(spans[1][1], spans[0][1] + 1))
        monkeypatch.setattr(intervals, "CLIP_SLICED_ROWS", 0)  # sliced whatever the rows
        cut = intervals.clip(rows, spans)
        monkeypatch.setattr(intervals, "CLIP_SLICED_ROWS", 1 << 40)  # searched
        assert cut.equals(intervals.clip(rows, spans)), spans
    assert len(sliced) == 2000


@pytest.mark.parametrize(
    "name", ["h100_comm_ep2", "h100_host_slow_loader", "h100_moe_megatron_ep2"]
)
def test_window_nvtx_is_the_captures_ranges_over_the_steps_read(name: str) -> None:
    """Step sampling reads the NVTX rows that may be steps (text matching the step pattern)
    to plan, then the ranges over the analysed steps: the whole capture's ranges that overlap
    the spans read, with their domains' names."""
    path = FIXTURES / f"{name}.sqlite"
    read = twopass.load_sampled(path, bundled(), budget=event_rows(path) // 3)
    assert read.plans and read.trace.read_spans
    spans = read.trace.read_spans
    whole = load_trace(path).nvtx
    over = pl.any_horizontal([(pl.col("start") < hi) & (pl.col("end") > lo) for lo, hi in spans])
    want = whole.filter(over)
    got = read.trace.nvtx
    assert 0 < got.height <= whole.height
    key = ["start", "end", "global_tid", "text"]
    assert got.sort(key).equals(want.sort(key))
    assert set(got["domain"].unique()) == set(want["domain"].unique())


@pytest.mark.parametrize(("prefix", "cap"), [(False, None), (False, 0), (True, None)])
def test_pass_one_reads_the_nvtx_rows_whose_text_may_be_a_step(
    prefix: bool, cap: int | None, tmp_path: Path, monkeypatch
) -> None:
    """Pass 1's NVTX rows on the EP capture, whose ranges keep their text in the row (every
    layer's: MoE dispatch and combine, experts) or in StringIds: the domains' creations and
    the rows whose text matches the step pattern, as a match over every row finds them (one
    scan reads each row's text as bytes and matches it, then the rows found are read by
    rowid). One step's text is made invalid UTF-8 (constructed): a pattern that still
    matches it (a prefix) reads it, its text repaired. Past ``MAX_INLINE_STEPS`` matching
    rows, every row with text is read (matched after)."""
    from traceclf.ingest import nvtx_rows
    from traceclf.ingest.reader import Reader

    path = tmp_path / "ep.sqlite"
    shutil.copy(FIXTURES / "h100_comm_ep2.sqlite", path)
    with sqlite3.connect(path) as con:
        (rowid,) = con.execute(
            "SELECT min(rowid) FROM NVTX_EVENTS WHERE text LIKE 'Iteration %'"
        ).fetchone()
        con.execute(
            "UPDATE NVTX_EVENTS SET text = CAST(CAST(text AS BLOB) || X'FF' AS TEXT) "
            f"WHERE rowid = {rowid}"
        )
    if cap is not None:
        monkeypatch.setattr(nvtx_rows, "MAX_INLINE_STEPS", cap)
    pattern = r"^Iteration \d+" if prefix else bundled().nvtx["step"]
    got = nvtx_rows.step_rows(Reader(inspect_export(path)), pattern).rows
    with sqlite3.connect(path) as con:
        rows = con.execute(
            "SELECT n.rowid, n.start, n.eventType, CAST(coalesce(n.text, s.value) AS BLOB), "
            "n.text IS NOT NULL FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId"
        ).fetchall()
    text = pl.Series([b.decode("utf-8", "replace") if b else None for *_, b, _ in rows])
    step = text.str.contains(pattern).fill_null(False).to_list()
    # (past the cap: every row with its text in the row, besides)
    want = [
        start
        for (_, start, kind, _, inline), hit in zip(rows, step, strict=True)
        if hit or kind == 75 or (cap == 0 and inline)
    ]
    assert sorted(got["start"].to_list()) == sorted(want)
    assert 0 < sum(step) < len(rows) // 4
    assert got["text"].str.ends_with("\ufffd").sum() == int(prefix or cap == 0)


@pytest.mark.parametrize(
    ("pattern", "cap"), [(r"^Iteration 1$", 3), (r"^Iteration \d+$", None)], ids=["picked", "all"]
)
def test_pass_one_scans_the_nvtx_table_a_block_at_a_time(pattern, cap, monkeypatch) -> None:
    """Pass 1's one scan of the NVTX table in blocks of 64 rowids (the EP capture's 514 rows:
    nine queries, two at a time, matched in rowid order): the same rows as one match over
    every row. With the cap under the domains' creations (4) but over the steps found (2,
    constructed pattern), those are read by their SQL and the steps by rowid."""
    from traceclf.ingest import nvtx_rows
    from traceclf.ingest.reader import Reader

    path = FIXTURES / "h100_comm_ep2.sqlite"
    monkeypatch.setattr(nvtx_rows, "SCAN_ROWS", 64)
    if cap is not None:
        monkeypatch.setattr(nvtx_rows, "MAX_INLINE_STEPS", cap)
    reader = Reader(inspect_export(path))
    asked: list[str | None] = []
    read = reader.read
    monkeypatch.setattr(
        reader,
        "read",
        lambda *a, **k: asked.append(k.get("where") or "listed" * ("listed" in k)) or read(*a, **k),
    )
    got = nvtx_rows.step_rows(reader, pattern).rows
    assert len(asked) == 1 and asked[0].startswith("listed" if cap is None else '"eventType"')
    with sqlite3.connect(path) as con:
        rows = con.execute(
            "SELECT n.start, n.eventType, coalesce(n.text, s.value) FROM NVTX_EVENTS n "
            "LEFT JOIN StringIds s ON s.id = n.textId"
        ).fetchall()
    text = pl.Series([t for *_, t in rows], dtype=pl.String)
    step = text.str.contains(pattern).fill_null(False).to_list()
    want = [start for (start, kind, _), hit in zip(rows, step, strict=True) if hit or kind == 75]
    assert sorted(got["start"].to_list()) == sorted(want)
    assert sum(step) == (2 if cap else 20)


def window_spans(path: Path) -> list[tuple[int, int]]:
    """Three 2 ms spans at a quarter, half and three quarters of the NVTX ranges' time."""
    with sqlite3.connect(path) as con:
        lo, hi = con.execute('SELECT min(start), max("end") FROM NVTX_EVENTS').fetchone()
    return [(lo + (hi - lo) * k // 4, lo + (hi - lo) * k // 4 + 2_000_000) for k in (1, 2, 3)]


@pytest.mark.parametrize(
    "name",
    ["h100_comm_ep2_overlap", "h100_host_launch_gpumetrics_trimmed", "h100_moe_megatron_ep2"],
)
def test_window_nvtx_read_near_the_steps_is_the_scans(name: str, monkeypatch) -> None:
    """Pass 2's NVTX ranges of the analysed steps, read as those starting near the spans
    (rowid ranges) and those pass 1 found long: the rows of one filtered scan of the table,
    in the same order, and those an independent SQL overlap test finds. Constructed
    thresholds (real exports, in start order as nsys writes them): any table is big enough,
    ranges over 1 ms are long, pass 1 scans 256 rows a query. Some rows come from the long
    list alone (they start more than twice the threshold before their span)."""
    from traceclf.ingest import nvtx_rows

    monkeypatch.setattr(nvtx_rows, "NEAR_MIN_ROWS", 0)
    monkeypatch.setattr(nvtx_rows, "LONG_RANGE_NS", 1_000_000)
    monkeypatch.setattr(nvtx_rows, "SCAN_ROWS", 256)
    path = FIXTURES / f"{name}.sqlite"
    spans = window_spans(path)
    r = reader.Reader(inspect_export(path))
    with rowindex.connect(path) as con:
        index = RowIndex.build(con, "NVTX_EVENTS")
        assert nvtx_rows.reads_near(index)
        steps = nvtx_rows.step_rows(r, bundled().nvtx["step"], long_ranges=True)
        near = nvtx_rows.near_ranges(index, spans)
    with sqlite3.connect(path) as con:
        long = [
            i for (i,) in con.execute('SELECT rowid FROM NVTX_EVENTS WHERE "end" - start > 1e6')
        ]
        overlap = " OR ".join(f'(start < {hi} AND "end" > {lo})' for lo, hi in spans)
        want = con.execute(f'SELECT start, "end" FROM NVTX_EVENTS WHERE {overlap} ORDER BY rowid')
        want = want.fetchall()
    assert steps.long == long and near is not None
    got = nvtx_rows.window_rows(r, spans, steps, near)
    assert got.equals(nvtx_rows.window_rows(r, spans, steps, None))
    ranges = got.filter(pl.col("end").is_not_null())
    assert list(zip(ranges["start"], ranges["end"], strict=True)) == want
    near_spans = [(lo - 2_000_000, hi + 1_000_000) for lo, hi in spans]
    assert any(not any(a <= t <= b for a, b in near_spans) for t in ranges["start"])


def test_window_nvtx_read_out_of_start_order_is_a_scan(tmp_path: Path, monkeypatch) -> None:
    """Constructed: the NVTX rows of an export in reverse order. The sampled order check
    fails, so pass 1 notes no long ranges and pass 2 scans the table; a two-pass read of the
    export then holds the NVTX ranges of the export in order."""
    from traceclf.ingest import nvtx_rows

    monkeypatch.setattr(nvtx_rows, "NEAR_MIN_ROWS", 0)
    name = "h100_comm_ep2_overlap"
    path = copy_of(tmp_path, name)
    reorder(path, "NVTX_EVENTS", "start DESC")
    with rowindex.connect(path) as con:
        assert not nvtx_rows.reads_near(RowIndex.build(con, "NVTX_EVENTS"))
    budget = event_rows(path) // 2
    shuffled = twopass.load_sampled(path, bundled(), budget=budget)
    in_order = twopass.load_sampled(FIXTURES / f"{name}.sqlite", bundled(), budget=budget)
    assert shuffled.plans and in_order.plans
    key = ["start", "end", "text", "global_tid"]
    assert (
        shuffled.trace.nvtx.sort(key).select(key).equals(in_order.trace.nvtx.sort(key).select(key))
    )


def test_a_long_range_whose_end_is_not_a_number_is_read_either_way(tmp_path, monkeypatch) -> None:
    """Constructed: an early NVTX range whose end is text (a damaged export) passes the
    filtered scan's end test for any span; pass 1 counts it among the long ranges, so the
    read near the steps holds it too."""
    from traceclf.ingest import nvtx_rows

    monkeypatch.setattr(nvtx_rows, "NEAR_MIN_ROWS", 0)
    path = copy_of(tmp_path, "h100_comm_ep2_overlap")
    spans = window_spans(path)
    with sqlite3.connect(path) as con:
        con.execute("UPDATE NVTX_EVENTS SET \"end\" = 'late' WHERE rowid = 2")
    r = reader.Reader(inspect_export(path))
    with rowindex.connect(path) as con:
        near = nvtx_rows.near_ranges(RowIndex.build(con, "NVTX_EVENTS"), spans)
    steps = nvtx_rows.step_rows(r, bundled().nvtx["step"], long_ranges=True)
    assert steps.long is not None and 2 in steps.long
    got = nvtx_rows.window_rows(r, spans, steps, near)
    assert got.equals(nvtx_rows.window_rows(r, spans, steps, None))


def test_a_row_out_of_place_near_the_steps_makes_the_read_a_scan(tmp_path, monkeypatch) -> None:
    """Constructed: one NVTX row at a time, of those starting near a span, moved 5 s later (out
    of place by more than the read near the steps tolerates, yet between the rows the order
    check samples). Wherever it lies, and whichever row the binary search meets, the rows read
    are the scan's: the read near the steps finds the rows beyond its bounds starting inside
    them, or its own rows out of order, and scans instead."""
    from traceclf.ingest import nvtx_rows

    monkeypatch.setattr(nvtx_rows, "NEAR_MIN_ROWS", 0)
    monkeypatch.setattr(nvtx_rows, "LONG_RANGE_NS", 1_000_000)
    monkeypatch.setattr(nvtx_rows, "NEAR_CHECK_ROWS", 16)
    source = FIXTURES / "h100_comm_ep2_overlap.sqlite"
    with sqlite3.connect(source) as con:
        (lo,) = con.execute("SELECT start FROM NVTX_EVENTS WHERE rowid = 1000").fetchone()
        hi = lo + 2_000_000
        spans = [(lo, hi)]
        near = con.execute(
            "SELECT rowid FROM NVTX_EVENTS WHERE start BETWEEN ? AND ?",
            (lo - 2_000_000, hi + 1_000_000),
        ).fetchall()
    moved = [rowid for (rowid,) in near[:: max(len(near) // 12, 1)]]
    with sqlite3.connect(source) as con:
        (kept,) = con.execute(  # (a range over the span, from before the rows near it)
            f'SELECT min(rowid) FROM NVTX_EVENTS WHERE start < {lo - 2_000_000} AND "end" > {hi}'
        ).fetchone()
    scans = 0
    for rowid in moved:
        path = tmp_path / f"moved_{rowid}.sqlite"
        shutil.copy(source, path)
        with sqlite3.connect(path) as con:
            con.execute(
                'UPDATE NVTX_EVENTS SET start = start + 5000000000, "end" = "end" + 5000000000 WHERE rowid = ?',
                (rowid,),
            )
            # (a text that is not UTF-8 in the span: its repair is counted once either way)
            con.execute(
                "UPDATE NVTX_EVENTS SET text = CAST(X'66ff6f' AS TEXT) WHERE rowid = ?", (kept,)
            )

        (got, repairs, scanned), (want, scan_repairs, _) = (
            window_read(path, spans, near=True),
            window_read(path, spans, near=False),
        )
        scans += scanned
        assert got.equals(want) and repairs == scan_repairs == 1, rowid
    assert len(moved) >= 8 and scans


def test_rows_near_the_steps_out_of_order_are_scanned_and_decoded_once(tmp_path, monkeypatch):
    """Constructed: two NVTX rows inside the stretch read near a span swap their starts (the
    rows on either side of it stay in order, so the binary search's bounds pass their check),
    and one of them holds a text that is not UTF-8. The rows' starts, read before any text,
    show them out of order: the read is a scan, and the text is decoded, and its repair
    counted, once."""
    from traceclf.ingest import nvtx_rows

    monkeypatch.setattr(nvtx_rows, "NEAR_MIN_ROWS", 0)
    monkeypatch.setattr(nvtx_rows, "LONG_RANGE_NS", 1_000_000)
    monkeypatch.setattr(nvtx_rows, "NEAR_CHECK_ROWS", 16)
    path = copy_of(tmp_path, "h100_comm_ep2_overlap")
    with sqlite3.connect(path) as con:
        (lo,) = con.execute("SELECT start FROM NVTX_EVENTS WHERE rowid = 1000").fetchone()
        (a,), (b,) = con.execute("SELECT start FROM NVTX_EVENTS WHERE rowid IN (1001, 1002)")
        con.execute("UPDATE NVTX_EVENTS SET start = ? WHERE rowid = 1001", (b,))
        con.execute("UPDATE NVTX_EVENTS SET start = ? WHERE rowid = 1002", (a,))
        con.execute("UPDATE NVTX_EVENTS SET text = CAST(X'66ff6f' AS TEXT) WHERE rowid = 1001")
    spans = [(lo, lo + 2_000_000)]
    with rowindex.connect(path) as con:
        assert nvtx_rows.near_ranges(RowIndex.build(con, "NVTX_EVENTS", samples=8), spans)
    (got, repairs, _), (want, scan_repairs, _) = (
        window_read(path, spans, near=True),
        window_read(path, spans, near=False),
    )
    assert got.equals(want) and repairs == scan_repairs == 1


def window_read(path: Path, spans: list, near: bool) -> tuple[pl.DataFrame, int, bool]:
    """Pass 2's NVTX ranges over ``spans`` (near the steps where it may, or by a scan), the
    non-UTF-8 texts that read repaired, and whether it scanned."""
    from traceclf.ingest import nvtx_rows

    r = reader.Reader(inspect_export(path))
    with rowindex.connect(path) as con:
        index = RowIndex.build(con, "NVTX_EVENTS", samples=8)
        steps = nvtx_rows.step_rows(r, bundled().nvtx["step"], long_ranges=True)
        ranges = nvtx_rows.near_ranges(index, spans) if near else None
    before = r.repaired.get("NVTX_EVENTS.text", 0)
    rows = nvtx_rows.window_rows(r, spans, steps, ranges)
    return rows, r.repaired.get("NVTX_EVENTS.text", 0) - before, ranges is None


def test_a_long_range_near_the_steps_is_read_once(tmp_path, monkeypatch) -> None:
    """Constructed: a range longer than the threshold that also starts near the span, its text
    not UTF-8. The read near the steps reads it once (by rowid range, not again from the long
    list), so its repair is counted once, as the scan counts it."""
    from traceclf.ingest import nvtx_rows

    monkeypatch.setattr(nvtx_rows, "NEAR_MIN_ROWS", 0)
    monkeypatch.setattr(nvtx_rows, "LONG_RANGE_NS", 1_000_000)
    path = copy_of(tmp_path, "h100_comm_ep2_overlap")
    with sqlite3.connect(path) as con:
        rowid, start, end = con.execute(
            'SELECT rowid, start, "end" FROM NVTX_EVENTS WHERE "end" - start > 3000000 '
            "AND text IS NOT NULL ORDER BY rowid DESC LIMIT 1"
        ).fetchone()
        con.execute(
            "UPDATE NVTX_EVENTS SET text = CAST(X'66ff6f' AS TEXT) WHERE rowid = ?", (rowid,)
        )
    spans = [(start + 1_000_000, start + 2_000_000)]

    def read(near: bool) -> tuple[pl.DataFrame, dict]:
        r = reader.Reader(inspect_export(path))
        with rowindex.connect(path) as con:
            index = RowIndex.build(con, "NVTX_EVENTS")
            steps = nvtx_rows.step_rows(r, bundled().nvtx["step"], long_ranges=True)
            ranges = nvtx_rows.near_ranges(index, spans) if near else None
        assert rowid in steps.long and (ranges is not None or not near)
        before = dict(r.repaired)
        rows = nvtx_rows.window_rows(r, spans, steps, ranges)
        return rows, {
            k: v - before.get(k, 0) for k, v in r.repaired.items() if v != before.get(k, 0)
        }

    (near_rows, near_repairs), (scanned, scan_repairs) = read(True), read(False)
    assert near_rows.equals(scanned) and end > spans[0][1]
    assert near_repairs == scan_repairs == {"NVTX_EVENTS.text": 1}


@pytest.mark.parametrize("many", [False, True])
def test_rows_listed_by_rowid_are_read_by_their_list_alone(many: bool, monkeypatch) -> None:
    """A read of rows listed by rowid (pass 1's NVTX rows found by its scan) asks SQLite for
    the list alone, never beside a rowid range, which SQLite prefers to a list of thousands
    and scans; a long list (here from 4 rowids on, constructed) is cut among the cores. The
    rows are those a query of the list finds."""
    from traceclf.ingest.reader import Reader

    path = FIXTURES / "h100_comm_ep2.sqlite"
    with sqlite3.connect(path) as con:
        listed = [r for (r,) in con.execute("SELECT rowid FROM NVTX_EVENTS WHERE rowid % 7 = 1")]
        want = con.execute(
            f"SELECT start FROM NVTX_EVENTS WHERE rowid IN ({', '.join(map(str, listed))})"
        ).fetchall()
    if many:
        monkeypatch.setattr(reader, "PARTITION_MIN_ROWS", 40)
        monkeypatch.setattr(reader, "cpu_share", lambda: 2)
    r = Reader(inspect_export(path))
    queries: list[str] = []
    sql = r.sql
    monkeypatch.setattr(r, "sql", lambda q: queries.extend(q) or sql(q))
    got = r.read("nvtx", listed=listed)
    assert sorted(got["start"].to_list()) == sorted(s for (s,) in want) and len(want) > 50
    assert len(queries) == 1 + many and not any("rowid >" in q for q in queries)
    assert r.read("nvtx", listed=[]).is_empty()


def test_steps_analysed_are_capped_however_few_rows_a_step_has(monkeypatch) -> None:
    """STEP_BUDGET caps the analysed steps per rank even where the row budget would allow
    every one (here 0.95 of the rows, which analyses all steady steps uncapped): spread in
    runs over the steady state, with the verdict kept."""
    path = FIXTURES / "h100_host_slow_loader.sqlite"
    everything = analysed(path, None)
    cap = 4
    assert everything.steps["used"] > 2 * cap
    monkeypatch.setattr(twopass, "STEP_BUDGET", cap)
    opts = AnalysisOptions(
        use_cache=False, quiet=True, jobs=1, row_budget=int(event_rows(path) * 0.95)
    )
    sample = analyze_inputs([str(path)], opts)
    assert [r["steps"]["analysed"] for r in sample.ranks] == [cap] * len(sample.ranks)
    assert sample.classification["bound"] == everything.classification["bound"]


def test_without_a_kernel_named_for_the_optimizer_no_run_is_found():
    """Constructed kernels (no real trace has this mix in few rows): with no kernel of the
    optimizer family, the run rule flags nothing more (the window functions are skipped) and an
    NVTX-flagged ``in_optimizer`` stays as it was; with some, an elementwise kernel between two
    optimizer-named kernels on the stream joins their run, a GEMM does not."""
    from traceclf.measures.window import optimizer_runs

    families = ["elementwise", "gemm", "elementwise", "elementwise"]
    kern = pl.DataFrame(
        {
            "family": pl.Series(families, dtype=pl.Categorical),
            "graph_node_id": pl.Series([None] * 4, dtype=pl.Int64),
            "correlation_id": [1, 2, 3, 4],
            "stream_id": [7, 7, 7, 7],
            "in_optimizer": [False, False, True, None],
        }
    )
    assert optimizer_runs(kern)["in_optimizer"].to_list() == [False, False, True, None]
    assert optimizer_runs(kern.drop("in_optimizer"))["in_optimizer"].to_list() == [False] * 4
    named = kern.drop("in_optimizer").with_columns(
        family=pl.Series(["optimizer", "elementwise", "optimizer", "gemm"], dtype=pl.Categorical)
    )
    assert optimizer_runs(named)["in_optimizer"].to_list() == [True, True, True, False]


def test_ranks_with_matching_steps_share_their_runs():
    """Constructed step tables (the plan's logic alone): two ranks with 100 steps each whose
    steady states differ (warm-up ends at step 3 on one, 5 on the other) are planned over the
    steady steps both have, the same runs on each; ranks with other step counts, or analysed
    in one run each, keep their own plans."""
    from traceclf.steps.plan import plan_steps, shared_steady
    from traceclf.steps.settings import bundled_settings

    def table(n: int) -> pl.DataFrame:
        starts = [i * 10_000_000 for i in range(n)]
        return pl.DataFrame(
            {
                "index": list(range(n)),
                "name": [f"step {i}" for i in range(n)],
                "start": starts,
                "end": [s + 9_000_000 for s in starts],
            }
        )

    settings = bundled_settings()

    def plan(n: int, steady: tuple[int, int], analysable: int, within=None):
        return plan_steps(table(n), "nvtx", "step", True, analysable, settings, steady, within)

    a, b = plan(100, (3, 98), 32), plan(100, (5, 97), 32)
    assert a.runs != b.runs and len(a.runs) > 1
    within = shared_steady([a, b])
    assert within == (5, 97)
    a2, b2 = plan(100, (3, 98), 32, within), plan(100, (5, 97), 32, within)
    assert a2.runs == b2.runs and a2.runs[0][0] == 5 and a2.runs[-1][1] <= 97
    # each keeps its own steady state (what its report says of warm-up)
    assert int(a2.table["steady"].sum()) == 96 and int(b2.table["steady"].sum()) == 93
    assert shared_steady([a, plan(120, (5, 97), 32)]) is None  # steps not one to one
    whole = [plan(100, (3, 98), 1000), plan(100, (5, 97), 1000)]  # one run each
    assert shared_steady(whole) is None
