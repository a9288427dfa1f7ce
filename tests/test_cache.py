"""The Parquet cache of the trace model: hits, invalidation, placement, races and corruption.

Hostile and damaged caches (issue 13) are in test_cache_safety.py."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from realtraces import trace_path

from traceclf.ingest import cache, cachedir
from traceclf.ingest.cache import load_trace_cached
from traceclf.ingest.load import load_trace
from traceclf.model.trace import Trace
from traceclf.support.errors import TraceError

SMALL = "h100_comm_ep2.sqlite"


@pytest.fixture
def export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of a small real export, so caches land in tmp_path only."""
    monkeypatch.setenv("TRACECLF_CACHE_DIR", str(tmp_path / "global-cache"))
    folder = tmp_path / "run"
    folder.mkdir()
    return Path(shutil.copy2(trace_path(SMALL), folder / SMALL))


def assert_same_trace(a: Trace, b: Trace) -> None:
    assert (a.path, a.nsys_version, a.schema_version, a.tables) == (
        b.path,
        b.nsys_version,
        b.schema_version,
        b.tables,
    )
    for name in Trace.FRAMES:
        fa, fb = getattr(a, name), getattr(b, name)
        assert fa.schema == fb.schema, name
        assert fa.equals(fb), name


def entries(slot: Path) -> list[str]:
    """What a slot holds besides the marker traceclf writes into every folder it makes."""
    if not slot.exists():
        return []
    return sorted(p.name for p in slot.iterdir() if p.name != cachedir.MARKER)


