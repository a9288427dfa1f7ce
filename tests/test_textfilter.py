"""The SQL condition pass 1 narrows its NVTX scan with (traceclf/ingest/textfilter.py): every
text the step regex matches, as polars runs it on the decoded text, passes it in SQLite;
texts it cannot judge by ASCII pass; patterns Python may parse otherwise than Rust get none.
Texts and patterns are constructed (the edge cases no capture holds); the scan on a real
emit_nvtx export finds the same rows with the condition as without it."""

from __future__ import annotations

import sqlite3

import polars as pl
import pytest
from realtraces import trace_path

from traceclf.ingest import nvtx_rows, textfilter
from traceclf.ingest.reader import Reader
from traceclf.ingest.schema import inspect_export
from traceclf.ingest.utf8 import MAX_TEXT, decode_text
from traceclf.model.taxonomy import bundled

# (bytes of an NVTX text): steps as frameworks write them, per-op ranges, and what ASCII
# tests could misjudge: Unicode case folding (long s, Kelvin sign), a no-break space that
# Rust's \s matches, a NUL, bytes that are not UTF-8, a text past what the decoder keeps
TEXTS = [
    b"step 1",
    b"STEP 12",
    b"Iteration 7",
    b"train_step 9",
    b"global step 3",
    b"ProfilerStep#5",
    b" \tbatch 4",
    b"aten::mm, seq = 7",
    b"aten::addmm, op_id = 11",
    b"forward",
    "ſtep 3".encode(),
    "\u212aernel 1".encode(),
    "\u00a0step 2".encode(),
    b"step\x00 1",
    b"\x00step 1",
    b"step \xff1",
    b"\xffstep 1",
    b"iter\xc0 2",
    b"x" * (MAX_TEXT + 10) + b" characters",
    b"",
]
PATTERNS = [
    bundled().nvtx["step"],
    r"^ProfilerStep#\d+",
    r"(?i)^iter",
    r"(?i)kernel",
    r"step \d+$",
    r"(?i)^\s*batch",
    r"characters\)$",
    r"^aten::(mm|addmm)\b",
    r"(?i)^STEP",
    r"\Atrain[_ ]step",
]


def _passing(pattern: str) -> tuple[list[bool], list[bool]]:
    """For each of TEXTS: whether the regex matches its decoded text, and whether the SQL
    condition holds for it, stored as TEXT the way nsys stores it."""
    condition = textfilter.text_condition("text", pattern)
    assert condition is not None
    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE t (text TEXT)")
    con.executemany("INSERT INTO t VALUES (CAST(? AS TEXT))", [(t,) for t in TEXTS])
    passed = [bool(p) for (p,) in con.execute(f"SELECT {condition} FROM t ORDER BY rowid")]
    raw = [b for (b,) in con.execute("SELECT CAST(text AS BLOB) FROM t ORDER BY rowid")]
    decoded, _repaired = decode_text(pl.Series(raw, dtype=pl.Binary))
    return decoded.str.contains(pattern).fill_null(False).to_list(), passed


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_text_the_regex_matches_passes_the_condition(pattern: str) -> None:
    matched, passed = _passing(pattern)
    assert any(matched)
    missed = [TEXTS[i] for i, (m, p) in enumerate(zip(matched, passed, strict=True)) if m and not p]
    assert not missed


def test_the_bundled_step_pattern_leaves_per_op_ranges_out() -> None:
    """What the condition is for: an op's range is not read (nor a phase's)."""
    _matched, passed = _passing(bundled().nvtx["step"])
    out = {TEXTS[i] for i, p in enumerate(passed) if not p}
    assert {b"aten::mm, seq = 7", b"aten::addmm, op_id = 11", b"forward"} <= out


def test_what_the_bundled_step_pattern_requires() -> None:
    pattern = bundled().nvtx["step"]
    assert textfilter.required_literals(pattern) == ["iter", "step", "batch", "global"]
    first = textfilter.first_characters(pattern)
    assert first is not None
    assert {chr(c) for c in first} == set("sStTiIbBgGpP") | set(" \t\n\x0b\x0c\r")


@pytest.mark.parametrize(
    "pattern",
    [
        r"[[:alpha:]]+step",  # a POSIX class in Rust, '[' ':' ... then ']' in Python
        r"x[a&&b]step",  # class intersection in Rust
        r"x[a--b]step",  # class difference
        r"x[a~~b]step",  # symmetric difference
        r"\pLstep",  # Unicode classes: Python refuses them
        r"(?<n>step)",  # named group syntax Python 3.11 refuses
        r"step|",  # matches the empty string
        r"a|b",  # no literal of two characters
    ],
)
def test_no_literal_is_derived_where_the_parse_may_differ_or_none_is_required(
    pattern: str,
) -> None:
    assert textfilter.required_literals(pattern) is None


