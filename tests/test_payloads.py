"""The NVTX extended-payload decoder (traceclf/ingest/payloads.py) on real H100 exports made with
``--include-blobs=true``, each number cross-checked by an independent decode in the test (plain
sqlite3 and ``struct``, the offsets read from the export's schema rows), and on constructed
blobs for the layouts and the damage no real trace holds (said so in each test)."""

from __future__ import annotations

import random
import sqlite3
import struct
from pathlib import Path

import polars as pl
import pytest
from conftest import fixture_trace

from traceclf.ingest.payload_schemas import MAX_DEPTH, PayloadSchemas
from traceclf.ingest.payloads import (
    MAX_BLOB_BYTES,
    MAX_ELEMENTS,
    MAX_LOOP_EVENTS,
    decode,
    read_payload_events,
)
from traceclf.ingest.reader import Reader
from traceclf.ingest.schema import ExportInfo, inspect_export

MiB = 1 << 20


def _reader(name: str) -> Reader:
    return Reader(inspect_export(fixture_trace(name)))


def _independent(path: Path, schema_id: int) -> list[tuple[int, bytes]]:
    """(start, payload bytes) of every event carrying ``schema_id``, decoded by hand."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    out = []
    for start, blob in con.execute(
        "SELECT start, CAST(binaryData AS BLOB) FROM NVTX_EVENTS WHERE binaryData IS NOT NULL "
        "ORDER BY start"
    ):
        (count,) = struct.unpack_from("<Q", blob, 0)
        for k in range(count):
            sid, size, offset = struct.unpack_from("<QQQ", blob, 8 + 24 * k)
            if sid == schema_id:
                out.append((start, blob[offset : offset + size]))
    return out


def _entry_offset(path: Path, schema_id: int, name: str) -> int:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    (offset,) = con.execute(
        "SELECT coalesce(offset, 0) FROM NVTX_PAYLOAD_SCHEMA_ENTRIES WHERE schemaId = ? "
        "AND name = ? LIMIT 1",
        (schema_id, name),
    ).fetchone()
    return int(offset)


# ------------------------------------------------------------------------ real: NCCL payloads


def test_nccl_message_sizes_and_reduction_from_real_blobs():
    """h100_nccl_groups: the all-reduce of group "dp" is 16 MiB fp32 summed, the all-to-all of
    group "ep" 4 MiB per peer (8 MiB over 2 ranks), each on its own communicator
    (fixtures/README.md; /tmp/notes: communicators 3ED9987C0D865C7D and 1277FCB9BE81914A as
    little-endian bytes). A third communicator carries two 4-byte all-reduces (a barrier)."""
    reader = _reader("h100_nccl_groups")
    schemas = PayloadSchemas.read(reader)
    events, too_big = read_payload_events(reader)
    assert too_big == 0
    (allreduce,) = schemas.find(entry="Reduction operation")
    sized = schemas.find(entry="Message size [bytes]")
    (alltoall,) = [s for s in sized if s.schema_id != allreduce.schema_id]
    ar, a2a = decode(events, allreduce), decode(events, alltoall)
    assert ar.skipped == a2a.skipped == ar.unreadable == 0
    dp = int.from_bytes(bytes.fromhex("3ED9987C0D865C7D"), "little")
    ep = int.from_bytes(bytes.fromhex("1277FCB9BE81914A"), "little")
    sizes = ar.values.group_by("NCCL communicator ID").agg(
        pl.col("Message size [bytes]").unique(), pl.len()
    )
    by_comm = {r[0]: (r[1], r[2]) for r in sizes.iter_rows()}
    assert by_comm[dp] == ([16 * MiB], 24)
    (barrier,) = set(by_comm) - {dp}
    assert by_comm[barrier] == ([4], 2)
    assert set(ar.values["Reduction operation"]) == {"Sum"}
    assert set(a2a.values["NCCL communicator ID"]) == {ep}
    assert set(a2a.values["Message size [bytes]"]) == {4 * MiB}

    # independently: every payload of those schemas, the size at the schema's own offset
    path = fixture_trace("h100_nccl_groups")
    for layout, got in ((allreduce, ar), (alltoall, a2a)):
        at = _entry_offset(path, layout.schema_id, "Message size [bytes]")
        expected = [
            (start, struct.unpack_from("<Q", p, at)[0], struct.unpack_from("<Q", p, 0)[0])
            for start, p in _independent(path, layout.schema_id)
        ]
        rows = got.values.sort("start", "event").select(
            "start", "Message size [bytes]", "NCCL communicator ID"
        )
        assert sorted(rows.rows()) == sorted(expected)


def test_nccl_communicators_ranks_from_real_blobs():
    """The communicator-init payloads: 2 ranks each, ranks 0 and 1 in every communicator."""
    reader = _reader("h100_nccl_groups")
    schemas = PayloadSchemas.read(reader)
    events, _ = read_payload_events(reader, "domainId = 1")
    inits = [decode(events, s).values for s in schemas.find(entry="No. of ranks")]
    table = pl.concat([v.select("NCCL communicator ID", "No. of ranks", "Rank") for v in inits])
    per_comm = table.group_by("NCCL communicator ID").agg(
        pl.col("No. of ranks").unique(), pl.col("Rank").unique().sort()
    )
    assert per_comm.height == 3  # "ep", "dp" and the one of the closing barrier
    assert per_comm["No. of ranks"].to_list() == [[2]] * 3
    assert per_comm["Rank"].to_list() == [[0, 1]] * 3


# ------------------------------------------------------------ real: nsys's Python backtraces


def test_python_samples_nested_frames_from_real_blobs():
    """h100_host_slow_loader: nsys's Python periodic samples (a dynamic schema: thread state
    enum, a frame count, then that many {Function, File, Line} structs of string handles)
    decode to the same frames as a by-hand decode of every blob."""
    reader = _reader("h100_host_slow_loader")
    schemas = PayloadSchemas.read(reader)
    (layout,) = schemas.find("Python Periodic Sampling")
    assert layout.fixed  # offsets known from the schema: read at once, no per-event loop
    events, _ = read_payload_events(reader)
    got = decode(events, layout)
    assert got.skipped == got.unreadable == got.clipped == 0
    frames = got.arrays["Frames"]
    assert got.values.height == 2093
    # by hand: the frame count at the "Frames count" offset, 24-byte frames at "Frames"
    path = fixture_trace("h100_host_slow_loader")
    at_count = _entry_offset(path, layout.schema_id, "Frames count")
    at_frames = _entry_offset(path, layout.schema_id, "Frames")
    expected = []
    for start, p in _independent(path, layout.schema_id):
        (n,) = struct.unpack_from("<I", p, at_count)
        for i in range(n):
            fn, file, line = struct.unpack_from("<QQi", p, at_frames + 24 * i)
            expected.append((start, i, fn, file, line))
    rows = frames.join(got.values.select("event", "start"), on="event").select(
        "start", "index", "Function", "File", "Line"
    )
    assert sorted(rows.rows()) == sorted(expected)
    assert frames.height == len(expected) == int(got.values["Frames count"].sum())
    # the handles are StringIds ids: the workload's own file is among the frames
    strings = reader.strings.filter(pl.col("value").str.ends_with("workloads/slow_loader.py"))
    assert frames["File"].is_in(strings["id"].implode()).any()
    assert set(got.values["Thread state"]) <= {"Running", "Blocking Wait", "Uninterruptible"}


# --------------------------------------------- constructed: layouts and damage (no real trace)

SCHEMA_COLS = ["domainId", "schemaId", "name", "type", "payloadSize", "alignTo"]
ENTRY_COLS = [
    "domainId",
    "schemaId",
    "idx",
    "flags",
    "type",
    "name",
    "arrayOrUnionDetail",
    "offset",
]


def _schemas(schemas: list[tuple], entries: list[tuple], enums=(), enum_entries=()):
    frame = pl.DataFrame(schemas, schema=SCHEMA_COLS, orient="row")
    entry = pl.DataFrame(entries, schema=ENTRY_COLS, orient="row")
    enum = pl.DataFrame(list(enums), schema=["domainId", "schemaId", "name", "size"], orient="row")
    labels = pl.DataFrame(
        list(enum_entries), schema=["domainId", "schemaId", "idx", "name", "value"], orient="row"
    )
    return PayloadSchemas(frame, entry, enum, labels)


def _blob(schema_id: int, payload: bytes, *, count: int = 1, size: int | None = None) -> bytes:
    header = struct.pack("<Q", count) + struct.pack(
        "<QQQ", schema_id, len(payload) if size is None else size, 8 + 24
    )
    return header + payload


def _events(*blobs: bytes | None) -> pl.DataFrame:
    return pl.DataFrame(
        {"start": list(range(len(blobs))), "domain_id": [1] * len(blobs), "data": list(blobs)},
        schema={"start": pl.Int64, "domain_id": pl.Int64, "data": pl.Binary},
    )


STATIC = 16777300
FRAME = 4294967296
SAMPLE = 4294967297


def _flat():
    """Constructed: a static struct {u64 id; size_t bytes; enum op} like NCCL's."""
    return _schemas(
        [(1, STATIC, "flat", 1, 24, None)],
        [
            (1, STATIC, 0, None, 18, "id", None, None),
            (1, STATIC, 1, None, 22, "bytes", None, 8),
            (1, STATIC, 2, None, 16777400, "op", None, 16),
        ],
        enums=[(1, 16777400, "", 4)],
        enum_entries=[(1, 16777400, 0, "Sum", None), (1, 16777400, 1, "Max", 1)],
    ).layout(1, STATIC)


