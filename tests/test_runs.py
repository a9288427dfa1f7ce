"""Runs vs ranks: several inputs are one job only when their evidence matches.

Per-rank files are constructed here by splitting the real two-rank export h100_comm_ep2 by
process (helpers.files.split_ranks); the unrelated runs are the real fixtures themselves.
"""

from __future__ import annotations

import html
import json
import shutil
from pathlib import Path

import jsonschema
import polars as pl
import pytest
from conftest import FIXTURES, fixture_trace
from helpers.files import copy_export, split_ranks

from traceclf import analyze
from traceclf.pipeline.grouping import evidence, match
from traceclf.render.multirun import runs_html, runs_markdown, runs_terminal
from traceclf.report.contract import Report
from traceclf.report.runset import RunSet

EP2 = "h100_comm_ep2"
EP2_PIDS = [1191, 1192]


@pytest.fixture(scope="module")
def rank_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("ranks")
    return split_ranks(fixture_trace(EP2), folder, EP2_PIDS, ["rank_0.sqlite", "rank_1.sqlite"])


@pytest.fixture(scope="module")
def single(rank_files) -> Report:
    return analyze(fixture_trace(EP2))


def test_per_rank_files_of_one_job_merge(rank_files, single: Report) -> None:
    report = analyze(*rank_files)
    assert isinstance(report, Report)
    assert [r["pid"] for r in report.ranks] == EP2_PIDS
    assert [Path(r["file"]).name for r in report.ranks] == ["rank_0.sqlite", "rank_1.sqlite"]
    assert report.grouping["mode"] == "job" and report.grouping["decided_by"] == "evidence"
    assert "same profiling session" in report.grouping["reason"]
    assert "file names differ only in the rank number" in report.grouping["reason"]
    # The same two ranks as in the one-file export, so the same numbers.
    assert report.bound == single.bound == "communication"
    for key in ("exposed_comm_frac", "gpu_busy_frac", "step_time_ms"):
        assert report.metrics[key] == pytest.approx(single.metrics[key], rel=1e-6), key


def test_unrelated_runs_get_one_report_each(tmp_path: Path) -> None:
    names = ["h100_comm_ep2", "h100_memory_offload", "h100_host_input_stall"]
    for name in names:
        copy_export(fixture_trace(name), tmp_path / f"{name}.sqlite")
    runs = analyze(tmp_path, jobs=1)
    assert isinstance(runs, RunSet)
    assert [r.bound for r in runs.runs] == ["communication", "host", "memory"]
    assert runs.grouping["mode"] == "runs" and "--job to merge" in runs.grouping["reason"]
    rows = runs.summary.to_dicts()
    assert [row["run"] for row in rows] == [
        "h100_comm_ep2.sqlite",
        "h100_host_input_stall.sqlite",
        "h100_memory_offload.sqlite",
    ]
    assert rows[0]["top_fix"] == runs.runs[0].fixes[0]["id"]
    assert rows[0]["exposed_comm_frac"] == runs.runs[0].metrics["exposed_comm_frac"]
    assert rows == runs.to_dict()["summary"]


def test_the_same_capture_given_twice_is_analysed_once(tmp_path: Path) -> None:
    """Constructed: a copy of an export beside it. The two were merged into a job of two
    ranks with one pid sharing one GPU; now the copy is said to be the same capture and the
    report is the export's own."""
    first, again = tmp_path / "run.sqlite", tmp_path / "run-copy.sqlite"
    copy_export(fixture_trace("h100_host_input_stall"), first)
    copy_export(first, again)
    with pytest.warns(UserWarning, match=r"run(-copy)?\.sqlite: the same capture as .*run"):
        report = analyze(tmp_path, jobs=1)
    alone = analyze(first)
    assert isinstance(report, Report) and len(report.ranks) == len(alone.ranks) == 1
    assert report.metrics == alone.metrics


def test_another_name_of_one_file_is_analysed_once_and_said(tmp_path: Path) -> None:
    """Constructed: a folder holding an export and a link to it named after it (``z`` sorts
    after ``a``), and one path named twice. Each was dropped without a word, and the folder's
    report named the link; now the first name in natural order is kept and the other said."""
    first = copy_export(fixture_trace("h100_host_input_stall"), tmp_path / "a.sqlite")
    (tmp_path / "z.sqlite").symlink_to("a.sqlite")
    with pytest.warns(UserWarning, match=r"z\.sqlite: the same file as .*a\.sqlite: analysed once"):
        report = analyze(tmp_path, jobs=1)
    assert [Path(i["path"]).name for i in report.inputs] == ["a.sqlite"]
    with pytest.warns(UserWarning, match=r"a\.sqlite: named twice: analysed once"):
        again = analyze(first, first, jobs=1)
    assert len(again.ranks) == len(report.ranks) == 1


