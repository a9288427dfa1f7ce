"""Communication per communicator, for one rank: which communicator each communication kernel
served (NCCL's payloads: :mod:`traceclf.measures.comm_calls`; without them, its stream), and
per communicator the collective kinds and NCCL calls it ran, message bytes, kernel time, the
time it was exposed (no compute running) and blocked compute per step, and the clues to its
parallel dimension (where its calls were launched: NVTX forward ranges, ranges whose name
says a dimension).

Exposed time is shared: while kernels of several communicators run with no compute, each gets
an equal part, so the communicators' exposed times add up to the rank's exposed
communication. Blocking time is each blocking piece's producer kernel's (the critical path:
:mod:`traceclf.measures.critical_path`), so they add up to its blocking communication.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.measures.collectives import stream_keys
from traceclf.measures.comm_calls import communicator_sizes
from traceclf.measures.critical_path import CommBlocking
from traceclf.measures.window import RankWindow
from traceclf.model.taxonomy import matches

MAX_NAMES = 4  # NVTX range names kept per communicator as dimension clues
NS_PER_MS = 1e6


def hex_id(comm_id: int) -> str:
    """A communicator id as NCCL's logs print it (``commId 0x...``)."""
    return f"0x{int(comm_id):016x}"


def with_keys(comm_all: pl.DataFrame) -> pl.DataFrame:
    """``comm_all`` (the rank's refined communication kernels, :func:`traceclf.measures.
    communication.refine_kinds`) with ``group``: its communicator's id, or ``comm stream N``
    where no payload names it (:func:`~traceclf.measures.collectives.stream_keys`)."""
    ids = comm_all["comm_id"].drop_nulls().unique().to_list()
    names = pl.DataFrame(
        {"comm_id": ids, "_hex": [hex_id(i) for i in ids]},
        schema={"comm_id": pl.UInt64, "_hex": pl.String},
    )
    return (
        comm_all.join(stream_keys(comm_all), on="stream_id", how="left")
        .join(names, on="comm_id", how="left")
        .with_columns(
            # (a kernel without a stream id: no key, a stream no other matches)
            group=pl.coalesce("_hex", "stream", pl.lit("comm stream unknown"))
        )
        .drop("_hex", "stream")
    )


def groups_of(w: RankWindow, keyed: pl.DataFrame, blocking: list[CommBlocking]) -> list[dict]:
    """One record per communicator whose kernels run in the window (``keyed``: the rank's
    communication kernels of the whole capture, :func:`with_keys`)."""
    spans = w.spans
    starting = keyed.filter(intervals.inside("start", spans))
    if starting.is_empty():
        return []
    clipped = intervals.clip(keyed.sort("start"), spans)
    groups = sorted(starting["group"].unique().to_list())
    exposed, busy = _exposed(w, clipped, groups)
    blocked = _blocked(keyed, blocking, spans)
    clues = _clues(w, starting)
    sizes = communicator_sizes(w.trace)
    n = w.n_steps
    out = []
    for key in groups:
        rows = starting.filter(pl.col("group") == key)
        comm_id = rows["comm_id"].drop_nulls()
        size = sizes.get(int(comm_id[0])) if len(comm_id) else None
        out.append(
            {
                "id": key,
                "comm_id": key if len(comm_id) else None,
                "nranks": size[0] if size else None,
                "rank_in_comm": size[1] if size else None,
                "kinds": sorted(rows["comm_kind"].cast(pl.String).unique().to_list()),
                "stream_ids": sorted(rows["stream_id"].drop_nulls().unique().to_list()),
                "kernels": rows.height,
                "calls": _calls(rows),
                "busy_ms_per_step": round(busy.get(key, 0) / NS_PER_MS / n, 4),
                "exposed_ms_per_step": round(exposed.get(key, 0.0) / NS_PER_MS / n, 4),
                # (of the window's wall, as every *_frac: the steps' mean leaves out the
                # outliers a window holds, and exposed time over it passed 100%)
                "exposed_frac": round(exposed.get(key, 0.0) / max(w.wall, 1), 4),
                "blocking_ms_per_step": round(blocked.get(key, 0) / NS_PER_MS / n, 4),
                "peers": _max(rows["peers"]),
                "clues": clues.get(key, {}),
            }
        )
    return out


def _calls(rows: pl.DataFrame) -> list[dict]:
    """Per NCCL call and kind: kernels, NCCL message bytes summed (null when a kernel's size is
    unknown) and kernel time (whole kernels starting in the window)."""
    per = (
        rows.group_by("call", pl.col("comm_kind").cast(pl.String).alias("kind"))
        .agg(
            kernels=pl.len(),
            msg_bytes=pl.when(pl.col("msg_bytes").null_count() == 0).then(
                pl.col("msg_bytes").sum()
            ),
            kernel_ns=(pl.col("end") - pl.col("start")).sum(),
        )
        .sort("kernel_ns", descending=True)
    )
    return [
        {
            "call": r["call"],
            "kind": r["kind"],
            "kernels": r["kernels"],
            "msg_bytes": r["msg_bytes"],
            "kernel_ms": round(r["kernel_ns"] / NS_PER_MS, 4),
        }
        for r in per.iter_rows(named=True)
    ]


