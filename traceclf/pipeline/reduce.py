"""The reduce step: the per-rank results of every export of one job → one :class:`Report`.

Numbers the ranks, averages their measures, says what the capture supports
(:mod:`traceclf.judge.abstention`), compares the ranks (:mod:`traceclf.judge.straggler` over the
numbers of :mod:`traceclf.measures.cross_rank`), and classifies — or abstains
(:mod:`traceclf.judge.engine`); every threshold from the rule set. Only small, picklable per-rank results
come in (:class:`~traceclf.measures.handoff.ExportResult`), so this never touches a trace.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

from traceclf.report.contract import REPORT_VERSION, Report
from traceclf.support.version import __version__

if TYPE_CHECKING:
    from traceclf.measures.handoff import ExportResult, RankResult

GPU_KEYS = ("name", "chip", "sm_count", "memory_bytes")


def build_report(
    results: list[ExportResult], rules_dir: Path | None = None, skipped: list[dict] | None = None
) -> Report:
    """Reduce step: number the ranks, average their measures, compare them, say what the
    capture supports, then classify — or abstain (docs/judgement.md). ``skipped``: the inputs
    left out of the analysis, each ``{path, problem}`` (``capture.skipped_inputs``)."""
    from traceclf.judge.abstention import abstain_reason, capture_block, rank_capture
    from traceclf.judge.ceiling import combined
    from traceclf.judge.comm_groups import communication_block, rule_facts
    from traceclf.judge.engine import abstained, capture_quality, evaluate
    from traceclf.judge.hostverdict import job_attribution
    from traceclf.judge.straggler import Limits, cross_rank_block
    from traceclf.judge.vocabulary import load_rules

    rs = load_rules(rules_dir)
    thresholds = rs.thresholds
    ranks = [r for export in results for r in export.ranks]
    rank_dicts = [
        {
            "rank": i,
            "pid": r.pid,
            "process": r.process_name,
            "file": r.path,
            "gpu": r.gpu.get("name") if r.gpu else None,
            # (a shallow copy of each field: asdict's deep copy of every step's duration and
            # steady flag took 0.3 s for a capture of 25,000 CUDA-graph replays)
            "steps": {f.name: copy.copy(getattr(r.steps, f.name)) for f in fields(r.steps)},
            "metrics": r.measures.metrics,
            "comm_by_kind": r.measures.comm_by_kind,
            "top_kernels": r.measures.top_kernels,
            "idle_nvtx": r.measures.idle_nvtx,
            "phases": r.measures.phases,
            "step_kernels": r.measures.step_kernels,
            "host_attribution": r.measures.host_attribution,
            "capture": rank_capture(r.measures.capture, thresholds),
        }
        for i, r in enumerate(ranks)
    ]
    metrics = mean_metrics([r.measures.metrics for r in ranks])
    gpus = _unique([{k: r.gpu.get(k) for k in GPU_KEYS} for r in ranks if r.gpu])
    capture = capture_block(ranks, results, thresholds, skipped or [])
    cross = cross_rank_block(
        [
            d
            | {
                "collectives": r.measures.collectives,
                "arrivals": r.measures.arrivals,
                "clock": asdict(r.clock) | {"gpu": r.placement.key},
                "window": r.steps.window_ns,
            }
            for d, r in zip(rank_dicts, ranks, strict=True)
        ],
        capture,
        Limits.of(rs),
    )
    transfers = cross.pop("transfers", {})
    communication = communication_block(
        ranks, [r.measures.metrics for r in ranks], capture, cross | {"transfers": transfers}, rs
    )
    comm_by_kind = _mean_comm(ranks)
    first = ranks[0].steps if ranks else None
    steps = {
        # rank 0's steps; "mixed" when ranks found their steps in different ways
        "source": _common([r.steps.source for r in ranks], first.source if first else "none"),
        "label": first.label if first else "",
        "count": first.count if first else 0,
        "used": first.used if first else 0,
        "analysed": first.analysed if first else 0,
        "mean_ms": _mean([r.steps.mean_ms for r in ranks]),
        "median_ms": _mean([r.steps.median_ms for r in ranks]),
        "cv": _mean([r.steps.cv for r in ranks]),
        "window_ns": first.window_ns if first else [0, 0],
        "worst": _worst_step(ranks),
        "anchors_agree": ((first.second_anchor if first else None) or {}).get("agrees", True),
    }
    facts = {
        "metrics": metrics,
        "ranks": rank_dicts,
        "gpu": gpus[0] if gpus else None,
        "rank_count": len(ranks),
        "hosts": [r.clock.host for r in ranks],
        "comm_by_kind": comm_by_kind,
        "cross_rank": cross,
        "capture": capture,
        "steps": steps,
        "idle_nvtx": _top_idle_nvtx(ranks),
        "host_attribution": job_attribution([r.measures.host_attribution for r in ranks]),
        "communication": rule_facts(communication, cross, metrics),
    }
    capture |= capture_quality(facts, rules_dir)
    reason = abstain_reason(capture, ranks, thresholds)
    verdict = abstained(reason) if reason else evaluate(facts, rules_dir)
    return Report(
        report_version=REPORT_VERSION,
        traceclf_version=__version__,
        inputs=[
            {
                "path": e.path,
                "nsys_version": e.nsys_version,
                "schema_version": e.schema_version,
                "ranks": len(e.ranks),
                "unusable_rows": e.unusable_rows,
            }
            | ({"part": e.part} if e.part else {})
            for e in results
        ],
        gpus=gpus,
        capture=capture,
        steps=steps,
        ranks=rank_dicts,
        metrics=metrics,
        cross_rank=cross,
        communication=communication,
        comm_by_kind=comm_by_kind,
        host_attribution=facts["host_attribution"],
        classification=verdict.classification,
        fixes=verdict.fixes,
        applied=verdict.applied,
        next_wall=verdict.next_wall,
        combined_ceiling=combined(verdict.fixes, metrics.get("step_time_ms")),
        series=[
            {
                "rank": i,
                "step_breakdown": r.measures.step_breakdown,
                "idle_gaps": r.measures.idle_gaps,
                "longest_gaps": r.measures.longest_gaps,
                "gpu_metrics": r.measures.gpu_metrics_series,
                "step_budget": r.measures.step_budget,
                "step_lanes": r.measures.step_lanes,
                "memory": r.measures.memory_series,
                "kernel_summary": r.measures.kernel_summary,
            }
            for i, r in enumerate(ranks)
        ],
    )


def _worst_step(ranks: list[RankResult]) -> dict | None:
    """The slowest steady step of any rank, with where it lies on that rank's export clock."""
    rows = [(r.steps.worst, i) for i, r in enumerate(ranks) if (r.steps.worst or {}).get("ms")]
    if not rows:
        return None
    worst, rank = max(rows, key=lambda x: x[0]["ms"])
    return worst | {"rank": rank, "file": ranks[rank].path}