def test_constructed_damaged_blobs_are_skipped_and_counted_never_raised():
    """Constructed: every way a blob can lie — cut short, a size or offset past its end, a
    header that names no payload, a count near 2**64 — is counted, never an exception."""
    layout = _flat()
    good = struct.pack("<QQI4x", 7, 3 * MiB, 1)
    events = _events(
        _blob(STATIC, good),  # fine
        _blob(STATIC, good)[:-5],  # cut inside the payload
        _blob(STATIC, good, size=1 << 40),  # size past the end
        _blob(STATIC, good)[:20],  # cut inside the header
        struct.pack("<Q", 0) + good,  # no payload
        struct.pack("<Q", (1 << 64) - 1) + _blob(STATIC, good)[8:],  # count near 2**64
        _blob(STATIC + 1, good),  # another schema: not this layout's, not damage
        None,
        _blob(STATIC, good[:8]),  # too short for the fields
    )
    got = decode(events, layout)
    assert got.values["start"].to_list() == [0]
    row = got.values.row(0, named=True)
    assert (row["id"], row["bytes"], row["op"]) == (7, 3 * MiB, "Max")
    assert got.skipped == 3  # cut, size past the end, too short
    assert got.unreadable == 4  # header cut, count 0, count near 2**64, no blob at all


