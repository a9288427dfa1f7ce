"""Turn what ``capture.sh`` brought back into committed fixtures: scrubbed, trimmed, with
NVIDIA's own ``nsys stats`` CSVs beside them.

    python3 workloads/fixtures.py CAPTURE_DIR [FIXTURES_DIR]

CAPTURE_DIR holds one folder per capture (``nccl_groups/``, ``nccl_overlap/``,
``slow_loader/``, ``moe_megatron/``; each with ``<name>_blobs.sqlite``, the export made with
``--include-blobs=true``, and its CSVs) and ``<name>_parquetdir/`` folders. Scrubbing removes
the capture host's environment and paths (environment variables, working directory, user name,
absolute paths, installation folders) from the metadata tables and every ``NAME=value`` string
from ``StringIds``; no trace event is changed. Only the host-sampling capture is trimmed: its
OS-runtime calls, CPU samples, Python samples and thread-scheduling rows outside the training
loop (from 0.5 s before the first ``step`` range to 0.1 s after the last) are deleted.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import sys
from pathlib import Path

CAPTURES = {  # capture folder -> fixture name
    "nccl_groups": "h100_nccl_groups",
    "nccl_overlap": "h100_nccl_overlap",
    "moe_megatron": "h100_moe_megatron_ep2",
    "slow_loader": "h100_host_slow_loader",
}
PARQUETDIR = ("nccl_groups",)  # parquetdir exports kept (one suffices for a reader test)
ORACLE_REPORTS = ("cuda_gpu_kern_sum", "cuda_api_sum", "nvtx_sum", "osrt_sum")
# TARGET_INFO_SYSTEM_ENV rows that describe the capture host beyond the GPU and OS versions
HOST_ROWS = ("CpuInfo", "TargetInstallDir", "DeviceEnvironment", "LinuxPerfInfo")
ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[\w.@+-]+/)*([\w.@+-]+)")
ENV_STRING = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def scrub(db: sqlite3.Connection) -> None:
    """Remove the capture environment from an export in place (then VACUUM it)."""
    tables = {r[0] for r in db.execute("select name from sqlite_master where type='table'")}
    if "META_DATA_CAPTURE" in tables:
        db.execute(
            "delete from META_DATA_CAPTURE where name like '%ENVIRONMENT_VARIABLE%' "
            "or name like '%WORKING_DIR%'"
        )
        db.execute("update META_DATA_CAPTURE set value = '' where name like '%USER_NAME%'")
    if "TARGET_INFO_SYSTEM_ENV" in tables:
        marks = ",".join("?" * len(HOST_ROWS))
        db.execute(f"delete from TARGET_INFO_SYSTEM_ENV where name in ({marks})", HOST_ROWS)
    _basenames(db, tables, "ANALYSIS_FILE", "filename")
    _basenames(db, tables, "META_DATA_EXPORT", "value")
    _basenames(db, tables, "DIAGNOSTIC_EVENT", "text")
    rows = db.execute("select id, value from StringIds").fetchall()
    for sid, value in rows:
        if isinstance(value, str) and ENV_STRING.match(value):
            db.execute("update StringIds set value = '' where id = ?", (sid,))


def _basenames(db: sqlite3.Connection, tables: set[str], table: str, column: str) -> None:
    if table not in tables:
        return
    for rowid, value in db.execute(f"select rowid, {column} from {table}").fetchall():
        if isinstance(value, str) and "/" in value:
            db.execute(
                f"update {table} set {column} = ? where rowid = ?",
                (ABSOLUTE_PATH.sub(r"\1", value), rowid),
            )


def trim_host_samples(db: sqlite3.Connection) -> None:
    """Keep host-side samples and calls only around the training loop's ``step`` ranges."""
    first, last = db.execute(
        "select min(e.start), max(e.end) from NVTX_EVENTS e left join StringIds s "
        "on s.id = e.textId where coalesce(e.text, s.value) like 'step %'"
    ).fetchone()
    lo, hi = first - 500_000_000, last + 100_000_000
    outside = "start < :lo or start > :hi"
    bounds = {"lo": lo, "hi": hi}
    db.execute(f"delete from SCHED_EVENTS where {outside}", bounds)
    db.execute(
        "delete from SAMPLING_CALLCHAINS where id in "
        f"(select id from COMPOSITE_EVENTS where {outside})",
        bounds,
    )
    db.execute(f"delete from COMPOSITE_EVENTS where {outside}", bounds)
    db.execute(
        "delete from OSRT_CALLCHAINS where id in "
        f"(select callchainId from OSRT_API where {outside})",
        bounds,
    )
    db.execute(f"delete from OSRT_API where {outside}", bounds)
    # Python samples are NVTX events of nsys's own domain, with binary payloads
    db.execute(f"delete from NVTX_EVENTS where binaryData is not null and ({outside})", bounds)


