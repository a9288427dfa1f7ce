"""The host side in the verdict: the job's ``host_attribution`` from its ranks', the row that
rules name (``idle_top_*``), the capture's own distortions (profiler overhead, lost data: a
warning and a lower reliability) and the capture options that would attribute what no host
source does (docs/judgement.md; the settings are the ``capture:`` section of
rules/hostside.yaml).
"""

from __future__ import annotations

from typing import Any

from traceclf.rulebook.layers import RuleSet
from traceclf.support.units import counted

# Sources that say what the launching thread itself was doing (named by the idle_top_* rule
# names); nsys's overhead, NVTX and CUDA calls have rules of their own.
THREAD_SOURCES = ("osrt", "python_sampling", "sched", "sampling")
SOURCE_LABELS = {
    "profiler": "nsys overhead",
    "nvtx": "NVTX",
    "cuda_api": "CUDA API",
    "osrt": "OS runtime",
    "python_sampling": "Python samples",
    "sched": "scheduling",
    "sampling": "CPU samples",
    "unattributed": "unattributed",
}
# what one sample of a sampling source is called (its label is the plural)
SAMPLE_NOUNS = {"python_sampling": "Python sample", "sampling": "CPU sample"}
DATA_LOSS = ("dropped", "truncated", "cupti_error")  # diagnostics kinds: events missing


def job_attribution(per_rank: list[list[dict]]) -> list[dict]:
    """The ranks' rows merged by (source, what): ms per step averaged over the ranks (a rank
    without the row counts 0) and its share of the ranks' idle time together (the ratio of the
    sums, so that ms and share agree: a mean of each rank's share did not), the detail of the
    rank where it is largest, and in how many ranks it appears. Each rank's rows share out
    all its idle time, so their ms add up to it."""
    n = max(len(per_rank), 1)
    idle = sum(row["ms_per_step"] for rows in per_rank for row in rows)
    merged: dict[tuple[str, str], dict] = {}
    for rows in per_rank:
        for row in rows:
            key = (row["source"], row["what"])
            entry = merged.setdefault(
                key, {"source": key[0], "what": key[1], "ms": 0.0, "frac": 0.0, "best": None}
            )
            entry["ms"] += row["ms_per_step"]
            entry["frac"] += row["frac_of_idle"]
            entry["ranks"] = entry.get("ranks", 0) + 1
            if entry["best"] is None or row["ms_per_step"] > entry["best"]["ms_per_step"]:
                entry["best"] = row
    out = [
        {
            "source": e["source"],
            "what": e["what"],
            "ms_per_step": round(e["ms"] / n, 4),
            # (one rank: its own share, from ns, not from ms rounded to 0.1 µs)
            "frac_of_idle": round(e["ms"] / idle if idle and n > 1 else e["frac"] / n, 4),
            "detail": e["best"]["detail"] | ({"ranks": e["ranks"]} if n > 1 else {}),
        }
        for e in merged.values()
    ]
    order = list(SOURCE_LABELS)
    return sorted(
        out,
        key=lambda r: (
            order.index(r["source"]),
            r["what"] == "other",
            -r["ms_per_step"],
            r["what"],
        ),
    )


def evidence_words(row: dict) -> str:
    """A row's source and numbers in words: "OS runtime, 18 calls", "323 Python samples, 323
    in data-loading code", "scheduling"."""
    detail, source = row.get("detail") or {}, row["source"]
    label = SOURCE_LABELS.get(source, source)
    if detail.get("calls") is not None:
        n = detail["calls"]
        return f"{label}, {counted(n, 'call')}"
    if detail.get("samples") is not None:
        n, loading = detail["samples"], detail.get("data_loading_samples") or 0
        words = counted(n, SAMPLE_NOUNS.get(source, "sample"))
        return words + (f", {loading:,} in data-loading code" if loading else "")
    return label


def top_context(rows: list[dict], step_ms: float | None) -> dict[str, Any]:
    """The ``idle_top_*`` context names from the job's largest thread-source row, of those that
    name one thing: the "other" row of a source sums what its listed rows leave (a public
    clustering code's CPU samples in dozens of frames) and names nothing the thread was in."""
    mine = [r for r in rows if r["source"] in THREAD_SOURCES and r["what"] != "other"]
    best = max(mine, key=lambda r: r["ms_per_step"], default=None)
    if best is None:
        return {"idle_top_what_frac": 0.0, "idle_top_what_ms": 0.0}
    return {
        "idle_top_source": best["source"],
        "idle_top_source_label": SOURCE_LABELS[best["source"]],
        "idle_top_what": best["what"],
        "idle_top_what_ms": best["ms_per_step"],
        "idle_top_what_frac": best["ms_per_step"] / step_ms if step_ms else 0.0,
        "idle_top_what_evidence": evidence_words(best),
    }


def capture_context(capture: dict) -> dict[str, Any]:
    """The capture's context names (host sources, Python, the profiler's share, lost data)."""
    kinds = sorted({d.get("kind") for d in capture.get("diagnostics") or []} & set(DATA_LOSS))
    return {
        "host_sources": list(capture.get("host_sources") or []),
        "python_process": bool(capture.get("python_process")),
        "capture_profiler_overhead_frac": capture.get("profiler_overhead_frac") or 0.0,
        "capture_launch_call_missing_frac": capture.get("launch_call_missing_frac") or 0.0,
        "capture_dropped_data": bool(kinds),
        "capture_dropped_kinds": ", ".join(kinds),
    }


def distortions(rs: RuleSet, env: dict[str, Any]) -> list[str]:
    """The warnings of the capture's distortions that hold."""
    return [d.warning.render(env) for d in rs.capture.distortions if d.when.value(env)]


def distorts(rs: RuleSet, env: dict[str, Any], bound: str | None) -> bool:
    """Whether a distortion that holds can have made the run look bound by ``bound``."""
    return any(
        d.when.value(env) and (not d.walls or bound in d.walls) for d in rs.capture.distortions
    )


def capture_options(rs: RuleSet, env: dict[str, Any]) -> list[dict]:
    """The capture options to suggest: when idle time stays unattributed, one per host source
    the capture lacks (and whose own condition holds)."""
    when = rs.capture.options_when
    if when is None or not when.value(env):
        return []
    have = set(env.get("host_sources") or ())
    merged: dict[str, dict] = {}  # (one entry per command: -t cuda,nvtx,osrt adds two sources)
    for o in rs.capture.options:
        if o.source in have or (o.when is not None and not o.when.value(env)):
            continue
        if o.option in merged:
            merged[o.option]["sources"].append(o.source)
            merged[o.option]["attributes"] += f"; {o.attributes}"
        else:
            merged[o.option] = {
                "source": o.source,
                "sources": [o.source],
                "option": o.option,
                "attributes": o.attributes,
            }
    return list(merged.values())