def test_constructed_unknown_enum_value_reads_as_its_number():
    """Constructed: an enum value the schema does not name is reported as the number."""
    got = decode(_events(_blob(STATIC, struct.pack("<QQI4x", 1, 2, 9))), _flat())
    assert got.values["op"].to_list() == ["9"]


def _sampling(count_type: int = 16, frames_offset: int | None = 16, extra: bool = False):
    """Constructed: nsys's Python sampling shape, optionally with the array's offset left to
    the data and an entry after the array (offsets that only the data can tell)."""
    entries = [
        (1, FRAME, 0, None, 80, "Function", None, None),
        (1, FRAME, 1, None, 80, "File", None, 8),
        (1, FRAME, 2, None, 15, "Line", None, 16),
        (1, SAMPLE, 0, None, 18, "Thread state ID", None, None),
        (1, SAMPLE, 1, None, count_type, "Frames count", None, 8),
        (1, SAMPLE, 2, 48, FRAME, "Frames", 1, frames_offset),
    ]
    if extra:
        entries.append((1, SAMPLE, 3, None, 18, "After", None, None))
    return _schemas(
        [(1, FRAME, "", 1, 24, None), (1, SAMPLE, "sampling", 2, None, None)], entries
    ).layout(1, SAMPLE)


def _frames(n: int, *, extra: int | None = None) -> bytes:
    body = struct.pack("<QI4x", 5, n) + b"".join(
        struct.pack("<QQi4x", 100 + i, 200 + i, i) for i in range(n)
    )
    return body + (struct.pack("<Q", extra) if extra is not None else b"")


