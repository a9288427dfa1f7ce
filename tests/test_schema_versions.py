"""Exports laid out like other nsys versions load into the same frames.

Each variant is made at test time from a real 2025.3 export (see helpers/variants.py): older
table and column names, columns that did not exist yet, columns that a newer nsys adds, and
optional tables that a capture did not produce.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from functools import cache
from pathlib import Path

import polars as pl
import pytest
from conftest import SMALL_TRACE, fixture_trace
from helpers.cli import run_cli
from helpers.files import copy_export, drop_tables
from helpers.variants import (
    as_nsys_2021_early,
    as_nsys_2021_late,
    as_nsys_2022,
    as_nsys_2026,
    rebuild_table,
)

from traceclf.ingest.load import load_trace
from traceclf.ingest.schema import inspect_export
from traceclf.model.trace import Trace
from traceclf.support.errors import TraceError

VARIANTS: dict[str, tuple[Callable[[Path], Path], str, str]] = {
    "2021.1": (as_nsys_2021_early, "2021.1.1.66", "2.3.0"),
    # (its GPU facts in TARGET_INFO_CUDA_GPU beside a TARGET_INFO_GPU of names: SM counts and
    # memory read as unknown before they were taken from the second)
    "2021.3": (as_nsys_2021_late, "2021.3.1.57", "2.5.0"),
    "2022.2": (as_nsys_2022, "2022.2.1.31", "2.9.1"),
    "2026.2": (as_nsys_2026, "2026.2.1.210", "3.25.0"),
}


@cache
def original() -> Trace:
    return load_trace(fixture_trace(SMALL_TRACE))


def variant(tmp_path: Path, make: Callable[[Path], Path], trace: str = SMALL_TRACE) -> Path:
    return make(copy_export(fixture_trace(trace), tmp_path / f"{trace}.sqlite"))


def kernel_totals(t: Trace) -> pl.DataFrame:
    return (
        t.kernels.group_by("pid", "name")
        .agg(count=pl.len(), total=(pl.col("end") - pl.col("start")).sum())
        .sort("pid", "name")
    )


def assert_same_events(a: Trace, b: Trace) -> None:
    assert kernel_totals(a).equals(kernel_totals(b))
    for frame in ("copies", "api", "graphs", "memory"):
        assert getattr(a, frame).sort(pl.all()).equals(getattr(b, frame).sort(pl.all())), frame
    assert a.nvtx.select("start", "end", "text", "pid").equals(
        b.nvtx.select("start", "end", "text", "pid")
    )
    # nsys 2022 wrote no eventSyncId: it reads as null (event waits then stay unresolved)
    same = ("sync_type", "event_sync_id")
    assert a.syncs.drop(same).sort(pl.all()).equals(b.syncs.drop(same).sort(pl.all()))


def assert_same_schemas(a: Trace, b: Trace) -> None:
    for name in Trace.FRAMES:
        assert getattr(a, name).schema == getattr(b, name).schema, name


@pytest.mark.parametrize("version", VARIANTS)
def test_variant_loads_the_same_events(tmp_path: Path, version: str) -> None:
    make, nsys_version, schema_version = VARIANTS[version]
    t = load_trace(variant(tmp_path, make))
    assert (t.nsys_version, t.schema_version) == (nsys_version, schema_version)
    assert_same_events(t, original())
    assert_same_schemas(t, original())
    assert t.rank_pids == original().rank_pids


@pytest.mark.parametrize("version", VARIANTS)
def test_variant_reads_gpu_properties(tmp_path: Path, version: str) -> None:
    t = load_trace(variant(tmp_path, VARIANTS[version][0]))
    gpu = t.gpus.row(0, named=True)
    assert (gpu["gpu_id"], gpu["name"], gpu["sm_count"]) == (0, "NVIDIA H100 80GB HBM3", 132)
    assert (gpu["memory_bytes"], gpu["max_warps_per_sm"], gpu["threads_per_warp"]) == (
        85017493504,
        64,
        32,
    )
    if version == "2022.2":  # columns nsys 2022 did not write yet become nulls
        assert gpu["chip"] is None and gpu["max_shmem_per_sm"] is None


def test_old_sync_type_column_name(tmp_path: Path) -> None:
    t = load_trace(variant(tmp_path, as_nsys_2022))
    assert t.syncs["sync_type"].equals(original().syncs["sync_type"])
    assert t.syncs["sync_type"].null_count() == 0
    assert t.syncs["event_sync_id"].null_count() == t.syncs.height  # never the reused eventId


def test_nvtx_without_text_ids_or_domains(tmp_path: Path) -> None:
    t = load_trace(variant(tmp_path, as_nsys_2022))
    assert t.nvtx["text"].to_list() == original().nvtx["text"].to_list()
    assert (t.nvtx["domain"] == "").all()
    assert t.kernels["graph_node_id"].null_count() == t.kernels.height


def test_graph_trace_without_graph_id(tmp_path: Path) -> None:
    def old_graph_trace(path: Path) -> Path:
        with sqlite3.connect(path) as con:
            rebuild_table(con, "CUPTI_ACTIVITY_KIND_GRAPH_TRACE", drop=("graphId",))
        con.close()
        return path

    t = load_trace(variant(tmp_path, old_graph_trace, "h100_host_cudagraph"))
    full = load_trace(fixture_trace("h100_host_cudagraph"))
    assert t.graphs.drop("graph_id").equals(full.graphs.drop("graph_id"))
    assert t.graphs["graph_id"].null_count() == t.graphs.height


OPTIONAL_TABLES = {
    "GPU_METRICS": "gpu_metrics",
    "NVTX_EVENTS": "nvtx",
    "TARGET_INFO_GPU": "gpus",
    "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION": "syncs",
    "CUDA_GPU_MEMORY_USAGE_EVENTS": "memory",
    "PROFILER_OVERHEAD": "overhead",
    "PROCESSES": "processes",
    "TARGET_INFO_CUDA_DEVICE": "device_map",
    "CUPTI_ACTIVITY_KIND_MEMCPY": "copies",
}


@pytest.mark.parametrize("table", OPTIONAL_TABLES)
def test_missing_optional_table_gives_an_empty_typed_frame(tmp_path: Path, table: str) -> None:
    trace = "h100_compute_dense_gpumetrics" if table == "GPU_METRICS" else SMALL_TRACE
    path = copy_export(fixture_trace(trace), tmp_path / "run.sqlite")
    full = load_trace(path)
    reduced = load_trace(drop_tables(path, [table]))
    frame = OPTIONAL_TABLES[table]
    assert getattr(full, frame).height > 0
    if frame == "copies":  # memsets are still there
        assert set(reduced.copies["op"]) == {"memset"}
    else:
        assert getattr(reduced, frame).is_empty()
    assert_same_schemas(reduced, full)
    assert kernel_totals(reduced).equals(kernel_totals(full))


def test_only_a_kernel_table_is_enough(tmp_path: Path) -> None:
    path = copy_export(fixture_trace(SMALL_TRACE), tmp_path / "run.sqlite")
    with sqlite3.connect(path) as con:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    con.close()
    keep = {"CUPTI_ACTIVITY_KIND_KERNEL", "StringIds"}
    t = load_trace(drop_tables(path, [name for name in tables if name not in keep]))
    assert (t.nsys_version, t.schema_version) == (None, None)
    assert kernel_totals(t).equals(kernel_totals(original()))
    assert_same_schemas(t, original())


@pytest.mark.parametrize(
    ("table", "column"),
    [
        ("CUPTI_ACTIVITY_KIND_KERNEL", "start"),
        ("CUPTI_ACTIVITY_KIND_KERNEL", "end"),
        ("CUPTI_ACTIVITY_KIND_MEMCPY", "bytes"),
        ("CUPTI_ACTIVITY_KIND_RUNTIME", "correlationId"),
        ("CUPTI_ACTIVITY_KIND_RUNTIME", "nameId"),
        ("NVTX_EVENTS", "eventType"),
    ],
)
def test_missing_required_column_is_a_clear_error(tmp_path: Path, table: str, column: str) -> None:
    path = copy_export(fixture_trace(SMALL_TRACE), tmp_path / "run.sqlite")
    with sqlite3.connect(path) as con:
        rebuild_table(con, table, drop=(column,))
    con.close()
    with pytest.raises(TraceError) as err:
        load_trace(path)
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message and table in message and repr(column) in message


def test_kernel_names_fall_back_to_short_names(tmp_path: Path) -> None:
    path = copy_export(fixture_trace(SMALL_TRACE), tmp_path / "run.sqlite")
    with sqlite3.connect(path) as con:
        rebuild_table(con, "CUPTI_ACTIVITY_KIND_KERNEL", drop=("demangledName",))
    con.close()
    t = load_trace(path)
    assert t.kernels["name"].equals(original().kernels["short_name"])

    with sqlite3.connect(path) as con:
        rebuild_table(con, "CUPTI_ACTIVITY_KIND_KERNEL", drop=("shortName", "mangledName"))
    con.close()
    with pytest.raises(TraceError, match="CUPTI_ACTIVITY_KIND_KERNEL lacks column 'demangledName'"):
        load_trace(path)


def test_metadata_table_without_name_value_columns(tmp_path: Path) -> None:
    path = copy_export(fixture_trace(SMALL_TRACE), tmp_path / "run.sqlite")
    with sqlite3.connect(path) as con:
        rebuild_table(con, "META_DATA_EXPORT", rename={"name": "key"})
    con.close()
    info = inspect_export(path)
    assert (info.nsys_version, info.schema_version) == (None, None)
    assert kernel_totals(load_trace(path)).equals(kernel_totals(original()))


def test_unresolved_event_waits_are_not_called_dependency_stalls(tmp_path: Path) -> None:
    """h100_comm_ep2_overlap reshaped as nsys 2022 wrote it (no eventSyncId): compute waits
    for the all-to-all on another stream through events the export cannot resolve. That time
    is unattributed (residual), not "issued, dependencies done, still not running"; the
    ceilings of the communication fixes treat it as possibly recoverable (at most the exposed
    all-to-all) instead of claiming they recover nothing, and the report says why."""
    path = variant(tmp_path, as_nsys_2022, "h100_comm_ep2_overlap")
    code, out, err = run_cli("analyze", path, "-f", "json", "-q", "--no-cache")
    assert code == 0, err
    r = json.loads(out)
    m = r["metrics"]
    assert m["event_waits_unresolved"] > 0
    assert m["attribution_residual_frac"] > 0.5 and m["dependency_stalled_frac"] < 0.05
    assert r["classification"]["bound"] == "communication"
    assert "comm-waits-unresolved" in {rule["id"] for rule in r["classification"]["rules"]}
    deepep = next(f for f in r["fixes"] if f["id"] == "deepep")
    step = m["step_time_ms"]
    recoverable = deepep["ceiling"]["recoverable_ms"]
    assert 0.5 * m["a2a_exposed_frac"] * step < recoverable <= m["a2a_exposed_frac"] * step + 1e-3
