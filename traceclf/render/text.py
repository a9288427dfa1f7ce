"""Report text shared by every renderer (provenance, the steady-state line, step anchors), so
a report reads the same in each format; numbers are formatted by :mod:`traceclf.support.units`."""

from __future__ import annotations

import re
from pathlib import Path

from traceclf.report.contract import Report
from traceclf.support.units import counted, fmt_ms, pct


def next_wall_text(report: Report) -> str | None:
    """The wall the run hits once its bound is fixed; the bound itself where its fixes with a
    measured ceiling leave it the largest wall (``next_wall`` is then the bound)."""
    wall = report.next_wall
    if wall and wall == report.bound:
        return f"{wall} still: its fixes with a measured ceiling leave it the largest wall"
    return wall


def nsys_text(entry: dict) -> str:
    """An input's nsys and export schema versions, as far as the export says them (exports of
    old nsys versions, or written by a wrapper, may have no metadata table)."""
    nsys, schema = entry.get("nsys_version"), entry.get("schema_version")
    if not nsys and not schema:
        return "nsys version unknown (no export metadata)"
    return f"nsys {nsys or 'version unknown'} (schema {schema or 'unknown'})"


def provenance(report: Report) -> str:
    """Where the numbers come from: files, nsys versions, GPU, ranks."""
    versions = sorted({nsys_text(i) for i in report.inputs})
    gpus = sorted({g.get("name") or "unknown GPU" for g in report.gpus}) or ["unknown GPU"]
    ranks = len(report.ranks)
    return (
        f"{', '.join(versions)} · {', '.join(gpus)} · "
        f"{counted(ranks, 'rank')} in {counted(len(report.inputs), 'file')}"
    )


def unit(report: Report) -> str:
    """What the report's per-step figures are taken over: "step", or "window" where no
    repeating step was found (the whole GPU span is then analysed as one window: a "step"
    there would be a claim the trace does not support)."""
    s = report.steps
    return "window" if s.get("source") in (None, "none") or not s.get("count") else "step"


def steps_counted(report: Report) -> str | None:
    """'8 steps': the analysed steps that counts beside a per-step column are over (None: the
    report's unit is a window, and counts are over it)."""
    used = (report.steps or {}).get("used")
    if not used or unit(report) == "window":
        return None
    return counted(used, "step")


def span_title(report: Report) -> str:
    """'the steady-state step', or 'the window' where no repeating step was found."""
    return "the window" if unit(report) == "window" else "the steady-state step"


def anchor_label(source: str | None, label: str | None, width: int = 60) -> str:
    """' "label"' for a step anchor: a recurring kernel's demangled name is shortened to its
    function name (no return type, template arguments or parameters)."""
    if not label:
        return ""
    if source == "pattern":
        label = kernel_function(label)
    if len(label) > width:
        label = label[: width - 1] + "…"
    return f' "{label}"'


def kernel_function(name: str) -> str:
    """A demangled kernel name's function: no return type, template arguments, parameters or
    namespaces ('void at::native::<unnamed>::fill_kernel<float>(int, T2)' -> 'fill_kernel')."""
    text = name
    for _ in range(20):  # innermost template argument lists first
        stripped = re.sub(r"<[^<>]*>", "", text)
        if stripped == text:
            break
        text = stripped
    text = re.split(r"\(", re.sub(r"^void\s+", "", text), maxsplit=1)[0]
    parts = [p for p in text.split("::") if p.strip()]
    return parts[-1].strip() if parts else name


def steps_line(report: Report) -> str:
    s = report.steps
    if s.get("source") in (None, "none") or not s.get("count"):
        return "Steady state: no steps found; the whole GPU span is analysed as one window."
    label = anchor_label(s.get("source"), s.get("label"))
    cv = f", spread {pct(s['cv'])}" if s.get("cv") is not None else ""
    lo, hi = s.get("window_ns", [0, 0])
    period = s.get("source") == "pattern"
    line = (
        f"Steady state: {s['used']} of {s['count']} "
        f"{'periods of a recurring kernel' if period else 'steps'} (from {s['source']}{label})"
        f"{sampled(s)}, {'period' if period else 'step'} {fmt_ms(s.get('median_ms'))} "
        f"median{cv}, window {fmt_ms((hi - lo) / 1e6)}"
    )
    return line + (period_note(report) if period else "")


def period_note(report: Report) -> str:
    """What a recurring kernel's period is not: nothing marks a step, so "step" in the report
    means the period; a window with no training loop holds no training step at all."""
    loop = (report.capture or {}).get("training_loop")
    note = (
        ". No NVTX step range or CUDA graph marks a step: the period may be one step, several, "
        'or one layer of one (the report\'s "step" is this period)'
    )
    if loop in ("forward_only", "unknown", "not_a_loop"):
        note += "; this window holds no training step (no backward pass, no optimizer)"
    return note


def sampled(steps: dict) -> str:
    """ ", 48 analysed (...)" when step sampling measured a sample of the steady steps."""
    analysed, used = steps.get("analysed"), steps.get("used") or 0
    if analysed is None or analysed >= used:
        return ""
    return f", {analysed} analysed (runs spread over the steady state; --all-steps for all)"


def input_names(report: Report) -> str:
    return ", ".join(Path(i["path"]).name for i in report.inputs)


def window_text(report: Report) -> str:
    """'0.624 s – 0.819 s of the capture (195 ms)': the steady-state window (rank 0's)."""
    lo, hi = (report.steps.get("window_ns") or [0, 0])[:2]
    if hi <= lo:
        return "–"
    return f"{lo / 1e9:.3f} s – {hi / 1e9:.3f} s of the capture ({fmt_ms((hi - lo) / 1e6)})"