def _exposed(
    w: RankWindow, clipped: pl.DataFrame, groups: list[str]
) -> tuple[dict[str, float], dict[str, int]]:
    """ns each communicator's kernels run with no compute (shared equally while several run),
    and ns they run at all, in the window."""
    layers = {"compute": w.compute} | {
        f"g{i}": clipped.filter(pl.col("group") == g).select("start", "end")
        for i, g in enumerate(groups)
    }
    seg = intervals.sweep(layers, w.spans)
    names = [f"g{i}" for i in range(len(groups))]
    if seg.is_empty():
        return {}, {}
    active = seg.select(names).to_numpy() > 0
    dur = seg["dur"].to_numpy()
    alone = (seg["compute"].to_numpy() == 0) & active.any(axis=1)
    share = np.where(alone, dur / np.maximum(active.sum(axis=1), 1), 0.0)
    exposed = (active * share[:, None]).sum(axis=0)
    busy = (active * dur[:, None]).sum(axis=0)
    return (
        {g: float(exposed[i]) for i, g in enumerate(groups)},
        {g: int(busy[i]) for i, g in enumerate(groups)},
    )


def _blocked(
    keyed: pl.DataFrame, blocking: list[CommBlocking], spans: intervals.Spans
) -> dict[str, int]:
    """ns of blocking each communicator's kernels caused in the window (pieces outside it, as
    the step budget counts them, left out)."""
    if not blocking:
        return {}
    lo, hi = intervals.spans_of(spans)[0][0], intervals.spans_of(spans)[-1][1]
    start = np.concatenate([b[0] for b in blocking])
    end = np.concatenate([b[1] for b in blocking])
    corr = np.concatenate([b[2] for b in blocking])
    dur = np.minimum(end, hi) - np.maximum(start, lo)
    pieces = pl.DataFrame({"correlation_id": corr, "ns": np.maximum(dur, 0)}).filter(
        pl.col("ns") > 0
    )
    per = (
        pieces.join(
            keyed.select("correlation_id", "group").unique("correlation_id"), on="correlation_id"
        )
        .group_by("group")
        .agg(pl.col("ns").sum())
    )
    return dict(per.iter_rows())


def _clues(w: RankWindow, starting: pl.DataFrame) -> dict[str, dict]:
    """Per communicator, where its kernels were launched: how many inside an NVTX forward
    range (and whether the rank has any), and the NVTX ranges around the launches whose name
    says a dimension (taxonomy comm_dimensions: dimension, name, kernels)."""
    trace, tax = w.trace, w.taxonomy
    nvtx = trace.nvtx
    forward = nvtx.filter(matches(nvtx["text"], tax.nvtx["forward"])) if nvtx.height else nvtx
    kernels = starting.select("pid", "correlation_id", "group", "comm_kind")
    in_forward = pl.Series(trace.launched_within(kernels, forward)) if forward.height else None
    named = (
        nvtx.with_columns(dimension=tax.comm_dimension()).filter(pl.col("dimension").is_not_null())
        if nvtx.height and tax.comm_dimensions
        else None
    )
    around = (
        trace.launched_in(kernels, named.select("start", "end", "text"), "text")
        if named is not None and named.height
        else pl.Series("text", [None] * kernels.height, dtype=pl.String)
    )
    tagged = kernels.with_columns(
        in_forward=in_forward if in_forward is not None else pl.lit(False),
        nvtx=around.cast(pl.String),
    )
    out: dict[str, dict] = {}
    for (key,), rows in tagged.group_by(["group"]):
        forward_kinds = rows.filter(pl.col("in_forward"))["comm_kind"].cast(pl.String)
        names = (
            rows.drop_nulls("nvtx")
            .group_by("nvtx")
            .len()
            .sort("len", "nvtx", descending=[True, False])
            .head(MAX_NAMES)
            .with_columns(dimension=tax.comm_dimension("nvtx"))
        )
        out[str(key)] = {
            "has_forward": bool(forward.height),
            "forward_kinds": sorted(set(forward_kinds.to_list())),
            "nvtx": [
                {"name": r["nvtx"], "dimension": r["dimension"], "kernels": r["len"]}
                for r in names.iter_rows(named=True)
            ],
        }
    return out


def _max(values: pl.Series) -> int | None:
    m = values.max()
    return None if m is None else int(m)  # type: ignore[arg-type]