@pytest.mark.parametrize(
    ("pattern", "first"),
    [
        ("(?m)^step", None),  # '^' after any newline
        ("step", None),  # not anchored
        ("^.step", None),
        ("^[^a]", None),
        ("^a?", None),  # may match nothing: any text
        ("^$", None),
        ("^(?i:a)b", "Aa"),
        ("^a*b", "ab"),
        (r"\Astep", "s"),
    ],
)
def test_first_characters_only_of_a_pattern_anchored_at_the_start(
    pattern: str, first: str | None
) -> None:
    got = textfilter.first_characters(pattern)
    assert (None if got is None else "".join(sorted(map(chr, got)))) == first


def test_like_wildcards_and_quotes_in_a_literal_are_escaped() -> None:
    condition = textfilter.text_condition("text", r"it%_e'r\\s")
    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE t (text TEXT)")
    con.executemany("INSERT INTO t VALUES (?)", [("it%_e'r\\s",), ("itXYe'r\\s",)])
    assert [bool(p) for (p,) in con.execute(f"SELECT {condition} FROM t ORDER BY rowid")] == [
        True,
        False,
    ]


@pytest.mark.parametrize("pattern", [bundled().nvtx["step"], r"^aten::addmm\b"])
def test_the_scan_of_an_emit_nvtx_export_finds_the_same_rows(pattern: str, monkeypatch) -> None:
    """Ulysses (a public export, PyTorch's emit_nvtx: 18,656 ranges keeping their numbered
    text in the row): pass 1 picks the same rows with the condition as with every text read
    and matched, and with it far fewer rows come back from the scan."""
    path = trace_path("ulysses_2gpu_forward_window")  # (fixtures/external in a clone)
    returned: dict[str, int] = {}

    def scan(condition: bool) -> tuple[pl.DataFrame, list[int] | None]:
        if not condition:
            monkeypatch.setattr(nvtx_rows, "text_condition", lambda _column, _pattern: None)
        reader = Reader(inspect_export(path))
        sql = reader.sql

        def counted(query):
            out = sql(query)
            if "AS wanted" in str(query):
                returned[str(condition)] = returned.get(str(condition), 0) + out.height
            return out

        monkeypatch.setattr(reader, "sql", counted)
        rows, payloads, _long = nvtx_rows.step_rows(reader, pattern)
        monkeypatch.undo()
        return rows.sort("start", "global_tid"), payloads

    (with_condition, payloads), (without, payloads_without) = scan(True), scan(False)
    assert with_condition.equals(without)
    assert payloads == payloads_without
    assert returned["False"] > 18_000
    assert returned["True"] < returned["False"] // 10


# (pattern, text) pairs a review found the first version leaving out: Rust's (?i) folds the
# long s and the Kelvin sign to ASCII letters; unicode() is NULL for a text starting with NUL;
# Rust's word boundaries \< \> \b{start}, counted repetitions with spaces and verbose mode,
# which Python's parser reads as literal text
MISSED_ONCE = [
    ("(?i)^\u017ftep", b"step"),
    ("(?i)^\u212aernel", b"kernel"),
    ("^(?i:\u212a)ernel", b"Kernel"),
    ("(?i)^[\u017f]tep", b"Step"),
    ("(?i)^[\u0100-\u0200]tep", b"step"),
    ("(?i)^[\u2000-\u2200]ernel", b"kernel"),
    ("(?i)^(?:\u212a|x)ernel", b"kernel"),
    ("^\\x00a", b"\x00a"),
    ("^[\\x00-\\x20]step", b"\x00step"),
    ("\\<step", b"a step"),
    ("step\\>", b"step"),
    ("\\b{start}step", b"step"),
    ("^\\<step", b"step"),
    ("s{ 1 }tep", b"step"),
    ("ste(?:p){1 ,2}", b"step"),
    ("step{1, 2}", b"step"),
    ("(?x)x[#\n]a]step", b"xastep"),
    ("(?x)s{1, 2}tep", b"step"),
    ("(?x)^\u00a0step", b"step"),
]


@pytest.mark.parametrize(("pattern", "text"), MISSED_ONCE)
def test_texts_a_review_found_left_out_pass(pattern: str, text: bytes) -> None:
    decoded, _repaired = decode_text(pl.Series([text], dtype=pl.Binary))
    assert decoded.str.contains(pattern).item()
    condition = textfilter.text_condition("text", pattern)
    if condition is None:  # (no condition: every text is read)
        return
    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE t (text TEXT)")
    con.execute("INSERT INTO t VALUES (CAST(? AS TEXT))", (text,))
    assert con.execute(f"SELECT {condition} FROM t").fetchone()[0]


def test_a_long_required_literal_is_tested_by_its_start() -> None:
    """SQLite refuses LIKE patterns past 50,000 bytes: the first 1,000 characters of the
    literal are tested (its start is required too)."""
    condition = textfilter.text_condition("text", "a" * 60_000)
    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE t (text TEXT)")
    con.executemany("INSERT INTO t VALUES (?)", [("a" * 60_000,), ("b",)])
    assert [p for (p,) in con.execute(f"SELECT {condition} FROM t ORDER BY rowid")] == [1, 0]
