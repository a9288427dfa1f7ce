"""The cache under hostile or unlucky conditions (issue 13, items 1, 7 and 10): it never
follows a link planted in it, deletes only what it created, never files a result under a
file that changed meanwhile, and any cache problem means "no cache", never a failed run.

Damaged caches are constructed here by editing a real cache entry of a real export.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import polars as pl
import pytest
from conftest import fixture_trace
from helpers.files import copy_export, folder_listing

from traceclf.ingest import cache, cachedir, results
from traceclf.ingest.cache import load_trace_cached
from traceclf.ingest.load import load_trace
from traceclf.pipeline import analysis
from traceclf.pipeline.analysis import AnalysisOptions, analyze_export
from traceclf.pipeline.reduce import build_report

SMALL = "h100_comm_ep2"
OTHER = "h100_host_input_stall"
OPTS = AnalysisOptions(quiet=True)


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TRACECLF_CACHE_DIR", str(root))
    return root


@pytest.fixture
def export(tmp_path: Path, root: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    return copy_export(fixture_trace(SMALL), folder / "r.sqlite")


def entry_of(export: Path) -> Path:
    return cachedir.slot_of(export) / cachedir.export_key(export)


def result_file(export: Path) -> Path:
    folder = cachedir.slot_of(export) / f"results-{cachedir.export_key(export)}"
    (file,) = folder.iterdir()
    return file


def bound_of(export: Path) -> str:
    return build_report([analyze_export(export, OPTS)]).bound


# 1. Never follow a symlinked cache folder; delete only names the cache itself creates ---------


def test_symlinked_slot_is_neither_followed_nor_emptied(export: Path, root: Path, tmp_path):
    victim = tmp_path / "v"
    for name in ("0123456789abcdef0123456789abcdef", "results-x", "photos"):
        (victim / name).mkdir(parents=True)
        (victim / name / "keep.txt").write_text("mine")
    before = folder_listing(victim)
    root.mkdir()
    cachedir.slot_of(export).symlink_to(victim, target_is_directory=True)
    assert bound_of(export) == "communication"
    assert bound_of(export) == "communication"
    assert folder_listing(victim) == before
    assert cachedir.slot_of(export).is_symlink()


def test_symlinked_entry_is_not_read_or_removed(export: Path, tmp_path: Path) -> None:
    load_trace_cached(export)
    entry = entry_of(export)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(entry, elsewhere)
    entry.symlink_to(elsewhere, target_is_directory=True)
    before = folder_listing(elsewhere)
    assert cache.read_entry(entry, export) is None
    assert folder_listing(elsewhere) == before


def test_pruning_removes_only_the_caches_own_names(export: Path, root: Path) -> None:
    load_trace_cached(export)
    slot = cachedir.slot_of(export)
    (slot / "notes").mkdir()
    (slot / "notes" / "n.txt").write_text("the user's")
    (slot / "README").write_text("the user's")
    old = slot / ("f" * 32)
    old.mkdir()  # an entry of an older version of the export: the cache's own, removed
    stale = slot / ".tmp-dead-writer"
    stale.mkdir()
    os.utime(stale, (0, 0))  # its writer died long ago
    live = slot / ".tmp-live-writer"
    live.mkdir()  # a concurrent writer's, still filling
    os.utime(export, ns=(0, export.stat().st_mtime_ns + 10**9))  # a new version: write + prune
    load_trace_cached(export)
    assert sorted(p.name for p in slot.iterdir()) == sorted(
        [cachedir.export_key(export), "notes", "README", ".tmp-live-writer", cachedir.MARKER]
    )


def test_clear_keeps_what_it_did_not_create(export: Path, tmp_path: Path, cli) -> None:
    here = tmp_path / "here"  # --cache-dir pointed at a folder of the user's
    here.mkdir()
    (here / "mine.sqlite").write_bytes(b"user data")
    (here / "mine-0123456789ab-0123456789ab.sqlite").write_bytes(b"looks like ours, is not")
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (here / f"x.sqlite-{'0' * 16}.traceclf").symlink_to(victim, target_is_directory=True)
    code, _, err = cli("analyze", "-q", "-f", "json", "--cache-dir", here, export)
    assert code == 0, err
    assert cli("cache", "info", "--cache-dir", here).stdout.count("1 export cached") == 1
    code, out, _ = cli("cache", "clear", "--cache-dir", here)
    assert code == 0 and "removed 1 item" in out
    assert sorted(p.name for p in here.iterdir()) == sorted(
        ["mine.sqlite", "mine-0123456789ab-0123456789ab.sqlite", f"x.sqlite-{'0' * 16}.traceclf"]
    )
    assert (victim / "sub").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_entries_of_another_user_are_not_deleted(export: Path) -> None:
    load_trace_cached(export)
    slot = cachedir.slot_of(export)
    foreign = slot / ("e" * 32)
    foreign.mkdir()
    os.chown(foreign, 12345, 12345)
    os.utime(export, ns=(0, export.stat().st_mtime_ns + 10**9))
    load_trace_cached(export)
    assert foreign.is_dir()


# 7. A file replaced during the analysis must not poison the result cache ----------------------


def test_file_replaced_during_analysis_is_not_cached_under_the_old_identity(
    export: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = analysis._measure_export

    def measure_then_replace(path, opts, show_progress):
        result = real(path, opts, show_progress)
        replacement = path.with_name("new.sqlite")
        copy_export(fixture_trace(OTHER), replacement)
        os.replace(replacement, path)  # another run's export lands under the same name
        return result

    monkeypatch.setattr(analysis, "_measure_export", measure_then_replace)
    assert bound_of(export) == "communication"  # what was read is reported
    monkeypatch.setattr(analysis, "_measure_export", real)
    for _ in range(3):
        assert bound_of(export) == "host"  # the new file's own verdict, every time


def test_results_are_keyed_by_the_identity_read_before_the_analysis(export: Path) -> None:
    key = cachedir.export_key(export)
    os.utime(export, ns=(0, export.stat().st_mtime_ns + 10**9))
    assert not results.write_result(export, "a" * 24, key, {"x": 1})  # the file moved on
    assert results.read_result(export, "a" * 24, key) is None


# 10. Any cache problem falls back to no cache; an invalid entry is a miss ---------------------


def test_full_disk_while_writing_the_model_falls_back(export: Path, monkeypatch) -> None:
    def enospc(*_a, **_k):
        raise pl.exceptions.ComputeError("failed to write: No space left on device (os error 28)")

    with monkeypatch.context() as m:
        m.setattr(pl.DataFrame, "write_parquet", enospc)
        assert load_trace_cached(export).kernels.height == load_trace(export).kernels.height
        left = [p for p in cachedir.slot_of(export).iterdir() if p.name != cachedir.MARKER]
        assert left == []  # no partial temporary left
    assert bound_of(export) == "communication"  # and the next run is unaffected
    load_trace_cached(export)
    assert cache.read_entry(entry_of(export), export) is not None


def test_full_disk_while_writing_the_result_falls_back(export: Path, monkeypatch) -> None:
    def enospc(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(results, "write_atomic", enospc)
        assert bound_of(export) == "communication"
    assert bound_of(export) == "communication"


def test_partial_temporary_folder_does_not_break_later_runs(export: Path) -> None:
    slot = cachedir.slot_of(export)
    slot.mkdir(parents=True)
    partial = slot / f".tmp-{cachedir.export_key(export)}-abc"
    partial.mkdir()
    (partial / "kernels.parquet").write_bytes(b"PAR1 half")
    assert bound_of(export) == "communication"
    assert bound_of(export) == "communication"


def _meta(entry: Path) -> dict:
    return json.loads((entry / "meta.json").read_text())


def _tables_not_a_list(entry: Path) -> None:
    (entry / "meta.json").write_text(json.dumps(_meta(entry) | {"tables": 5}))


def _nsys_version_a_number(entry: Path) -> None:
    (entry / "meta.json").write_text(json.dumps(_meta(entry) | {"nsys_version": 2025}))


def _meta_truncated(entry: Path) -> None:
    text = (entry / "meta.json").read_text()
    (entry / "meta.json").write_text(text[: len(text) // 2])


def _meta_nesting_bomb(entry: Path) -> None:
    (entry / "meta.json").write_text("[" * 200_000 + "]" * 200_000)


def _parquet_swapped(entry: Path) -> None:
    a, b = entry / "kernels.parquet", entry / "api.parquet"
    tmp = entry / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def _parquet_truncated(entry: Path) -> None:
    data = (entry / "copies.parquet").read_bytes()
    (entry / "copies.parquet").write_bytes(data[: len(data) // 2])


def _parquet_rows_dropped(entry: Path) -> None:
    frame = pl.read_parquet(entry / "kernels.parquet")
    frame.head(10).write_parquet(entry / "kernels.parquet")


@pytest.mark.parametrize(
    "damage",
    [
        _tables_not_a_list,
        _nsys_version_a_number,
        _meta_truncated,
        _meta_nesting_bomb,
        _parquet_swapped,
        _parquet_truncated,
        _parquet_rows_dropped,
    ],
)
def test_tampered_model_entry_is_a_miss(export: Path, damage) -> None:
    fresh = load_trace(export)
    load_trace_cached(export)
    damage(entry_of(export))
    again = load_trace_cached(export)
    for name in ("kernels", "api", "copies"):
        assert getattr(again, name).equals(getattr(fresh, name)), name
    assert again.nsys_version == fresh.nsys_version and again.tables == fresh.tables
    assert cache.read_entry(entry_of(export), export) is not None  # rebuilt


def _result_of(file: Path) -> tuple[dict, dict]:
    """A result file's stamp line and result (results.RESULT_FORMAT 2)."""
    head, body = file.read_text().split("\n", 1)
    return json.loads(head), json.loads(body)