def test_constructed_array_lengths_are_bounded():
    """Constructed: a frame count larger than the payload holds, or near 2**63, skips the event;
    more than MAX_ELEMENTS frames are cut to MAX_ELEMENTS and counted as clipped."""
    layout = _sampling(count_type=18)
    liar = bytearray(_frames(2))
    struct.pack_into("<Q", liar, 8, 1 << 62)  # a count whose byte size would wrap
    events = _events(
        _blob(SAMPLE, _frames(3)),
        _blob(SAMPLE, _frames(3))[:-24],  # says 3, holds 2
        _blob(SAMPLE, bytes(liar)),
        _blob(SAMPLE, _frames(MAX_ELEMENTS + 10)),
    )
    got = decode(events, layout)
    assert got.values["start"].to_list() == [0, 3]
    assert got.skipped == 2
    assert got.clipped == 10
    frames = got.arrays["Frames"]
    assert frames.filter(pl.col("event") == 0)["Function"].to_list() == [100, 101, 102]
    assert frames.filter(pl.col("event") == 3).height == MAX_ELEMENTS


def test_constructed_data_dependent_offsets_take_the_bounded_loop():
    """Constructed: an entry after a variable-length array has its place only in the data:
    decoded event by event, with the same values as the vectorised path gives for the rest."""
    layout = _sampling(frames_offset=None, extra=True)
    assert layout is not None and not layout.fixed
    events = _events(_blob(SAMPLE, _frames(2, extra=77)), _blob(SAMPLE, _frames(3)))
    got = decode(events, layout)
    assert got.values["After"].to_list() == [77]  # the second holds no "After": skipped
    assert got.skipped == 1
    assert got.arrays["Frames"]["File"].to_list() == [200, 201]
    vectorised = decode(_events(_blob(SAMPLE, _frames(2))), _sampling())
    assert vectorised.arrays["Frames"].equals(got.arrays["Frames"])


def test_constructed_loop_is_bounded(monkeypatch):
    """Constructed: the per-event path reads at most MAX_LOOP_EVENTS events; the rest are
    skipped and counted."""
    import traceclf.ingest.payloads as payloads

    monkeypatch.setattr(payloads, "MAX_LOOP_EVENTS", 3)
    layout = _sampling(frames_offset=None, extra=True)
    events = _events(*[_blob(SAMPLE, _frames(1, extra=i)) for i in range(5)])
    got = decode(events, layout)
    assert got.values.height == 3 and got.skipped == 2
    assert MAX_LOOP_EVENTS > 1000  # (the real bound)


def test_constructed_schemas_that_cannot_be_trusted_have_no_layout():
    """Constructed: a schema nested in itself, nested too deep, declared twice differently,
    with an offset past any payload, or with a type of unknown size gives no layout (so
    nothing is decoded with it) rather than a wrong one or an exception."""
    base = 16777500
    cycle = _schemas(
        [(1, base, "a", 1, None, None), (1, base + 1, "b", 1, None, None)],
        [(1, base, 0, None, base + 1, "b", None, None), (1, base + 1, 0, None, base, "a", None, 0)],
    )
    assert cycle.layout(1, base) is None
    chain = [(1, base + i, 0, None, base + i + 1, "x", None, None) for i in range(MAX_DEPTH + 2)]
    chain.append((1, base + MAX_DEPTH + 2, 0, None, 18, "leaf", None, None))
    deep = _schemas([(1, base + i, "", 1, None, None) for i in range(MAX_DEPTH + 3)], chain)
    assert deep.layout(1, base) is None
    assert deep.layout(1, base + 3) is not None  # shallow enough from further down
    twice = _schemas(
        [(1, base, "t", 1, None, None)],
        [(1, base, 0, None, 18, "x", None, None), (1, base, 0, None, 17, "x", None, None)],
    )
    assert twice.layout(1, base) is None and twice.find("t") == []
    far = _schemas([(1, base, "f", 1, None, None)], [(1, base, 0, None, 18, "x", None, 1 << 40)])
    assert far.layout(1, base) is None
    cstring = _schemas([(1, base, "c", 1, None, None)], [(1, base, 0, None, 75, "s", None, 0)])
    assert cstring.layout(1, base) is None