def test_a_process_in_two_inputs_is_analysed_once(
    rank_files, single: Report, tmp_path: Path
) -> None:
    """Constructed: the two-rank export beside its own per-rank split. The split's processes
    were counted again, four ranks for two; now each is analysed once, from the first file
    that holds it, and the numbers are the export's own."""
    combined = copy_export(fixture_trace(EP2), tmp_path / "all.sqlite")
    for f in rank_files:
        copy_export(f, tmp_path / f.name)
    with pytest.warns(UserWarning) as caught:
        report = analyze(tmp_path, jobs=1)
    assert sorted(str(w.message).replace(str(tmp_path), "") for w in caught) == [
        f"/rank_{i}.sqlite: process {pid} is also in /all.sqlite (the same host, pid and "
        "steady-state window): analysed once"
        for i, pid in enumerate(EP2_PIDS)
    ]
    assert isinstance(report, Report)
    assert [(r["pid"], Path(r["file"]).name) for r in report.ranks] == [
        (pid, combined.name) for pid in EP2_PIDS
    ]
    assert [Path(i["path"]).name for i in report.inputs] == [combined.name]
    for key in ("exposed_comm_frac", "gpu_busy_frac", "step_time_ms"):
        assert report.metrics[key] == single.metrics[key], key


def test_an_input_keeps_the_processes_no_earlier_one_holds(
    rank_files, single: Report, tmp_path: Path
) -> None:
    """Constructed: rank 0's own file, then the export of both ranks. The later export keeps
    only the process the first lacks (said as its ``part``), and the two make the job."""
    first = copy_export(rank_files[0], tmp_path / "a.sqlite")
    both = copy_export(fixture_trace(EP2), tmp_path / "b.sqlite")
    with pytest.warns(UserWarning, match=r"b\.sqlite: process 1191 is also in .*a\.sqlite"):
        report = analyze(tmp_path, jobs=1)
    assert isinstance(report, Report)
    assert [(r["pid"], Path(r["file"]).name) for r in report.ranks] == [
        (EP2_PIDS[0], first.name),
        (EP2_PIDS[1], both.name),
    ]
    assert report.inputs[1]["part"] == f"pid {EP2_PIDS[1]}" and "part" not in report.inputs[0]
    for key in ("exposed_comm_frac", "gpu_busy_frac", "step_time_ms"):
        assert report.metrics[key] == pytest.approx(single.metrics[key], rel=1e-6), key


def test_runs_keep_each_file_whole(rank_files, tmp_path: Path) -> None:
    """--runs reports each file as it is: rank 0's own file and the export of both ranks are
    two runs, the second with both ranks (its first process is not taken out of it)."""
    copy_export(rank_files[0], tmp_path / "a.sqlite")
    copy_export(fixture_trace(EP2), tmp_path / "b.sqlite")
    runs = analyze(tmp_path, jobs=1, grouping="runs")
    assert isinstance(runs, RunSet)
    assert [[r["pid"] for r in run.ranks] for run in runs.runs] == [[EP2_PIDS[0]], EP2_PIDS]


def test_runs_come_in_the_order_they_were_named(tmp_path: Path) -> None:
    """Files named one by one keep their order (a folder's files come in natural order); the
    summary is a polars frame keyed by file names, and its text takes string operations."""
    names = ["h100_memory_offload", "h100_comm_ep2", "h100_host_input_stall"]
    paths = [copy_export(fixture_trace(n), tmp_path / f"{n}.sqlite") for n in names]
    runs = analyze(*paths, jobs=1)
    assert isinstance(runs, RunSet)
    assert runs.summary["run"].to_list() == [f"{n}.sqlite" for n in names]
    assert [Path(r.inputs[0]["path"]).stem for r in runs.runs] == names
    comm = runs.summary.filter(pl.col("run").str.contains("comm"))
    assert comm["bound"].to_list() == ["communication"]
    assert runs.tables()["ranks"]["run"].unique(maintain_order=True).to_list() == [
        f"{n}.sqlite" for n in names
    ]
    folder = analyze(tmp_path, jobs=1)  # a folder: natural order
    assert folder.summary["run"].to_list() == sorted(f"{n}.sqlite" for n in names)


def test_all_fixtures_in_one_folder_are_separate_runs(cli) -> None:
    code, out, err = cli("analyze", "-q", "-f", "json", FIXTURES)
    assert code == 0, err
    data = json.loads(out)
    assert set(data) == {"report_version", "runs", "summary", "grouping"}
    assert data["report_version"] == 2
    exports = sorted(FIXTURES.glob("*.sqlite"))  # every export of the folder is its own run
    assert len(exports) >= 14
    assert len(data["runs"]) == len(data["summary"]) == len(exports)
    assert all(len(run["inputs"]) == 1 for run in data["runs"])
    schema = json.loads((FIXTURES.parent / "docs" / "report-schema.json").read_text())
    for run in data["runs"]:  # each run is a whole report of the contract
        jsonschema.Draft202012Validator(schema).validate(run)
    jsonschema.Draft202012Validator(schema).validate(data)  # and the whole: $defs/run_set