def make(capture_dir: Path, fixtures: Path) -> None:
    oracle = fixtures / "nvidia-oracle"
    for folder, name in CAPTURES.items():
        src = capture_dir / folder / f"{folder}_blobs.sqlite"
        if not src.is_file():
            print(f"skipped {folder}: no {src.name}")
            continue
        dst = fixtures / f"{name}.sqlite"
        shutil.copyfile(src, dst)
        db = sqlite3.connect(dst)
        scrub(db)
        if folder == "slow_loader":
            trim_host_samples(db)
        db.commit()
        db.execute("VACUUM")
        db.close()
        for report in ORACLE_REPORTS:
            csv = capture_dir / folder / f"{folder}_{report}.csv"
            if csv.is_file() and csv.stat().st_size:
                shutil.copyfile(csv, oracle / f"{name}_{report}.csv")
        print(f"{dst.name}: {dst.stat().st_size / 1e6:.1f} MB")
    for folder in PARQUETDIR:
        pq = capture_dir / "pq" / folder
        if pq.is_dir():
            dst = fixtures / "parquetdir" / CAPTURES[folder]
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(pq, dst)
            scrub_parquet(dst)
            print(
                f"parquetdir/{dst.name}: {sum(f.stat().st_size for f in dst.iterdir()) / 1e6:.1f} MB"
            )


def scrub_parquet(folder: Path) -> None:
    """The same scrubbing for a parquetdir export (pyarrow is a traceclf dependency)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def rewrite(table: str, keep, change) -> None:
        path = folder / f"{table}.parquet"
        if not path.is_file():
            return
        frame = pq.read_table(path)
        rows = [change(r) for r in frame.to_pylist() if keep(r)]
        pq.write_table(pa.Table.from_pylist(rows, schema=frame.schema), path)

    def basename(column: str):
        def change(row: dict) -> dict:
            if isinstance(row[column], str):
                row[column] = ABSOLUTE_PATH.sub(r"\1", row[column])
            return row

        return change

    def no_user(row: dict) -> dict:
        return {**row, "value": ""} if "USER_NAME" in row["name"] else row

    def no_env(row: dict) -> dict:
        value = row["value"]
        return {**row, "value": ""} if isinstance(value, str) and ENV_STRING.match(value) else row

    def everything(row: dict) -> bool:
        return True

    rewrite(
        "META_DATA_CAPTURE",
        lambda r: "ENVIRONMENT_VARIABLE" not in r["name"] and "WORKING_DIR" not in r["name"],
        no_user,
    )
    rewrite("TARGET_INFO_SYSTEM_ENV", lambda r: r["name"] not in HOST_ROWS, lambda r: r)
    rewrite("ANALYSIS_FILE", everything, basename("filename"))
    rewrite("META_DATA_EXPORT", everything, basename("value"))
    rewrite("DIAGNOSTIC_EVENT", everything, basename("text"))
    rewrite("StringIds", everything, no_env)


if __name__ == "__main__":
    make(
        Path(sys.argv[1]),
        Path(sys.argv[2] if len(sys.argv) > 2 else Path(__file__).parents[1] / "fixtures"),
    )