def _top_idle_nvtx(ranks: list[RankResult]) -> dict | None:
    """The NVTX range that covers the most idle time on any rank (with its rank)."""
    rows = [(row, i) for i, r in enumerate(ranks) for row in r.measures.idle_nvtx[:1]]
    if not rows:
        return None
    row, rank = max(rows, key=lambda x: x[0]["frac"])
    return row | {"rank": rank}


def mean_metrics(per_rank: list[dict]) -> dict:
    """Mean over ranks of each measure; booleans are true if true on any rank."""
    keys = list(dict.fromkeys(k for m in per_rank for k in m))
    out = {}
    for k in keys:
        values = [m.get(k) for m in per_rank if m.get(k) is not None]
        if values and all(isinstance(v, bool) for v in values):
            out[k] = any(values)
        else:
            out[k] = _mean(values)
    return out


def _mean_comm(ranks: list[RankResult]) -> dict:
    kinds = list(dict.fromkeys(k for r in ranks for k in r.measures.comm_by_kind))
    out = {}
    for kind in kinds:
        rows = [r.measures.comm_by_kind.get(kind) for r in ranks]
        present = [row for row in rows if row]
        out[kind] = {
            "frac": round(sum(row["frac"] for row in present) / len(ranks), 4),
            "exposed_frac": round(sum(row["exposed_frac"] for row in present) / len(ranks), 4),
            "kernels": sum(row["kernels"] for row in present),
            "libraries": sorted({lib for row in present for lib in row["libraries"]}),
        }
    return out


def _common(values: list[str], default: str) -> str:
    distinct = set(values)
    return default if len(distinct) <= 1 else "mixed"


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.fmean(vals), 6) if vals else None


def _unique(rows: list[dict]) -> list[dict]:
    seen, out = set(), []
    for row in rows:
        key = tuple(sorted(row.items()))
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out