def test_same_session_with_disagreeing_steps_is_not_merged(rank_files) -> None:
    """Two ranks of one job whose steps disagree wildly are not merged silently."""
    a, b = (evidence(r) for r in _results(rank_files))
    support, against = match(a, b)
    assert support and not against
    slow = b.__class__(**{**b.__dict__, "step_ms": b.step_ms * 3})
    assert any("step times differ by" in reason for reason in match(a, slow)[1])


def test_job_and_runs_override_the_guess(rank_files, tmp_path: Path, cli) -> None:
    split = analyze(*rank_files, grouping="runs")
    assert isinstance(split, RunSet) and len(split.runs) == 2
    assert split.grouping["decided_by"] == "--runs"
    unrelated = [fixture_trace("h100_comm_ep2"), fixture_trace("h100_comm_ep2_overlap")]
    merged = analyze(*unrelated, grouping="job")
    assert isinstance(merged, Report) and len(merged.ranks) == 4
    assert merged.grouping == {
        "mode": "job",
        "decided_by": "--job",
        "reason": "--job: all 2 files are one job",
    }
    code, out, _ = cli("analyze", "-q", "-f", "json", "--runs", *rank_files)
    assert code == 0 and len(json.loads(out)["runs"]) == 2
    code, out, _ = cli("analyze", "-q", "-f", "json", "--job", *unrelated)
    assert code == 0 and json.loads(out)["grouping"]["decided_by"] == "--job"


@pytest.mark.parametrize("fmt", ["terminal", "md", "html"])
def test_every_format_shows_the_summary_then_each_run(tmp_path: Path, cli, fmt) -> None:
    for name in ("h100_comm_ep2", "h100_memory_offload"):
        shutil.copyfile(fixture_trace(name), tmp_path / f"{name}.sqlite")
    out_file = tmp_path / f"report.{fmt}"
    code, _, err = cli(
        "analyze",
        "-q",
        "-f",
        fmt,
        "-o",
        out_file,
        tmp_path / "h100_comm_ep2.sqlite",
        tmp_path / "h100_memory_offload.sqlite",
    )
    assert code == 0, err
    text = out_file.read_text()
    assert "2 separate runs" in text
    for column in ("run", "bound", "step", "busy", "exposed comm", "top fix"):
        assert column in text
    assert text.index("h100_comm_ep2.sqlite") < text.lower().rindex("communication")
    assert text.count("deepep") >= 2  # in the summary and in the run's own fixes
    if fmt == "md":
        assert "\n# traceclf: 2 separate runs" in "\n" + text
        assert "\n## traceclf: COMMUNICATION-bound" in text  # each run's title demoted
        assert "\n# traceclf: COMMUNICATION-bound" not in text


def _results(paths):
    from traceclf.pipeline.analysis import AnalysisOptions, analyze_export

    return [analyze_export(p, AnalysisOptions(quiet=True)) for p in paths]


@pytest.mark.parametrize("fmt", ["terminal", "md", "html"])
def test_merged_report_says_why_it_merged(rank_files, cli, fmt, tmp_path: Path) -> None:
    out = tmp_path / f"r.{fmt}"
    code, _, err = cli("analyze", "-q", "-f", fmt, "-o", out, *rank_files)
    assert code == 0, err
    assert "2 files treated as ranks of one job" in " ".join(out.read_text().split())


def test_per_rank_files_with_recurring_kernel_steps_merge(tmp_path: Path) -> None:
    """ulysses_2gpu_forward_window split into one file per rank (CONSTRUCTED by process, as a
    per-rank capture would look): no NVTX step ranges, so each rank's steps come from the
    kernel that recurs most regularly on it, and the two ranks pick different kernels (an
    elementwise add vs a GELU) with the same ~17 ms step. Same session, overlapping captures,
    rank-numbered names: one job, not two runs."""
    src = FIXTURES / "external" / "ulysses_2gpu_forward_window.sqlite"
    files = split_ranks(src, tmp_path, [144, 145], ["rank_0.sqlite", "rank_1.sqlite"])
    a, b = (evidence(r) for r in _results(files))
    assert a.anchor[0] == b.anchor[0] == "pattern" and a.anchor[1] != b.anchor[1]
    report = analyze(*files)
    assert isinstance(report, Report) and len(report.ranks) == 2
    assert report.grouping["mode"] == "job"
    whole = analyze(src)
    assert report.cross_rank["collectives_matched"] == whole.cross_rank["collectives_matched"]


