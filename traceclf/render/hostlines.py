"""The host side of a report as plain strings, for every format: the capture block's rows about
it (host sources, the profiler's own work, nsys's diagnostics, the capture's warnings), the
host-attribution table (where the GPU's idle time went, by source, with each source's numbers)
and the capture options that would attribute the rest. Trace text is escaped by the renderers."""

from __future__ import annotations

from traceclf.render.text import steps_counted, unit
from traceclf.report.contract import Report
from traceclf.support.units import counted, fmt_ms, pct

SOURCE_NAMES = {
    "nvtx": "NVTX",
    "cuda_api": "CUDA API",
    "osrt": "OS runtime",
    "sampling": "CPU samples",
    "python_sampling": "Python samples",
    "sched": "scheduling",
    "profiler": "nsys overhead",
    "unattributed": "unattributed",
}
HOST_SOURCES = ("nvtx", "cuda_api", "osrt", "sampling", "python_sampling", "sched")
# The table is shown when the GPU idles at least this share of the step (the JSON always has
# it): below, where idle time went does not bear on the verdict (scoring.noteworthy).
SHOWN_FROM_IDLE = 0.05
TEXT_CHARS = 160  # a diagnostic's text in a table cell (the JSON keeps it whole)


def host_capture_rows(report: Report) -> list[tuple[str, str]]:
    """The capture block's rows about the host side."""
    c = report.capture or {}
    if "host_sources" not in c:  # (a report from before host sources were read)
        return []
    have = c.get("host_sources") or []
    missing = [SOURCE_NAMES[s] for s in HOST_SOURCES if s not in have]
    line = ", ".join(SOURCE_NAMES[s] for s in have) or "none"
    if missing:
        line += f" (no {_joined(missing, 'or')})"
    notes = c.get("host_notes") or {}
    if notes:
        line += "; " + "; ".join(f"{SOURCE_NAMES.get(k, k)}: {v}" for k, v in notes.items())
    rows = [("Host sources", line)]
    overhead = [(r["capture"] or {}).get("profiler_overhead_ms") for r in report.ranks]
    if c.get("profiler_overhead_frac") is not None:
        total = max((v for v in overhead if v is not None), default=0.0)
        rows.append(
            (
                "Profiler",
                f"nsys's own work {pct(c['profiler_overhead_frac'])} of the window "
                f"({fmt_ms(total)} over the whole capture)",
            )
        )
    messages = c.get("diagnostics") or []
    if messages:
        rows.append(
            (
                "Diagnostics",
                "; ".join(
                    f"{m.get('severity')} ({m.get('kind')}): {_cut(m.get('text') or '')}"
                    for m in messages
                ),
            )
        )
    rows += [("Warning", w) for w in c.get("warnings") or []]
    return rows


def attribution_shown(report: Report) -> bool:
    return bool(report.host_attribution) and (
        (report.metrics.get("gpu_idle_frac") or 0) >= SHOWN_FROM_IDLE
    )


def attribution_columns(report: Report) -> tuple[str, ...]:
    return ("source", "what", f"ms/{unit(report)}", "of idle", "evidence")


def attribution_title(report: Report) -> str:
    idle = report.metrics.get("gpu_idle_frac")
    step = report.metrics.get("step_time_ms")
    if step is None and unit(report) == "window":  # (no step: the window's own length)
        lo, hi = (report.steps.get("window_ns") or [0, 0])[:2]
        step = (hi - lo) / 1e6 if hi > lo else None
    ms = fmt_ms(idle * step) if idle is not None and step is not None else "–"
    return (
        f"Where the GPU's idle time went on the host ({ms} per {unit(report)} idle; each ns to one "
        "source: nsys overhead, NVTX, CUDA API, OS runtime, Python samples, scheduling, "
        "CPU samples)"
    )


def attribution_rows(report: Report) -> list[list[str]]:
    """One row per (source, what) of the job (:func:`attribution_columns`)."""
    return [
        [
            SOURCE_NAMES.get(r["source"], r["source"]),
            r["what"],
            fmt_ms(r["ms_per_step"]),
            pct(r["frac_of_idle"]),
            evidence(r, counted_over(report), len(report.ranks)),
        ]
        for r in report.host_attribution
    ]


def counted_over(report: Report) -> str:
    """What the rows' counts of calls and samples are over: the analysed steps, not one (the
    column beside them is per step)."""
    return f"in {steps}" if (steps := steps_counted(report)) else "in the window"


def evidence(row: dict, over: str = "in the window", ranks: int = 1) -> str:
    """What backs one row, in words (``over``: what its counts are over; ``ranks``: how many
    the report has, over which the row's ms per step are a mean)."""
    d, source = row.get("detail") or {}, row["source"]
    if row["what"] == "other" and "whats" in d:
        return f"{d['whats']} more, each smaller"
    parts = []
    if source == "nvtx":
        where = f"under its {d['activity']} ranges" if d.get("activity") else "in the range"
        parts.append(
            f"{counted(d.get('gaps', 0), 'long gap')} {where}"
            + (f" ({d['ranges']})" if d.get("ranges") else "")
        )
    elif "calls" in d:
        # (the calls that overlap the idle gaps: not every call of the class, 102 of 182
        # allocator calls read as all of them beside a fix counting 23 a step)
        what = f"{counted(d['calls'], 'call')} in idle gaps {over}"
        if d.get("call_class"):
            what += f" ({d['call_class']})"
        parts.append(what)
        if d.get("top_call"):
            parts.append(f"most of it in {d['top_call']}")
        if d.get("top_frame"):
            parts.append(f"top user frame {d['top_frame']}")
    elif "samples" in d:
        loading = d.get("data_loading_samples", 0)
        parts.append(f"{counted(d['samples'], 'sample')} {over}, {loading} in data loading")
        if d.get("innermost_frame") and d["innermost_frame"] != row["what"]:
            parts.append(f"innermost {d['innermost_frame']}")
        native = d.get("hottest_native") or []
        if native:
            parts.append(
                "underneath " + ", ".join(f"{n['frame']} ({n['samples']})" for n in native)
            )
    elif source == "unattributed":
        parts.append("no host source of the capture accounts for it")
    if d.get("ranks"):
        # (the row's time is the mean over every rank: one rank's 0.07 ms read 0.034 ms of 2)
        parts.append(
            f"on {d['ranks']} of {ranks} ranks (its time: the mean over all {ranks})"
            if d["ranks"] < ranks
            else f"on {counted(d['ranks'], 'rank')}"
        )
    return "; ".join(parts)


def option_rows(report: Report) -> list[tuple[str, str]]:
    """(capture option, what it would attribute) for the idle time that stays unattributed."""
    return [
        (o["option"], o["attributes"])
        for o in (report.capture or {}).get("host_capture_options") or []
    ]


def options_title(report: Report) -> str:
    share = report.metrics.get("idle_unattributed_frac")
    return (
        f"To attribute the rest ({pct(share)} of the {unit(report)} idle with no host source), "
        "capture with"
    )


def _joined(words: list[str], last: str) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"


def _cut(text: str) -> str:
    one = " ".join(text.split())
    return one if len(one) <= TEXT_CHARS else one[: TEXT_CHARS - 1] + "…"
