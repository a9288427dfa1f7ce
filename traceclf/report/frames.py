"""The report's tables as polars frames, one per table, with raw numbers (ns, ms, fractions):
what ``--export-dir`` writes as CSV or Parquet, ``--format csv`` prints (``ranks``), and
``Report.to_pandas`` returns.

| table | one row per | from |
|---|---|---|
| ``steps`` | rank and steady step | ``series[].step_breakdown`` |
| ``ranks`` | rank | ``ranks[]`` and their ``metrics`` |
| ``kernels`` | rank and kernel name | ``series[].kernel_summary`` (like ``cuda_gpu_kern_sum``) |
| ``idle_gaps`` | idle gap (the longest of each rank) | ``series[].longest_gaps`` |
| ``idle_gap_bins`` | rank, host-side cause and gap-length bin | ``series[].idle_gaps`` |
| ``collectives`` | rank and collective kind | ``ranks[].comm_by_kind``, ``cross_rank.comm_by_kind`` |
| ``phases`` | rank and NVTX phase | ``ranks[].phases`` |
| ``host_attribution`` | rank, host source and what | ``ranks[].host_attribution`` |
| ``communicators`` | communicator | ``communication.groups`` |
| ``late_arrivals`` | late rank and cause | ``cross_rank.late_arrivals`` |
"""

from __future__ import annotations

import math
from typing import Protocol

import polars as pl

from traceclf.measures.handoff import IDLE_CAUSES


class Sections(Protocol):
    """What the tables are built from: a :class:`traceclf.report.contract.Report` (named by
    its parts, so that the report, whose ``tables()`` calls this module, is not imported)."""

    ranks: list[dict]
    series: list[dict]
    cross_rank: dict
    communication: dict


TABLES = (
    "steps",
    "ranks",
    "kernels",
    "idle_gaps",
    "idle_gap_bins",
    "collectives",
    "phases",
    "host_attribution",
    "communicators",
    "late_arrivals",
)
STEP_PARTS = ("compute", "exposed_comm", "copy", "idle")


def report_tables(report: Sections) -> dict[str, pl.DataFrame]:
    """Every table of ``report`` by name (TABLES)."""
    return {name: BUILDERS[name](report) for name in TABLES}


def stacked_tables(runs: list[tuple[str, Sections]]) -> dict[str, pl.DataFrame]:
    """Every table of several ``(name, report)`` runs: the runs' tables stacked in the given
    order, with a leading ``run`` column holding each run's name (its file names)."""
    out = {}
    for name in TABLES:
        frames = [
            BUILDERS[name](r).select(pl.lit(run, pl.String).alias("run"), pl.all())
            for run, r in runs
        ]
        out[name] = pl.concat(frames, how="diagonal_relaxed")
    return out


def steps_table(report: Sections) -> pl.DataFrame:
    """Per rank and steady step: its start (ns on the export's clock), its time and how it
    splits into compute, exposed communication, copies and idle (ms), all communication (ms)."""
    rows = [
        {
            "rank": s["rank"],
            "step": row["index"],
            "start_ns": row["step_start"],
            "step_ms": sum(row[k] for k in STEP_PARTS) / 1e6,
            **{f"{k}_ms": row[k] / 1e6 for k in STEP_PARTS},
            "comm_ms": row["comm_total"] / 1e6,
        }
        for s in report.series
        for row in s.get("step_breakdown") or []
    ]
    schema = {"rank": pl.Int64, "step": pl.Int64, "start_ns": pl.Int64, "step_ms": pl.Float64}
    schema |= {f"{k}_ms": pl.Float64 for k in (*STEP_PARTS, "comm")}
    return pl.DataFrame(rows, schema=schema)


def ranks_table(report: Sections) -> pl.DataFrame:
    """Per rank: who it is (pid, process, file, GPU), its steps, and every measure (fractions of
    the step as fractions, not percent)."""
    rows = [
        {
            "rank": r["rank"],
            "pid": r["pid"],
            "process": r.get("process"),
            "file": r.get("file"),
            "gpu": r.get("gpu"),
            "steps_used": (r.get("steps") or {}).get("used"),
            "step_median_ms": (r.get("steps") or {}).get("median_ms"),
        }
        | {k: _scalar(v) for k, v in (r.get("metrics") or {}).items()}
        for r in report.ranks
    ]
    df = pl.DataFrame(rows, infer_schema_length=None)
    # a measure unknown on every rank is still a number column (CSV and Parquet readers agree)
    return df.with_columns(pl.col(c).cast(pl.Float64) for c, t in df.schema.items() if t == pl.Null)