def _stretch_process(path: Path, pid: int, factor: int) -> None:
    """Constructed: every event of process ``pid`` in the export at ``path`` runs ``factor``
    times slower (its times stretched from the capture's first event), so that the two
    processes of one export no longer look like ranks of one job."""
    import sqlite3

    con = sqlite3.connect(path)
    try:
        (t0,) = con.execute("SELECT min(start) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()
        stretch = (
            f'start = {t0} + (start - {t0}) * {factor}, "end" = {t0} + ("end" - {t0}) * {factor}'
        )
        for table, col in (
            ("CUPTI_ACTIVITY_KIND_KERNEL", "globalPid"),
            ("CUPTI_ACTIVITY_KIND_MEMCPY", "globalPid"),
            ("CUPTI_ACTIVITY_KIND_MEMSET", "globalPid"),
            ("CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", "globalPid"),
            ("CUPTI_ACTIVITY_KIND_RUNTIME", "globalTid"),
            ("NVTX_EVENTS", "globalTid"),
        ):
            con.execute(
                f"UPDATE {table} SET {stretch} WHERE (({col} >> 24) & 16777215) = ? "
                'AND start IS NOT NULL AND "end" IS NOT NULL',
                (pid,),
            )
        con.commit()
    finally:
        con.close()


def test_unrelated_processes_in_one_export_are_separate_runs(tmp_path: Path) -> None:
    """Two processes of one export whose steps take 117 and ~234 ms are not ranks of one job
    (ranks wait for each other every step): one report each, not an average of two workloads.
    The two real ranks of the same export stay one job (test_per_rank_files_of_one_job_merge)."""
    export = copy_export(fixture_trace(EP2), tmp_path / "two_jobs.sqlite")
    _stretch_process(export, EP2_PIDS[1], 2)
    result = analyze(export, use_cache=False)
    assert isinstance(result, RunSet) and len(result.runs) == 2
    names = result.summary["run"].to_list()
    assert names == [f"two_jobs.sqlite (pid {pid})" for pid in EP2_PIDS]
    steps = [run.steps["median_ms"] for run in result.runs]
    assert steps[1] == pytest.approx(2 * steps[0], rel=0.1)
    assert "step times differ" in result.grouping["reason"]
    assert result.grouping["reason"].startswith("2 processes are 2 separate runs")  # (one file)
    merged = analyze(export, use_cache=False, grouping="job")
    assert isinstance(merged, Report) and len(merged.ranks) == 2


def test_why_runs_are_separate_is_said_once_names_in_the_order_of_their_values(
    tmp_path: Path,
) -> None:
    """ "a vs b: steps found differently (a's anchor vs b's anchor); step times differ (a's vs
    b's)", printed once above the runs in every format, not again in each run's report."""
    names = ["h100_comm_ep2", "h100_host_input_stall", "h100_memory_offload"]
    for name in names:
        copy_export(fixture_trace(name), tmp_path / f"{name}.sqlite")
    runs = analyze(tmp_path, jobs=1)
    reason = runs.grouping["reason"]
    first = reason.split(" · ")[0]
    assert first.startswith("3 files are 3 separate runs (--job to merge): ")
    pair = (
        "h100_comm_ep2.sqlite vs h100_host_input_stall.sqlite: steps found differently (nvtx "
        '"Iteration" vs nvtx "batch")'
    )
    assert pair in first
    ep2, stall = (r.steps["median_ms"] for r in runs.runs[:2])
    assert f"({ep2:.3g} vs {stall:.3g} ms;" in first
    texts = {
        "terminal": runs_terminal(runs, to_string=True, width=200) or "",
        "md": runs_markdown(runs),
        "html": runs_html(runs),
    }
    for fmt, text in texts.items():
        flat = " ".join(html.unescape(text).split())
        assert flat.count("separate runs (--job to merge)") == 1, fmt
        assert flat.count("steps found differently") == 2, fmt  # two pairs, each once


def test_why_runs_differ_names_a_kernel_anchor_by_its_function() -> None:
    """A public CUTLASS benchmark's step anchor is a 5 KB demangled kernel name, printed twice
    in the line saying why two runs are separate (15 KB). Constructed evidence: the kernel is
    named by its function, cut to a line, as the report's steps line names it."""
    from traceclf.pipeline.grouping import Evidence

    long = "void cutlass::Kernel<" + "cutlass::gemm::GemmShape<128, 128, 32>, " * 100 + ">(P)"
    a = Evidence(
        "a.sqlite", frozenset({"T4"}), ("pattern", long), 1.0, None, None, "a", frozenset()
    )
    b = Evidence("b.sqlite", frozenset({"T4"}), ("nvtx", "step"), 1.0, None, None, "b", frozenset())
    (found,) = [x for x in match(a, b)[1] if x.startswith("steps found differently")]
    assert found == 'steps found differently (pattern "Kernel" vs nvtx "step")'