def forbid_sqlite(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any read of an export fail, to prove a load is served from the cache."""

    def boom(*_a, **_k):
        raise AssertionError("the export was read although a cache entry exists")

    monkeypatch.setattr(cache, "load_trace", boom)
    monkeypatch.setattr("connectorx.read_sql", boom)


def test_hit_equals_fresh_load_and_export_is_untouched(export: Path, monkeypatch) -> None:
    before = (export.read_bytes(), export.stat().st_mtime_ns)
    fresh = load_trace(export)
    first = load_trace_cached(export)
    assert len(entries(cachedir.slot_of(export))) == 1
    forbid_sqlite(monkeypatch)
    second = load_trace_cached(export)
    assert_same_trace(fresh, first)
    assert_same_trace(first, second)
    assert (export.read_bytes(), export.stat().st_mtime_ns) == before


def test_touch_invalidates(export: Path) -> None:
    load_trace_cached(export)
    old = entries(cachedir.slot_of(export))
    st = export.stat()
    os.utime(export, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    load_trace_cached(export)
    new = entries(cachedir.slot_of(export))
    assert len(new) == 1 and new != old  # the stale entry was replaced, not kept beside


def test_rewritten_export_is_reloaded(export: Path) -> None:
    kernels = load_trace_cached(export).kernels.height
    with sqlite3.connect(export) as con:
        con.execute("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE rowid % 2 = 0")
    con.close()
    reloaded = load_trace_cached(export)
    assert reloaded.kernels.height < kernels
    assert reloaded.kernels.equals(load_trace(export).kernels)


def test_use_cache_false_writes_nothing(export: Path, tmp_path: Path) -> None:
    before = sorted(tmp_path.rglob("*"))
    assert_same_trace(load_trace_cached(export, use_cache=False), load_trace(export))
    assert sorted(tmp_path.rglob("*")) == before


def test_nothing_is_written_beside_the_export(export: Path, tmp_path: Path) -> None:
    from traceclf.pipeline.analysis import AnalysisOptions, analyze_export

    analyze_export(export, AnalysisOptions(quiet=True))
    assert sorted(p.name for p in export.parent.iterdir()) == [SMALL]
    slot = cachedir.slot_of(export)
    assert slot.parent == tmp_path / "global-cache"  # $TRACECLF_CACHE_DIR
    assert any(n.startswith(cachedir.RESULTS_PREFIX) for n in entries(slot))


def test_cache_dir_is_always_honoured(export: Path, tmp_path: Path, monkeypatch) -> None:
    cache_dir = tmp_path / "explicit-cache"
    first = load_trace_cached(export, cache_dir=cache_dir)  # writable folder: still cache_dir
    assert len(entries(cachedir.slot_of(export, cache_dir))) == 1
    assert not (tmp_path / "global-cache").exists()
    forbid_sqlite(monkeypatch)
    assert_same_trace(load_trace_cached(export, cache_dir=cache_dir), first)


def test_cache_dir_dot_keeps_the_cache_in_the_current_folder(export: Path, monkeypatch) -> None:
    monkeypatch.chdir(export.parent)
    load_trace_cached(export, cache_dir=Path("."))
    assert cachedir.slot_of(export, Path(".")).parent == export.parent
    assert len(entries(cachedir.slot_of(export, Path(".")))) == 1


def test_default_is_the_user_cache_directory(export: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TRACECLF_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = cachedir.cache_root()
    assert (root.path, root.origin) == (tmp_path / "xdg" / "traceclf", "user cache directory")
    load_trace_cached(export)
    assert len(entries(tmp_path / "xdg" / "traceclf")) == 1


def test_read_only_cache_dir_means_no_cache(export: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "ro-cache"
    cache_dir.mkdir()
    cache_dir.chmod(0o555)  # no write bit: skipped even by root, whom access(2) allows
    try:
        assert_same_trace(load_trace_cached(export, cache_dir=cache_dir), load_trace(export))
        assert list(cache_dir.iterdir()) == []
    finally:
        cache_dir.chmod(0o755)
    assert sorted(p.name for p in export.parent.iterdir()) == [SMALL]


def test_key_is_the_exports_identity(export: Path, tmp_path: Path) -> None:
    key = cachedir.export_key(export)
    twin = Path(shutil.copy2(export, tmp_path / "twin.sqlite"))  # same bytes, size and mtime
    assert cachedir.export_key(twin) != key  # another path is another export
    assert cachedir.slot_of(twin) != cachedir.slot_of(export)
    with export.open("r+b") as f:  # same size and mtime, other content
        f.seek(100)
        f.write(b"\x01")
    os.utime(export, ns=(twin.stat().st_atime_ns, twin.stat().st_mtime_ns))
    assert cachedir.export_key(export) != key


def test_cache_info_and_clear(export: Path, tmp_path: Path, cli) -> None:
    from traceclf.pipeline.analysis import AnalysisOptions, analyze_export

    analyze_export(export, AnalysisOptions(quiet=True))  # a result (the analysis writes no model)
    load_trace_cached(export)  # a trace model (opening an export does)
    info = cli("cache", "info")
    assert info.code == 0, info.stderr
    assert str(tmp_path / "global-cache") in info.stdout
    assert "$TRACECLF_CACHE_DIR" in info.stdout
    assert "1 export cached (1 trace model, 1 result set)" in info.stdout
    cleared = cli("cache", "clear")
    assert cleared.code == 0 and "removed 1 item" in cleared.stdout
    assert list((tmp_path / "global-cache").iterdir()) == []
    assert "0 exports cached" in cli("cache", "info").stdout


LOAD_IN_CHILD = (
    "import sys; from traceclf.ingest.cache import load_trace_cached; "
    "t = load_trace_cached(sys.argv[1]); print(t.kernels.height, t.api.height)"
)


def test_two_processes_at_once(export: Path) -> None:
    children = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD_IN_CHILD, str(export)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    assert [child.returncode for child in children] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0]
    slot = cachedir.slot_of(export)
    assert len(entries(slot)) == 1  # one entry, no temporary folder left behind
    entry = slot / entries(slot)[0]
    assert_same_trace(cache.read_entry(entry, export), load_trace(export))


def test_losing_the_rename_race_keeps_the_winner(export: Path) -> None:
    trace = load_trace(export)
    slot, key = cachedir.slot_of(export), cachedir.export_key(export)
    assert cache.write_entry(trace, slot, key)
    winner = (slot / key / "kernels.parquet").stat().st_mtime_ns
    assert cache.write_entry(trace, slot, key)
    assert entries(slot) == [key]
    assert (slot / key / "kernels.parquet").stat().st_mtime_ns == winner


def _truncate(entry: Path) -> None:
    data = (entry / "kernels.parquet").read_bytes()
    (entry / "kernels.parquet").write_bytes(data[: len(data) // 2])


def _garble_meta(entry: Path) -> None:
    (entry / "meta.json").write_text("{not json")


def _drop_frame(entry: Path) -> None:
    (entry / "api.parquet").unlink()


def _old_format(entry: Path) -> None:
    (entry / "meta.json").write_text('{"format": -1}')


@pytest.mark.parametrize("damage", [_truncate, _garble_meta, _drop_frame, _old_format])
def test_damaged_entry_is_rebuilt(export: Path, damage) -> None:
    load_trace_cached(export)
    slot = cachedir.slot_of(export)
    entry = slot / entries(slot)[0]
    damage(entry)
    assert_same_trace(load_trace_cached(export), load_trace(export))
    assert cache.read_entry(entry, export) is not None  # and a good entry is back in place


def test_missing_export_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace_cached(tmp_path / "absent.sqlite")


def test_a_result_as_filed_is_asdicts_without_the_copies(export: Path) -> None:
    """What a result files (``ExportResult.to_dict``) equals ``dataclasses.asdict`` of it,
    which deep-copied every list and dict the records hold; those are shared instead."""
    from dataclasses import asdict

    from traceclf.pipeline.analysis import AnalysisOptions, analyze_export

    result = analyze_export(export, AnalysisOptions(quiet=True, use_cache=False))
    filed = result.to_dict()
    assert filed == asdict(result)
    rank = result.ranks[0]
    assert filed["ranks"][0]["measures"]["metrics"] is rank.measures.metrics


def test_reanalysis_of_an_unchanged_export_reads_only_the_result(export: Path, monkeypatch):
    from traceclf.pipeline.analysis import AnalysisOptions, analyze_export

    opts = AnalysisOptions(quiet=True)
    first = analyze_export(export, opts)
    forbid_sqlite(monkeypatch)
    monkeypatch.setattr(cache, "read_entry", lambda *_a: pytest.fail("trace model was read"))
    again = analyze_export(export, opts)
    assert again.to_dict() == first.to_dict()
    assert any(n.startswith(cachedir.RESULTS_PREFIX) for n in entries(cachedir.slot_of(export)))


def test_result_cache_follows_options_and_can_be_bypassed(export: Path, monkeypatch):
    from traceclf.pipeline import analysis
    from traceclf.pipeline.analysis import AnalysisOptions, analyze_export

    analyze_export(export, AnalysisOptions(quiet=True))
    measured = []
    real = analysis._measure_export
    monkeypatch.setattr(analysis, "_measure_export", lambda *a: measured.append(1) or real(*a))
    analyze_export(export, AnalysisOptions(quiet=True, step_regex=r"^moe_dispatch$"))
    analyze_export(export, AnalysisOptions(quiet=True, use_cache=False))
    assert len(measured) == 2  # another step regex and --no-cache both recompute


def test_analysis_writes_a_trace_model_only_when_it_will_be_read_again(export: Path) -> None:
    """A cold analysis writes its result, not the (whole-capture) trace model: re-running it
    is served by the result. Analysing the export again under other options loads the model
    a second time, and then it is cached."""
    from traceclf.pipeline.analysis import AnalysisOptions, analyze_export

    slot = cachedir.slot_of(export)

    def models() -> list[str]:
        return [n for n in entries(slot) if not n.startswith(cachedir.RESULTS_PREFIX)]

    analyze_export(export, AnalysisOptions(quiet=True, all_steps=True))
    assert models() == []
    assert len(list(slot.glob(f"{cachedir.RESULTS_PREFIX}*/*.json"))) == 1
    analyze_export(export, AnalysisOptions(quiet=True, all_steps=True, step_regex="Iteration"))
    assert len(models()) == 1


REANALYSE_IN_CHILD = (
    "import sys\n"
    "from traceclf.cli import main\n"
    "sys.argv = ['traceclf', 'analyze', sys.argv[1], '--format', 'json', '-q', *sys.argv[2:]]\n"
    "try:\n"
    "    main()\n"
    "except SystemExit as e:\n"
    "    assert not e.code, e.code\n"
    "heavy = ('polars', 'numpy', 'pyarrow', 'connectorx', 'rich', 'traceclf.measures.rank')\n"
    "print('imported:', sorted(m for m in heavy if m in sys.modules), file=sys.stderr)\n"
)


def reanalyse(export: Path, *args: str) -> str:
    """Analyse ``export`` in a fresh process; what heavy modules that process imported."""
    done = subprocess.run(
        [sys.executable, "-c", REANALYSE_IN_CHILD, str(export), *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("mode", [(), ("--all-steps",)], ids=["window", "all-steps"])
def test_a_cached_reanalysis_imports_no_engine(export: Path, mode: tuple[str, ...]) -> None:
    """Re-analysing an unchanged export of one rank reads its result and the rule set's
    stamp: neither polars nor numpy, the loader nor the measures (each costs more than the
    rest of it). (Several ranks are matched across ranks, which takes polars.)"""
    export = Path(shutil.copy2(trace_path("h100_host_input_stall.sqlite"), export.parent))
    first = reanalyse(export, *mode)
    assert "polars" in first  # the first analysis measured the trace
    assert reanalyse(export, *mode) == "imported: []"
    stamps = list((export.parent.parent / "global-cache").glob("rules-*.json"))
    assert len(stamps) == 1


def test_changed_rules_are_checked_again_on_a_cached_result(export: Path, tmp_path: Path) -> None:
    """The stamp vouches for one rule set: a --rules folder edited after a cached analysis
    is checked again, and a pattern polars cannot run still fails with the file's name."""
    from helpers.cli import run_cli

    rules = tmp_path / "rules"
    rules.mkdir()
    good = "taxonomy:\n  families:\n    - family: gemm\n      match: 'my_gemm'\n"
    (rules / "mine.yaml").write_text(good)
    assert run_cli("analyze", export, "--rules", rules, "-f", "json", "-q").code == 0
    (rules / "mine.yaml").write_text(good.replace("my_gemm", "(?<=x)gemm"))  # look-behind
    code, _out, err = run_cli("analyze", export, "--rules", rules, "-f", "json", "-q")
    assert code == 2 and "mine.yaml" in err and "not a usable regex" in err


def test_api_docs_say_where_the_cache_lives(export: Path, tmp_path: Path, monkeypatch) -> None:
    """docs/api.md on `traceclf.open` names the folders the cache really uses, in the order
    cache_root tries them, and says nothing lands beside the trace (it did say so)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    section = " ".join(doc.split("### `traceclf.open(", 1)[1].split("###", 1)[0].split())
    assert "next to" not in section and "Nothing is written beside the trace" in section
    named = [
        section.index(s) for s in ("`cache_dir`", "`$TRACECLF_CACHE_DIR`", "`$XDG_CACHE_HOME`")
    ]
    assert named == sorted(named)
    monkeypatch.delenv("TRACECLF_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    import traceclf

    traceclf.open(export)
    assert sorted(p.name for p in export.parent.iterdir()) == [SMALL]
    assert len(entries(tmp_path / "xdg" / "traceclf")) == 1  # "~/.cache/traceclf"