KERNEL_COLUMNS = {
    "rank": pl.Int64,
    "name": pl.String,
    "short_name": pl.String,
    "family": pl.String,
    "time_pct": pl.Float64,
    "total_ns": pl.Int64,
    "instances": pl.Int64,
    "avg_ns": pl.Float64,
    "med_ns": pl.Float64,
    "min_ns": pl.Int64,
    "max_ns": pl.Int64,
    "stddev_ns": pl.Float64,
}


def kernels_table(report: Sections) -> pl.DataFrame:
    """Per rank and kernel name over the steady-state window, as NVIDIA's ``cuda_gpu_kern_sum``:
    share of kernel time (%), total, instances, mean, median, min, max, standard deviation (ns)."""
    rows = [
        {"rank": s["rank"], "time_pct": 100 * k["time_frac"]}
        | {c: k.get(c) for c in KERNEL_COLUMNS if c not in ("rank", "time_pct")}
        for s in report.series
        for k in s.get("kernel_summary") or []
    ]
    return pl.DataFrame(rows, schema=KERNEL_COLUMNS)


def idle_gaps_table(report: Sections) -> pl.DataFrame:
    """One row per idle gap, as ``nsys analyze``'s gpu_gaps lists them: the longest of each
    rank's window (``series[].longest_gaps``), longest first: its start (ns on the export's
    clock, and in the seconds the nsys timeline shows: ``open_in_nsys_s``), length, cause and
    the NVTX range open over it."""
    rows = [
        {
            "rank": s["rank"],
            "start_ns": g["start_ns"],
            "duration_ns": g["duration_ns"],
            "cause": g["cause"],
            "nvtx": g["nvtx"],
            "open_in_nsys_s": g["start_ns"] / 1e9,
        }
        for s in report.series
        for g in s.get("longest_gaps") or []
    ]
    schema = {
        "rank": pl.Int64,
        "start_ns": pl.Int64,
        "duration_ns": pl.Int64,
        "cause": pl.String,
        "nvtx": pl.String,
        "open_in_nsys_s": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema)


def idle_gap_bins_table(report: Sections) -> pl.DataFrame:
    """Per rank, cause and gap-length bin [lo, hi) ns: how many idle gaps and their time, in
    total over the window and per steady step."""
    rows = []
    for s in report.series:
        hist = s.get("idle_gaps") or {}
        edges = hist.get("edges_ns") or []
        steps = max(len(s.get("step_breakdown") or []), 1)
        for cause in IDLE_CAUSES:
            for i, (count, ns) in enumerate(
                zip(hist.get(cause) or [], hist.get(f"{cause}_ns") or [], strict=True)
            ):
                if not count:
                    continue
                rows.append(
                    {
                        "rank": s["rank"],
                        "cause": cause,
                        "gap_min_ns": edges[i - 1] if i > 0 else 0.0,
                        "gap_max_ns": edges[i] if i < len(edges) else None,
                        "gaps": count,
                        "total_ms": ns / 1e6,
                        "ms_per_step": ns / 1e6 / steps,
                    }
                )
    schema = {
        "rank": pl.Int64,
        "cause": pl.String,
        "gap_min_ns": pl.Float64,
        "gap_max_ns": pl.Float64,
        "gaps": pl.Int64,
        "total_ms": pl.Float64,
        "ms_per_step": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema)


def collectives_table(report: Sections) -> pl.DataFrame:
    """Per rank and collective kind: share of the step in that kind's kernels and the exposed
    share, kernels, libraries; and, matched across ranks (the same for every rank), instances,
    ms in them, ms waiting for the last rank and ms transferring."""
    matched = (report.cross_rank or {}).get("comm_by_kind") or {}
    rows = [
        {
            "rank": r["rank"],
            "kind": kind,
            "frac": v.get("frac"),
            "exposed_frac": v.get("exposed_frac"),
            "kernels": v.get("kernels"),
            "libraries": ";".join(v.get("libraries") or []),
        }
        | {
            k: (matched.get(kind) or {}).get(k)
            for k in ("instances", "comm_ms", "wait_ms", "transfer_ms")
        }
        for r in report.ranks
        for kind, v in (r.get("comm_by_kind") or {}).items()
    ]
    schema = {
        "rank": pl.Int64,
        "kind": pl.String,
        "frac": pl.Float64,
        "exposed_frac": pl.Float64,
        "kernels": pl.Int64,
        "libraries": pl.String,
        "instances": pl.Int64,
        "comm_ms": pl.Float64,
        "wait_ms": pl.Float64,
        "transfer_ms": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema)


