"""The cache of whole analyses (issue 26: re-analysing unchanged inputs in under 0.5 s).

A second ``traceclf analyze`` of the same inputs with the same options, rules and code renders
from the report the first one filed: byte for byte the same output in every format, with
neither the reduce step (cross-rank matching, the judge) nor the per-export results read. Any
change to an input, an option that shapes the report or a rule file is a miss."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers.cli import run_cli
from realtraces import trace_path

from traceclf.ingest import cachedir, results
from traceclf.pipeline import analysis, reduce
from traceclf.pipeline.analysis import AnalysisOptions, analyze_inputs
from traceclf.report.contract import Report
from traceclf.report.runset import RunSet

FORMATS = ("json", "md", "terminal", "csv")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("TRACECLF_CACHE_DIR", str(folder))
    monkeypatch.setenv("COLUMNS", "120")
    return folder


def copy(name: str, folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    return Path(shutil.copy2(trace_path(name), folder / Path(trace_path(name)).name))


def reduces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the reduce steps run from now on."""
    calls: list[int] = []
    real = reduce.build_report
    monkeypatch.setattr(reduce, "build_report", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def outputs(*inputs: Path) -> dict[str, str]:
    out = {}
    for fmt in FORMATS:
        code, text, err = run_cli("analyze", *inputs, "--format", fmt, "--quiet")
        assert code == 0, err
        out[fmt] = text
    return out


@pytest.mark.parametrize(
    "names",
    [
        ("h100_comm_ep2",),  # two ranks in one export: cross-rank matching and late arrivals
        ("h100_memory_offload", "h100_compute_low_occupancy"),  # two runs: a run set
    ],
)
def test_second_analysis_renders_the_cached_report(
    names: tuple[str, ...], cache_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    inputs = [copy(n, tmp_path / "run") for n in names]
    fresh = outputs(*inputs)  # the first fills the cache; the others read it
    calls = reduces(monkeypatch)
    assert outputs(*inputs) == fresh
    assert calls == []
    monkeypatch.setattr(results, "read_result", lambda *a, **k: pytest.fail("per-export read"))
    again = analyze_inputs([str(p) for p in inputs], AnalysisOptions(quiet=True))
    assert isinstance(again, RunSet) == (len(names) > 1)
    uncached = analyze_inputs(
        [str(p) for p in inputs], AnalysisOptions(quiet=True, use_cache=False)
    )
    assert again.to_json() == uncached.to_json()


def test_an_unchanged_run_in_json_is_printed_as_filed(
    cache_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """``--format json`` of an unchanged run prints the report as the first run filed it,
    neither decoded nor encoded again (a long ``--all-steps`` report runs to megabytes: most
    of re-analysing it was that); ``--export-dir`` needs the report's tables: decoded then."""
    export = copy("h100_comm_ep2", tmp_path / "run")
    code, first, err = run_cli("analyze", export, "--format", "json", "--quiet")
    assert code == 0, err
    (file,) = cachedir.slot_of(export).glob(f"{cachedir.RESULTS_PREFIX}*/{results.RUN_PREFIX}*")
    assert file.read_text().partition("\n")[2] + "\n" == first
    decoded: list[int] = []
    real = analysis._cached_run
    monkeypatch.setattr(analysis, "_cached_run", lambda *a: decoded.append(1) or real(*a))
    monkeypatch.setattr(Report, "to_json", lambda *a, **k: pytest.fail("encoded again"))
    code, again, err = run_cli("analyze", export, "--format", "json", "--quiet")
    assert (code, again, decoded) == (0, first, [])
    tables = tmp_path / "tables"
    code, _, err = run_cli("analyze", export, "--quiet", "--export-dir", tables)
    assert code == 0, err
    assert decoded == [1] and (tables / "ranks.csv").is_file()


def test_a_first_run_in_json_encodes_its_report_once(
    cache_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """A first ``--format json`` run prints the report as it filed it: encoded once, not once
    to file and again to print; without the cache (nothing filed) it is encoded to print, and
    both print the same bytes."""
    export = copy("h100_comm_ep2", tmp_path / "run")
    encoded: list[int] = []
    real = Report.to_json
    monkeypatch.setattr(Report, "to_json", lambda *a, **k: encoded.append(1) or real(*a, **k))
    code, first, err = run_cli("analyze", export, "--format", "json", "--quiet")
    assert (code, len(encoded)) == (0, 1), err
    code, uncached, err = run_cli("analyze", export, "--format", "json", "--quiet", "--no-cache")
    assert (code, len(encoded), uncached) == (0, 2, first), err


def test_a_changed_input_option_or_rule_is_a_miss(
    cache_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    export = copy("h100_comm_ep2", tmp_path / "run")
    opts = AnalysisOptions(quiet=True)
    first = analyze_inputs([str(export)], opts).to_json()
    calls = reduces(monkeypatch)
    analyze_inputs([str(export)], opts)
    assert calls == []
    analyze_inputs([str(export)], AnalysisOptions(quiet=True, all_steps=True))
    analyze_inputs([str(export)], AnalysisOptions(quiet=True, grouping="runs"))
    assert len(calls) == 2
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "extra.yaml").write_text("thresholds:\n  straggler_min_skew: 0.5\n")
    analyze_inputs([str(export)], AnalysisOptions(quiet=True, rules_dir=rules))
    (rules / "extra.yaml").write_text("thresholds:\n  straggler_min_skew: 0.6\n")
    analyze_inputs([str(export)], AnalysisOptions(quiet=True, rules_dir=rules))
    assert len(calls) == 4
    st = export.stat()
    os.utime(export, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert analyze_inputs([str(export)], opts).to_json() == first
    assert len(calls) == 5
    # a step regex's warnings name what each export matched: never served from the cache
    analyze_inputs([str(export)], AnalysisOptions(quiet=True, step_regex="."))
    analyze_inputs([str(export)], AnalysisOptions(quiet=True, step_regex="."))
    assert len(calls) == 7


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: f.write_text(f.read_text()[:100]),  # truncated
        lambda f: f.write_text(f.read_text().replace('"report_version"', '"x"', 1)),  # checksum
        lambda f: f.write_text('{"format": 1, "result": ' + "[" * 300_000 + "]" * 300_000 + "}"),
    ],
)
def test_a_damaged_cached_report_is_analysed_again(
    damage, cache_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    export = copy("h100_comm_ep2", tmp_path / "run")
    opts = AnalysisOptions(quiet=True)
    first = analyze_inputs([str(export)], opts).to_json()
    (file,) = (cachedir.slot_of(export)).glob(f"{cachedir.RESULTS_PREFIX}*/{results.RUN_PREFIX}*")
    damage(file)
    calls = reduces(monkeypatch)
    assert analyze_inputs([str(export)], opts).to_json() == first
    assert calls == [1]
    assert analyze_inputs([str(export)], opts).to_json() == first and calls == [1]


def test_the_key_names_every_input_in_order(tmp_path: Path, cache_dir: Path) -> None:
    a = copy("h100_memory_offload", tmp_path / "a")
    b = copy("h100_compute_low_occupancy", tmp_path / "b")
    opts = AnalysisOptions(quiet=True)
    named = [str(a), str(b)]
    assert analysis.run_key(named, [a, b], opts) != analysis.run_key(named[::-1], [b, a], opts)
    # a folder names the same files as naming them one by one, in another order of runs
    assert analysis.run_key([str(tmp_path)], [a, b], opts) != analysis.run_key(named, [a, b], opts)
    assert analysis.run_key(named, [a], AnalysisOptions(quiet=True, use_cache=False)) is None


def test_every_module_step_sampling_reads_with_is_in_the_result_key() -> None:
    """A per-export result is keyed by the source of what shapes it (ANALYSIS_SOURCES): each
    pipeline module that step sampling imports must be listed, or an edit to it would be
    served a result made by the code before."""
    import ast

    from traceclf.pipeline import twopass

    tree = ast.parse(Path(twopass.__file__).read_text())
    used = {
        node.module.removeprefix("traceclf.").replace(".", "/") + ".py"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("traceclf.pipeline")
    }
    assert used and used <= set(analysis.ANALYSIS_SOURCES)
