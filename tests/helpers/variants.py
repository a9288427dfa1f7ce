"""Reshape a real nsys 2025.3 export (schema 3.20.3) into what other nsys versions write.

Only the layout changes (table and column names, which columns exist); the events stay the
same, so a loader that handles the layout must give the same frames. Tables are rebuilt with
CREATE TABLE ... AS SELECT, which also drops the declared column types, as a hand-made or
post-processed export might.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from pathlib import Path


def rebuild_table(
    con: sqlite3.Connection,
    table: str,
    *,
    drop: tuple[str, ...] = (),
    rename: Mapping[str, str] | None = None,
    add: Mapping[str, str] | None = None,
    replace: Mapping[str, str] | None = None,
) -> None:
    """Recreate ``table`` without ``drop`` columns, with ``rename`` (old -> new) names, with
    extra ``add`` columns (name -> SQL expression) and ``replace`` columns (name -> SQL
    expression computing the new value)."""
    rename, add, replace = rename or {}, add or {}, replace or {}
    columns = [r[1] for r in con.execute(f"PRAGMA table_info('{table}')")]
    select = [
        f"{replace.get(c, _q(c))} AS {_q(rename.get(c, c))}" for c in columns if c not in drop
    ]
    select += [f"{expr} AS {_q(name)}" for name, expr in add.items()]
    con.execute(f"CREATE TABLE _new AS SELECT {', '.join(select)} FROM {_q(table)}")
    con.execute(f"DROP TABLE {_q(table)}")
    con.execute(f"ALTER TABLE _new RENAME TO {_q(table)}")


def set_meta(con: sqlite3.Connection, table: str, *, product: str, schema: str) -> None:
    """Rename the export metadata table to ``table`` and give it these versions."""
    if table != "META_DATA_EXPORT":
        con.execute(f"ALTER TABLE META_DATA_EXPORT RENAME TO {table}")
    major, minor, micro = schema.split(".")
    values = {
        "EXPORT_PRODUCT_VERSION": product,
        "EXPORT_SCHEMA_VERSION": schema,
        "EXPORT_SCHEMA_VERSION_MAJOR": major,
        "EXPORT_SCHEMA_VERSION_MINOR": minor,
        "EXPORT_SCHEMA_VERSION_MICRO": micro,
    }
    for name, value in values.items():
        con.execute(f"UPDATE {table} SET value = ? WHERE name = ?", (value, name))


def as_nsys_2022(path: Path) -> Path:
    """nsys 2022.2 (schema 2.9.1): EXPORT_META_DATA; NVTX text inline (no textId, no
    domainId); kernels without graphNodeId/graphId; the sync type under its old column name;
    TARGET_INFO_GPU without chipName and the per-SM limits added later."""
    with sqlite3.connect(path) as con:
        set_meta(con, "EXPORT_META_DATA", product="2022.2.1.31", schema="2.9.1")
        rebuild_table(
            con,
            "NVTX_EVENTS",
            drop=("textId", "domainId", "jsonTextId", "jsonText", "binaryData"),
            replace={"text": "COALESCE(text, (SELECT value FROM StringIds WHERE id = textId))"},
        )
        rebuild_table(con, "CUPTI_ACTIVITY_KIND_KERNEL", drop=("graphNodeId", "graphId"))
        rebuild_table(
            con,
            "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",
            drop=("deprecatedSyncType", "eventSyncId"),
            rename={"syncType": "deprecatedSyncType"},
        )
        rebuild_table(
            con,
            "TARGET_INFO_GPU",
            drop=("chipName", "maxShmemPerSm", "maxRegistersPerSm", "maxBlocksPerSm"),
        )
    con.close()
    return path


def as_nsys_2021_early(path: Path) -> Path:
    """nsys 2021.1-2021.2: GPU properties in TARGET_INFO_CUDA_GPU under CUPTI's names, and
    only the split schema version rows."""
    with sqlite3.connect(path) as con:
        set_meta(con, "EXPORT_META_DATA", product="2021.1.1.66", schema="2.3.0")
        con.execute("DELETE FROM EXPORT_META_DATA WHERE name = 'EXPORT_SCHEMA_VERSION'")
        rebuild_table(
            con,
            "TARGET_INFO_GPU",
            rename={
                "id": "deviceId",
                "smCount": "numMultiprocessors",
                "totalMemory": "globalMemorySize",
                "maxWarpsPerSm": "maxWarpsPerMultiprocessor",
                "threadsPerWarp": "numThreadsPerWarp",
                "computeMajor": "computeCapabilityMajor",
                "computeMinor": "computeCapabilityMinor",
            },
        )
        con.execute("ALTER TABLE TARGET_INFO_GPU RENAME TO TARGET_INFO_CUDA_GPU")
    con.close()
    return path


def as_nsys_2021_late(path: Path) -> Path:
    """As :func:`as_nsys_2021_early`, with a TARGET_INFO_GPU that holds only each device's
    name and bus (vmId, deviceId, name, busLocation, isDiscrete), as public exports of
    2020-2021 have it beside TARGET_INFO_CUDA_GPU's SMs, memory and limits."""
    as_nsys_2021_early(path)
    with sqlite3.connect(path) as con:
        for name, value in (
            ("EXPORT_PRODUCT_VERSION", "2021.3.1.57"),
            ("EXPORT_SCHEMA_VERSION_MINOR", "5"),
        ):
            con.execute("UPDATE EXPORT_META_DATA SET value = ? WHERE name = ?", (value, name))
        con.execute(
            "CREATE TABLE TARGET_INFO_GPU AS SELECT vmId, deviceId, name, busLocation, "
            "isDiscrete FROM TARGET_INFO_CUDA_GPU"
        )
    con.close()
    return path


# Tables the loader reads; a newer nsys adds columns to them.
READ_TABLES = (
    "CUPTI_ACTIVITY_KIND_KERNEL",
    "CUPTI_ACTIVITY_KIND_RUNTIME",
    "CUPTI_ACTIVITY_KIND_MEMCPY",
    "CUPTI_ACTIVITY_KIND_MEMSET",
    "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION",
    "NVTX_EVENTS",
    "TARGET_INFO_GPU",
    "PROCESSES",
    "StringIds",
)


def as_nsys_2026(path: Path) -> Path:
    """A newer nsys (2026.2, schema 3.25): extra columns everywhere, a table nobody knows."""
    with sqlite3.connect(path) as con:
        set_meta(con, "META_DATA_EXPORT", product="2026.2.1.210", schema="3.25.0")
        for table in READ_TABLES:
            rebuild_table(
                con, table, add={"futureFlags": "7", "futureLabel": "'x'", "futureNull": "NULL"}
            )
        con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_FUTURE_THING (start INTEGER, payload BLOB)")
    con.close()
    return path


def _q(name: str) -> str:
    return f'"{name}"'