def test_constructed_nested_struct_and_natural_alignment():
    """Constructed: a struct inside a struct is flattened with dotted names; entries without
    an offset follow natural alignment (u8 then u64: the u64 at 8)."""
    inner, outer = 16777600, 16777601
    schemas = _schemas(
        [(1, inner, "", 1, None, None), (1, outer, "outer", 1, None, None)],
        [
            (1, inner, 0, None, 12, "tag", None, None),
            (1, inner, 1, None, 18, "value", None, None),
            (1, outer, 0, None, 20, "ratio", None, None),
            (1, outer, 1, None, inner, "pair", None, None),
            (1, outer, 2, None, 21, "wide", None, None),  # long double: place kept, null
        ],
    )
    layout = schemas.layout(1, outer)
    assert [(f.name, f.offset) for f in layout.fields] == [
        ("ratio", 0),
        ("pair.tag", 8),
        ("pair.value", 16),
        ("wide", 32),
    ]
    payload = struct.pack("<dB7xQ", 0.5, 3, 1 << 40) + bytes(24)  # (8 to reach 32, 16)
    row = decode(_events(_blob(outer, payload)), layout).values.row(0, named=True)
    assert (row["ratio"], row["pair.tag"], row["pair.value"], row["wide"]) == (
        0.5,
        3,
        1 << 40,
        None,
    )


def test_constructed_zero_terminated_array():
    """Constructed: a zero-terminated array of u32 ends at its first zero element."""
    sid = 16777700
    layout = _schemas(
        [(1, sid, "z", 2, None, None)],
        [(1, sid, 0, 32, 16, "ids", None, 0)],
    ).layout(1, sid)
    payload = struct.pack("<IIII", 4, 5, 0, 9)
    got = decode(_events(_blob(sid, payload), _blob(sid, struct.pack("<II", 1, 2))), layout)
    assert got.arrays["ids"]["ids"].to_list() == [4, 5]
    assert got.skipped == 1  # no terminating zero


def test_constructed_random_bytes_never_raise():
    """Constructed: thousands of random blobs (fixed seed) decode without an exception."""
    rng = random.Random(25)
    blobs = [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 120))) for _ in range(3000)]
    # some with a plausible header, so the payload checks are reached too
    blobs += [_blob(SAMPLE, b[: rng.randrange(0, len(b) + 1)]) for b in blobs[:1000]]
    for layout in (_sampling(), _sampling(frames_offset=None, extra=True), _flat()):
        got = decode(_events(*blobs), layout)
        assert got.values.height + got.skipped + got.unreadable <= len(blobs)


def test_oversized_blobs_are_not_read(tmp_path: Path):
    """Constructed export: a blob over MAX_BLOB_BYTES is counted, not read."""
    path = tmp_path / "big.sqlite"
    con = sqlite3.connect(path)
    con.execute(
        "CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, "
        "globalTid INTEGER, domainId INTEGER, textId INTEGER, binaryData TEXT)"
    )
    rows = [
        (1, None, 34, 1, 1, None, _blob(STATIC, bytes(24))),
        (2, None, 34, 1, 1, None, bytes(MAX_BLOB_BYTES + 1)),
    ]
    con.executemany("INSERT INTO NVTX_EVENTS VALUES (?,?,?,?,?,?,?)", rows)
    con.commit()
    con.close()

    columns = ("start", "end", "eventType", "globalTid", "domainId", "textId", "binaryData")
    reader = Reader(ExportInfo(path, None, None, {"NVTX_EVENTS": columns}))
    events, too_big = read_payload_events(reader)
    assert too_big == 1
    assert events["start"].to_list() == [1]
    assert events.schema["data"] == pl.Binary


@pytest.mark.parametrize("name", ["h100_comm_ep2"])
def test_schemas_without_blobs_decode_nothing(name: str):
    """A real export made without --include-blobs: schemas declared, no payload to read."""
    reader = _reader(name)
    assert PayloadSchemas.read(reader).find()  # NCCL declared its schemas
    events, too_big = read_payload_events(reader)
    assert events.is_empty() and too_big == 0
