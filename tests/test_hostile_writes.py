"""traceclf writes only what it made, whole or not at all (issue 29, "Deletes or writes what
it did not create").

- a symlink planted where a Markdown report's figure goes is refused, never followed;
- a report and its figures, and an ``--export-dir`` folder, appear whole or not at all when
  the disk fills up (simulated with a file-size limit: every write past it fails);
- an ``nsys export`` that leaves its output as a symlink, or writes an SQLite file that is no
  export, neither gets stamped nor is named instead of the ``.nsys-rep``;
- ``cache clear`` deletes only what carries the mark traceclf wrote, whatever it is named;
- ``--cache-dir`` naming a file means no cache, not a refused run;
- FIFOs where traceclf looks (``run.sqlite-journal``, ``run.sqlite`` beside ``run.nsys-rep``)
  are never opened.

Everything hostile here is CONSTRUCTED in the test (links, FIFOs, look-alike files, a stand-in
nsys); the exports are copies of a small real one (fixtures/).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fixture_trace
from helpers.cli import CliResult, run_cli
from helpers.fake_nsys import write_fake_nsys, write_fake_report
from helpers.files import copy_export, file_state, folder_listing, plain_sqlite

TINY = "h100_host_input_stall"
CHILD_TIMEOUT_S = 120


def tiny(folder: Path, name: str = "run.sqlite") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return copy_export(fixture_trace(TINY), folder / name)


def one_line_error(result: CliResult, *needles: str) -> None:
    assert result.code == 2, (result.code, result.stderr)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("traceclf: error: "), result.stderr
    assert "internal error" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def limited(*args: str | Path, file_size: int) -> CliResult:
    """``traceclf ARGS`` in a child whose files cannot grow past ``file_size`` bytes: each
    write past it fails (EFBIG), as on a full disk."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    done = subprocess.run(
        [sys.executable, "-m", "traceclf", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        preexec_fn=limit,
        check=False,
    )
    return CliResult(done.returncode, done.stdout, done.stderr)


# -- figures and tables -----------------------------------------------------------------------


