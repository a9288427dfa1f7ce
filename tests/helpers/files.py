"""Build damaged or unusual copies of real exports, and check that inputs stay untouched."""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
from pathlib import Path

PAGE = 4096  # page size of the real exports


def file_state(path: Path) -> tuple[str, int, int]:
    """What must not change when traceclf reads ``path``: content, size, mtime."""
    st = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns


def folder_listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def copy_export(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    dst.chmod(0o644)
    return dst


def prefix_kernel_names(con: sqlite3.Connection, payload: str) -> None:
    """Constructed: every kernel's short and demangled name starts with ``payload``."""
    con.execute(
        "UPDATE StringIds SET value = ? || value WHERE id IN (SELECT shortName FROM "
        "CUPTI_ACTIVITY_KIND_KERNEL UNION SELECT demangledName FROM CUPTI_ACTIVITY_KIND_KERNEL)",
        (payload,),
    )


def truncated(src: Path, dst: Path) -> Path:
    """The first half of ``src``, as left by an interrupted copy."""
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    return dst


def overwritten(src: Path, dst: Path, start: int, length: int) -> Path:
    """``src`` with ``length`` bytes from ``start`` replaced by a fixed non-zero pattern."""
    data = bytearray(src.read_bytes())
    data[start : start + length] = bytes((i * 151 + 7) % 251 + 1 for i in range(length))
    dst.write_bytes(data)
    return dst


def corrupt_middle(src: Path, dst: Path) -> Path:
    """Eight whole pages in the middle of the file overwritten (a damaged disk block)."""
    middle = src.stat().st_size // 2 // PAGE * PAGE
    return overwritten(src, dst, middle, 8 * PAGE)


def garbled_header_page(src: Path, dst: Path) -> Path:
    """Page 1 after the 100-byte file header garbled: the schema table is unreadable."""
    return overwritten(src, dst, 100, PAGE - 100)


def drop_tables(path: Path, tables: tuple[str, ...] | list[str]) -> Path:
    with sqlite3.connect(path) as con:
        for table in tables:
            con.execute(f'DROP TABLE IF EXISTS "{table}"')
    con.close()
    return path


def plain_sqlite(dst: Path) -> Path:
    """An SQLite database that has nothing to do with Nsight Systems."""
    with sqlite3.connect(dst) as con:
        con.execute("CREATE TABLE recipes (name TEXT, minutes INTEGER)")
        con.execute("INSERT INTO recipes VALUES ('bread', 240)")
    con.close()
    return dst


def split_ranks(src: Path, folder: Path, pids: list[int], names: list[str]) -> list[Path]:
    """Constructed per-rank exports: one copy of ``src`` per pid, holding only that process'
    rows (every table with a globalPid/globalTid column loses the other ranks' rows), as if
    each rank had been profiled into a file of its own during the same session."""
    out = []
    for pid, name in zip(pids, names, strict=True):
        dst = copy_export(src, folder / name)
        others = ",".join(str(p) for p in pids if p != pid)
        con = sqlite3.connect(dst)
        try:
            tables = [
                r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")
            ]
            for table in tables:
                columns = {r[1] for r in con.execute(f'PRAGMA table_info("{table}")')}
                for col in {"globalPid", "globalTid"} & columns:
                    con.execute(
                        f'DELETE FROM "{table}" WHERE (("{col}" >> 24) & 16777215) IN ({others})'
                    )
            con.commit()
        finally:
            con.close()
        out.append(dst)
    return out