def _stamped(stamp: dict, body: str, checksum: bool) -> str:
    if checksum:
        stamp = stamp | {"sha256": hashlib.sha256(body.encode()).hexdigest()}
    return json.dumps(stamp) + "\n" + body


def _result_types_changed(file: Path) -> None:
    stamp, result = _result_of(file)
    result["ranks"][0]["measures"]["metrics"] = "not a dict"
    file.write_text(_stamped(stamp, json.dumps(result), checksum=False))


def _result_types_changed_with_checksum(file: Path) -> None:
    stamp, result = _result_of(file)
    result["ranks"][0]["pid"] = "1191"
    result["ranks"][0]["measures"]["metrics"]["gpu_busy_frac"] = [1]
    file.write_text(_stamped(stamp, json.dumps(result), checksum=True))


def _result_truncated(file: Path) -> None:
    text = file.read_text()
    file.write_text(text[: len(text) // 3])


def _result_nesting_bomb(file: Path) -> None:
    stamp, _result = _result_of(file)
    file.write_text(_stamped(stamp, "[" * 300_000 + "]" * 300_000, checksum=True))


def _result_not_an_object(file: Path) -> None:
    stamp, _result = _result_of(file)
    file.write_text(_stamped(stamp, "[1, 2, 3]", checksum=True))


def _result_of_format_1(file: Path) -> None:
    """A result as format 1 wrote it: one object, its checksum of the result encoded again."""
    _stamp, result = _result_of(file)
    text = json.dumps(result, sort_keys=True, separators=(",", ":"))
    sha = hashlib.sha256(text.encode()).hexdigest()
    file.write_text(json.dumps({"format": 1, "sha256": sha, "result": result}))


@pytest.mark.parametrize(
    "damage",
    [
        _result_types_changed,
        _result_types_changed_with_checksum,
        _result_truncated,
        _result_nesting_bomb,
        _result_not_an_object,
        _result_of_format_1,
    ],
)
def test_tampered_result_is_a_miss(export: Path, damage, monkeypatch) -> None:
    first = analyze_export(export, OPTS).to_dict()
    damage(result_file(export))
    measured = []
    real = analysis._measure_export
    monkeypatch.setattr(analysis, "_measure_export", lambda *a: measured.append(1) or real(*a))
    assert analyze_export(export, OPTS).to_dict() == first
    assert measured == [1]  # recomputed, and the good result is back:
    assert analyze_export(export, OPTS).to_dict() == first and measured == [1]


def test_unwritable_root_means_no_cache(export: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    opts = AnalysisOptions(quiet=True, cache_dir=blocker / "cache")
    result = analyze_export(export, opts)
    assert result.ranks and blocker.read_text() == "not a folder"