def phases_table(report: Sections) -> pl.DataFrame:
    """Per rank and NVTX phase (ms per steady step): time, busy (compute, exposed
    communication, copies), idle and idle by cause, and the steady steps it ran in."""
    rows = [
        {"rank": r["rank"]}
        | {k: v for k, v in p.items() if k != "idle_by_cause_ms"}
        | {f"idle_{c}_ms": (p.get("idle_by_cause_ms") or {}).get(c) for c in IDLE_CAUSES}
        for r in report.ranks
        for p in r.get("phases") or []
    ]
    schema = {"rank": pl.Int64, "phase": pl.String, "ms_per_step": pl.Float64}
    schema |= {k: pl.Float64 for k in ("busy_ms", "compute_ms", "exposed_comm_ms", "copy_ms")}
    schema |= {"idle_ms": pl.Float64, "steps": pl.Int64}
    schema |= {f"idle_{c}_ms": pl.Float64 for c in IDLE_CAUSES}
    return pl.DataFrame(rows, schema=schema)


HOST_DETAIL = {
    "calls": pl.Int64,
    "samples": pl.Int64,
    "data_loading_samples": pl.Int64,
    "call_class": pl.String,
    "top_frame": pl.String,
}


def host_attribution_table(report: Sections) -> pl.DataFrame:
    """Per rank, host source and what the launching thread was in: the GPU-idle time it
    accounts for (ms per step, share of idle) and its numbers (calls, samples, ...)."""
    rows = [
        {"rank": r["rank"], "source": h["source"], "what": h["what"]}
        | {"ms_per_step": h["ms_per_step"], "frac_of_idle": h["frac_of_idle"]}
        | {k: (h.get("detail") or {}).get(k) for k in HOST_DETAIL}
        for r in report.ranks
        for h in r.get("host_attribution") or []
    ]
    schema = {"rank": pl.Int64, "source": pl.String, "what": pl.String}
    schema |= {"ms_per_step": pl.Float64, "frac_of_idle": pl.Float64} | HOST_DETAIL
    return pl.DataFrame(rows, schema=schema)


COMMUNICATOR_SCHEMA = {
    "id": pl.String,
    "dimension": pl.String,
    "kinds": pl.String,
    "stream_ids": pl.String,
    "ranks": pl.String,
    "nranks": pl.Int64,
    "calls_per_step": pl.Float64,
    "exposed_ms_per_step": pl.Float64,
    "exposed_frac": pl.Float64,
    "blocking_ms_per_step": pl.Float64,
    "bytes_per_step": pl.Float64,
    "algbw_gbs": pl.Float64,
    "busbw_gbs": pl.Float64,
    "link": pl.String,
    "link_peak_gbs": pl.Float64,
    "link_bound": pl.Boolean,
    "spans_hosts": pl.Boolean,
    "dimension_evidence": pl.String,
}


def communicators_table(report: Sections) -> pl.DataFrame:
    """Per communicator (``communication.groups``): its dimension, kinds, nsys stream ids and
    ranks (``;``-joined), calls, exposed and blocking ms per step (mean over its ranks), bytes per
    step, algorithm and bus bandwidth (GB/s) against the link's peak, and the evidence for its
    dimension (``;``-joined sentences)."""
    rows = [
        {
            k: (
                ";".join(map(str, g.get(k) or []))
                if k in ("kinds", "stream_ids", "ranks")
                else "; ".join(g.get(k) or [])
                if k == "dimension_evidence"
                else g.get(k)
            )
            for k in COMMUNICATOR_SCHEMA
        }
        for g in (report.communication or {}).get("groups") or []
    ]
    return pl.DataFrame(rows, schema=COMMUNICATOR_SCHEMA)


def late_arrivals_table(report: Sections) -> pl.DataFrame:
    """Per rank that arrives late at matched collectives and per cause: how late per step, the
    cause, its ms per step and what it is (``cross_rank.late_arrivals``)."""
    rows = [
        {
            "rank": late["rank"],
            "late_ms_per_step": late["late_ms_per_step"],
            "cause": c["cause"],
            "ms_per_step": c["ms_per_step"],
            "detail": c.get("detail"),
        }
        for late in (report.cross_rank or {}).get("late_arrivals") or []
        for c in late.get("causes") or []
    ]
    schema = {
        "rank": pl.Int64,
        "late_ms_per_step": pl.Float64,
        "cause": pl.String,
        "ms_per_step": pl.Float64,
        "detail": pl.String,
    }
    return pl.DataFrame(rows, schema=schema)


BUILDERS = {
    "steps": steps_table,
    "ranks": ranks_table,
    "kernels": kernels_table,
    "idle_gaps": idle_gaps_table,
    "idle_gap_bins": idle_gap_bins_table,
    "collectives": collectives_table,
    "phases": phases_table,
    "host_attribution": host_attribution_table,
    "communicators": communicators_table,
    "late_arrivals": late_arrivals_table,
}


def _scalar(v):
    """A measure as a table cell: non-finite floats as nulls (CSV has no NaN)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v