def test_a_symlink_where_a_figure_goes_is_refused_not_followed(tmp_path: Path) -> None:
    """Constructed: report.step_timeline.png is a link to someone's file. `-f md -o report.md`
    overwrote the link's target."""
    export = tiny(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("not a figure\n")
    (out / "report.step_timeline.png").symlink_to(precious)
    result = run_cli("analyze", export, "-f", "md", "-o", out / "report.md", "-q", "--no-cache")
    one_line_error(result, "report.step_timeline.png", "symbolic link")
    assert precious.read_text() == "not a figure\n"
    assert sorted(p.name for p in out.iterdir()) == ["report.step_timeline.png"]  # nothing else


def test_a_report_and_its_figures_appear_whole_or_not_at_all(tmp_path: Path) -> None:
    """Constructed: writes past 40 kB fail, so the report and two figures fit and the third
    figure (~53 kB) does not. A figure was left behind; now nothing is."""
    export = tiny(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    result = limited("analyze", export, "-f", "md", "-o", out / "report.md", "-q", "--no-cache",
                     file_size=40_000)  # fmt: skip
    one_line_error(result, ".png", "cannot write")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("folder", ["tables", "new/tables"])
def test_an_export_folder_appears_whole_or_not_at_all(tmp_path: Path, folder: str) -> None:
    """Constructed: writes past 4 kB fail: 5 of the 6 tables fit, kernels.csv does not. 5 of 6
    tables were left; now none, and a folder traceclf made for them is removed again."""
    export = tiny(tmp_path / "run")
    result = limited("analyze", export, "-f", "json", "--export-dir", tmp_path / folder, "-q",
                     "--no-cache", file_size=4_000)  # fmt: skip
    one_line_error(result, "kernels.csv", "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("to_file", [True, False], ids=["-o", "stdout"])
def test_a_run_whose_tables_fail_leaves_no_report(tmp_path: Path, to_file: bool) -> None:
    """Constructed: a link planted where a table goes. The report was written (or printed)
    first and the run then exited 2; now the report, its figures and its tables appear
    together or not at all, and nothing reaches stdout."""
    export = tiny(tmp_path / "run")
    tables = tmp_path / "tables"
    tables.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("not a table\n")
    (tables / "steps.csv").symlink_to(precious)
    out = ["-o", tmp_path / "report.md"] if to_file else []
    result = run_cli("analyze", export, "-f", "md", *out, "--export-dir", tables, "-q",
                     "--no-cache")  # fmt: skip
    one_line_error(result, "steps.csv", "symbolic link")
    assert result.stdout == ""
    assert precious.read_text() == "not a table\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt", "run", "tables"]
    assert [p.name for p in tables.iterdir()] == ["steps.csv"]


def test_an_existing_export_folder_keeps_its_old_tables_on_failure(tmp_path: Path) -> None:
    export = tiny(tmp_path / "run")
    tables = tmp_path / "tables"
    assert run_cli("analyze", export, "-f", "json", "--export-dir", tables, "-q").code == 0
    before = {p.name: file_state(p) for p in tables.iterdir()}
    result = limited("analyze", export, "-f", "json", "--export-dir", tables, "-q", "--no-cache",
                     file_size=4_000)  # fmt: skip
    assert result.code == 2
    assert {p.name: file_state(p) for p in tables.iterdir()} == before


# -- nsys exports -------------------------------------------------------------------------------


def test_an_nsys_output_left_as_a_symlink_is_not_stamped(tmp_path: Path) -> None:
    """Constructed: a stand-in nsys that leaves its --output as a link to another SQLite file
    (the export the report names). traceclf wrote its stamp into that file."""
    target = tiny(tmp_path / "theirs", "other.sqlite")
    before = file_state(target)
    nsys = write_fake_nsys(tmp_path / "nsys", tmp_path / "nsys.log", behaviour="symlink")
    (tmp_path / "rep").mkdir()
    report = write_fake_report(tmp_path / "rep" / "run.nsys-rep", target)
    cache = tmp_path / "cache"
    result = run_cli("analyze", report, "--nsys", nsys, "--cache-dir", cache, "-q")
    one_line_error(result, "run.nsys-rep", "symbolic link")
    assert file_state(target) == before
    assert [p for p in cache.iterdir() if p.suffix == ".sqlite"] == []


def test_an_nsys_that_writes_another_sqlite_file_names_the_report(tmp_path: Path) -> None:
    """Constructed: a stand-in nsys whose "export" is an SQLite database of recipes. The error
    named the cache file, and the file stayed, stamped, in the cache."""
    recipes = plain_sqlite(tmp_path / "recipes.sqlite")
    nsys = write_fake_nsys(tmp_path / "nsys", tmp_path / "nsys.log")
    report = write_fake_report(
        (tmp_path / "rep").mkdir() or tmp_path / "rep" / "run.nsys-rep", recipes
    )
    cache = tmp_path / "cache"
    result = run_cli("analyze", report, "--nsys", nsys, "--cache-dir", cache, "-q")
    one_line_error(result, "run.nsys-rep", "not an Nsight Systems export")
    assert str(cache) not in result.stderr
    assert folder_listing(cache) == []


# -- the cache ----------------------------------------------------------------------------------


def test_cache_clear_deletes_only_what_traceclf_marked(tmp_path: Path) -> None:
    """Constructed: a user's folder used as --cache-dir holds files named like traceclf's: a
    rule stamp rules-<32 hex>.json and a slot <name>-<16 hex>.traceclf/ with contents. Both
    were deleted by name; only what traceclf made (and marked) is."""
    here = tmp_path / "here"
    here.mkdir()
    (here / f"rules-{'a' * 32}.json").write_text('{"names": [], "matches": {}}')
    slot = here / f"notes.txt-{'0' * 16}.traceclf"
    (slot / ("1" * 32)).mkdir(parents=True)
    (slot / ("1" * 32) / "thesis.tex").write_text("years of work")
    mine = sorted(p.name for p in here.rglob("*"))
    export = tiny(tmp_path / "run")
    assert run_cli("analyze", export, "--cache-dir", here, "-q", "-f", "json").code == 0
    assert len(sorted(here.iterdir())) > 2  # traceclf's own entries were added
    result = run_cli("cache", "clear", "--cache-dir", here)
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in here.rglob("*")) == mine


def test_a_cache_dir_that_is_a_file_means_no_cache(tmp_path: Path) -> None:
    """Constructed: --cache-dir names a file. It was refused as a usage error, though a cache
    that cannot be used is "simply not used"."""
    export = tiny(tmp_path / "run")
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file")
    result = run_cli("analyze", export, "--cache-dir", not_a_folder, "-q")
    assert result.code == 0 and "HOST-bound" in result.stdout
    assert result.stderr_lines == [
        f"traceclf: warning: {not_a_folder}: --cache-dir is not a folder: no cache"
    ]
    assert not_a_folder.read_text() == "a file"


# -- FIFOs where traceclf looks -------------------------------------------------------------------


def child(*args: str | Path) -> CliResult:
    from helpers.cli import run_cli_process

    try:
        return run_cli_process(*args, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"traceclf {' '.join(map(str, args))} still ran after {CHILD_TIMEOUT_S} s")


def test_a_fifo_as_the_journal_is_never_opened(tmp_path: Path) -> None:
    """Constructed: run.sqlite-journal is a FIFO. Checking it for a hot journal blocked
    forever; a FIFO is no journal."""
    export = tiny(tmp_path / "run")
    os.mkfifo(tmp_path / "run" / "run.sqlite-journal")
    result = child("analyze", export, "-q", "--no-cache")
    assert result.code == 0 and "HOST-bound" in result.stdout, result.stderr


def test_a_fifo_beside_a_report_is_never_opened(tmp_path: Path) -> None:
    """Constructed: run.sqlite beside run.nsys-rep is a FIFO. Looking for an earlier export
    there blocked forever; the report is exported into the cache instead."""
    nsys = write_fake_nsys(tmp_path / "nsys", tmp_path / "nsys.log")
    export = tiny(tmp_path / "real")
    report = write_fake_report(
        (tmp_path / "rep").mkdir() or tmp_path / "rep" / "run.nsys-rep", export
    )
    os.mkfifo(tmp_path / "rep" / "run.sqlite")
    result = child("analyze", report, "--nsys", nsys, "--cache-dir", tmp_path / "cache", "-q")
    assert result.code == 0 and "HOST-bound" in result.stdout, result.stderr


def test_the_python_api_never_writes_onto_the_analysed_export(tmp_path: Path) -> None:
    """docs/api.md's calls as it shows them, without ``inputs=``: a report or its trace-event
    file aimed at the export it was made from is refused (TraceError naming the file), and
    the export is unchanged; both wrote onto it before. A table whose name a report's input
    has (constructed: the report's input renamed) is refused likewise."""
    import dataclasses

    import traceclf
    from traceclf.export.files import export_tables
    from traceclf.export.perfetto import write_trace
    from traceclf.render import render

    run = tiny(tmp_path)
    report = traceclf.analyze(run, cache_dir=tmp_path / "cache")
    before = file_state(run)
    for write in (
        lambda: render(report, "html", run),
        lambda: render(report, "md", run),
        lambda: write_trace([report], run, cache_dir=tmp_path / "cache"),
    ):
        with pytest.raises(traceclf.TraceError, match=r"run\.sqlite"):
            write()
        assert file_state(run) == before
    table = tmp_path / "ranks.csv"
    table.write_text("not a table\n")
    named = dataclasses.replace(report, inputs=[{"path": str(table)}])
    with pytest.raises(traceclf.TraceError, match=r"ranks\.csv"):
        export_tables(named, tmp_path, "csv")
    assert table.read_text() == "not a table\n"
