"""NCCL's own NVTX ranges with their payload values decoded: one row per NCCL API call whose
range carries a payload (a collective, a send or receive, a communicator's creation), with the
communicator, its size and this process's rank in it, the message size, the peer.

NCCL (2.19 and later) registers its payload schemas with NVTX (``NVTX_PAYLOAD_SCHEMAS``); the
values reach an export only when it was made with ``nsys export --include-blobs=true``
(:mod:`traceclf.ingest.payloads` decodes them by those schemas). The schemas are found by their
entry names, which are NCCL's (``src/include/nvtx_payload_schemas.h``), never by schema id:
ids are assigned at run time. Only ranges of a domain named ``NCCL`` by the process that
created it are read, since domain ids are each process's own.
"""

from __future__ import annotations

import polars as pl

from traceclf.ingest.payload_schemas import PayloadSchemas
from traceclf.ingest.payloads import decode, read_payload_events
from traceclf.ingest.reader import Reader, decode_pid

NCCL_DOMAIN = "NCCL"
NVTX_DOMAIN_CREATE = 75  # (the event type nsys gives a domain's creation)
# NCCL's payload entries -> the columns they fill; a schema is NCCL's when it has the first.
ENTRIES = {
    "NCCL communicator ID": "comm_id",
    "No. of ranks": "nranks",
    "Rank": "rank",
    "Message size [bytes]": "bytes",
    "Peer rank": "peer",
    "Root": "root",
    "Reduction operation": "reduce_op",
}
COLUMNS: dict[str, pl.DataType] = {
    "start": pl.Int64(),
    "end": pl.Int64(),
    "pid": pl.Int32(),
    "global_tid": pl.Int64(),
    "call": pl.String(),  # the NCCL API call the range is named for: ncclAllReduce, ncclSend...
    "comm_id": pl.UInt64(),
    "nranks": pl.Int64(),
    "rank": pl.Int64(),
    "bytes": pl.Int64(),
    "peer": pl.Int64(),
    "root": pl.Int64(),
    "reduce_op": pl.String(),
}


def empty() -> pl.DataFrame:
    return pl.DataFrame(schema=COLUMNS)


def read_nccl_calls(reader: Reader) -> pl.DataFrame:
    """Every NCCL range of the capture that carries a payload, decoded (:data:`COLUMNS`, in
    start order); empty when the export has no payload values (made without
    ``--include-blobs``) or no NCCL schema. A payload that does not fit its schema is left
    out (the decoder counts and skips it)."""
    columns = reader.info.columns.get("NVTX_EVENTS", ())
    if "binaryData" not in columns or not reader.info.has("NVTX_PAYLOAD_SCHEMA_ENTRIES"):
        return empty()
    domains = _nccl_domains(reader)
    if domains.is_empty():
        return empty()
    schemas = PayloadSchemas.read(reader)
    layouts = schemas.find(entry=next(iter(ENTRIES)))
    if not layouts:
        return empty()
    ids = ", ".join(str(int(d)) for d in domains["domain_id"].unique().to_list())
    events, _ = read_payload_events(reader, f"domainId IN ({ids})")
    events = (
        events.with_columns(pid=decode_pid("global_tid"))
        .join(domains, on=["pid", "domain_id"], how="semi")
        .join(reader.strings.rename({"id": "text_id", "value": "call"}), on="text_id", how="left")
    )
    frames = []
    for layout in layouts:
        values = decode(events, layout).values
        if values.is_empty():
            continue
        present = {name: col for name, col in ENTRIES.items() if name in values.columns}
        frames.append(
            values.select(
                *[pl.col(c) for c in ("start", "end", "pid", "global_tid", "call")],
                *[pl.col(name).alias(col) for name, col in present.items()],
            )
        )
    if not frames:
        return empty()
    out = pl.concat(frames, how="diagonal_relaxed")
    return (
        out.with_columns(pl.lit(None).alias(c) for c in COLUMNS if c not in out.columns)
        .select(pl.col(c).cast(t, strict=False) for c, t in COLUMNS.items())
        .sort("start", "global_tid")
    )


def _nccl_domains(reader: Reader) -> pl.DataFrame:
    """(pid, domain_id) of every NVTX domain a process created under NCCL's name."""
    rows = reader.sql(
        f"SELECT globalTid AS global_tid, domainId AS domain_id FROM NVTX_EVENTS "
        f"WHERE eventType = {NVTX_DOMAIN_CREATE} AND text = '{NCCL_DOMAIN}'"
    )
    if rows.is_empty():
        return pl.DataFrame(schema={"pid": pl.Int32, "domain_id": pl.Int64})
    return rows.select(
        pid=decode_pid("global_tid").cast(pl.Int32), domain_id=pl.col("domain_id").cast(pl.Int64)
    ).unique()
