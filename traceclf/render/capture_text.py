"""The capture block as rows of text (every format shows them right after the verdict): what
the traces can support — inputs and GPUs, steps and how they were found, the loop, CUDA-graph
tracing, GPU metrics, NCCL payload, rows the loader could not use, strings it repaired, and the
host side (render/hostlines.py)."""

from __future__ import annotations

from traceclf.render.hostlines import host_capture_rows
from traceclf.render.text import anchor_label, sampled, window_text
from traceclf.report.contract import Report
from traceclf.support.units import counted, fmt_ms, pct

LOOPS = {
    "training": "a training loop",
    "forward_only": "forward passes only (no backward, no optimizer)",
    "not_a_loop": "not a repeating loop",
    "unknown": "a repeating loop, not a deep-learning framework's (framework fixes off)",
}


def _over_ranks(c: dict) -> str:
    """' summed over 2 ranks' when several ranks' GPU work is added (it can then exceed the
    captured span), else ''."""
    n = c.get("ranks") or 0
    return f" summed over {n} ranks" if n > 1 else ""


def _second_anchor(second: dict, other: str) -> str:
    """Whether the second anchor's step time agrees, and how often it recurs where that is a
    whole multiple of the step (its time alone, beside the step's, would read as a mismatch);
    one that recurs many times per step (or once in many steps) is near a whole multiple
    whatever the step: it checks nothing."""
    every = fmt_ms(second.get("median_ms"))
    ratio = second.get("ratio") or 0
    often = f"{1 / ratio:.0f} times per step" if 0 < ratio < 1 else f"once in {ratio:.0f} steps"
    if second.get("comparable") is False:
        return f"no second anchor: {other} recurs every {every} ({often}), no check of the step"
    if not second.get("agrees"):
        return f"a second anchor ({other}, {every}) DISAGREES: the step time is ambiguous"
    multiple = round(max(ratio, 1 / ratio)) if ratio > 0 else 1
    return f"a second anchor ({other}, {every}) " + (
        f"agrees: it recurs {often}" if multiple >= 2 else "agrees"
    )


def _rest_left_out(c: dict) -> str:
    """The found steps neither used nor warm-up, so that the counts add up: a step runs to the
    next one's start, so the last has none to end it; beyond it, outliers."""
    rest = c.get("steps_found", 0) - c.get("steps_used", 0) - c.get("warmup_dropped", 0)
    if rest <= 0:
        return ""
    if rest == 1:
        return ", the last left out (no next step ends it)"
    return f", {rest} more left out (the last, which no next step ends, and outliers)"


def capture_rows(report: Report) -> list[tuple[str, str]]:
    """What the trace can support, shown before any number that depends on it."""
    c = report.capture or {}
    if not c:
        return []
    s = report.steps
    anchor = c.get("step_anchor") or {}
    label = anchor_label(anchor.get("source"), anchor.get("label"))
    noun = " periods" if anchor.get("unit") == "period" else ""
    steps = (
        f"{c.get('steps_used', 0)} steady{noun} of {c.get('steps_found', 0)} found, from "
        f"{anchor.get('source', 'none')}{label}{sampled(s)}; "
        f"{c.get('warmup_dropped', 0)} warm-up dropped{_rest_left_out(c)}; "
        f"window {window_text(report)}, {pct(c.get('window_share_of_capture'))} of the GPU span"
        if c.get("steps_found")
        else "no repeating step found: the whole GPU span is one window"
    )
    if s.get("cv") is not None and c.get("steps_found"):
        steps += f"; step spread (CV) {pct(s['cv'])}"
    second = c.get("second_anchor")
    if second:
        other = f"{second['source']}{anchor_label(second['source'], second.get('label'))}"
        steps += "; " + _second_anchor(second, other)
    evidence = c.get("training_evidence") or {}
    loop = LOOPS.get(c.get("training_loop"), c.get("training_loop") or "unknown")
    loop += (
        f" — {evidence.get('backward_kernels', 0)} backward kernels, "
        f"{evidence.get('autograd_launches', 0)} launches from autograd threads, "
        f"{evidence.get('backward_ranges', 0)} backward NVTX ranges, "
        f"{evidence.get('optimizer_kernels', 0)} optimizer kernels{_per_step(report)}, "
        f"{evidence.get('optimizer_ranges', 0)} optimizer NVTX ranges"
    )
    gpus = {
        "shared": "ranks share one GPU (they time-slice it: no straggler is named)",
        "own": "one GPU per rank",
        "unknown": "ranks report the same device; whether it is one GPU is unknown",
    }.get(c.get("gpu_assignment"), "–")
    graphs = {"graph": "graph-level (kernels inside graphs hidden)", "node": "node-level"}.get(
        c.get("graph_trace_mode"), "no CUDA graphs"
    )
    if c.get("graph_trace_mode") == "graph":
        graphs += f"; kernel mix from {c.get('kernel_mix_source')}"
    unusable = c.get("unusable_rows") or {}
    rows = [
        ("Inputs", f"{counted(c.get('inputs', 0), 'file')}, {counted(c.get('ranks', 0), 'rank')}: {gpus}"),
        ("Work", f"{c.get('kernels', 0):,} kernels, {fmt_ms(c.get('gpu_work_ms'))} of GPU work"
         f" (kernels, copies, memsets){_over_ranks(c)} in a GPU span of "
         f"{fmt_ms(c.get('capture_ms'))} (first to last GPU work)"),
        ("Steps", steps),
        ("Loop", loop),
        ("CUDA graphs", graphs),
        ("GPU metrics", "present" if c.get("gpu_metrics") else "absent"),
        ("NCCL payload", {"values": "message sizes recorded",
                          "declared_empty": "declared but empty (no message sizes)",
                          "absent": "absent"}.get(c.get("nccl_payload"), "–")),
    ]  # fmt: skip
    skipped = c.get("skipped_inputs") or []
    if skipped:  # (inputs named but not analysed: a launcher's export beside the ranks')
        rows.insert(1, ("Left out", left_out_text(skipped)))
    outside = c.get("kernels_outside") or []
    if outside:  # (kernels the report does not cover: another phase of the program)
        names = ", ".join(
            f"{e['name']} {fmt_ms(e['ms'])} ({pct(e['share'])} of the capture's kernel time)"
            for e in outside
        )
        rows.append(("Not in window", f"{names}: run only outside the window, not analysed"))
    copies = c.get("copies_outside")
    if copies:  # (a benchmark's setup and read-back: GPU time the window does not show)
        rows.append(
            (
                "Not in window",
                f"host↔device copies {fmt_ms(copies['ms'])} ({pct(copies['share'])} of the "
                "capture's GPU work) run outside every step found, not analysed",
            )
        )
    if c.get("pid_from_calls"):
        pids = ", ".join(str(p) for p in c["pid_from_calls"])
        rows.append(
            (
                "Processes",
                f"GPU rows that name no process are taken as the work of pid {pids}, the one "
                "process whose CUDA calls the export holds",
            )
        )
    if any(unusable.values()):
        rows.append(("Unusable rows", ", ".join(f"{k} {v:,}" for k, v in unusable.items() if v)))
    repaired = {k: v for k, v in (c.get("repaired_strings") or {}).items() if v}
    if repaired:
        counts = ", ".join(f"{k} {v:,}" for k, v in repaired.items())
        rows.append(("Repaired strings", f"{counts} (not UTF-8: bad bytes shown as \ufffd)"))
    return rows + host_capture_rows(report)


def left_out_text(skipped: list[dict]) -> str:
    """The inputs left out, those of one problem together: 'a.sqlite, b.sqlite: export has
    no GPU activity (...)'."""
    by_problem: dict[str, list[str]] = {}
    for entry in skipped:
        by_problem.setdefault(entry["problem"], []).append(entry["path"])
    return "; ".join(f"{', '.join(paths)}: {problem}" for problem, paths in by_problem.items())


def _per_step(report: Report) -> str:
    """' (84 per steady step)': the optimizer kernels of the capture as the evidence counts
    them per step (the same kernels: ``optimizer_kernels_per_step``)."""
    per_step = report.metrics.get("optimizer_kernels_per_step")
    if not per_step:
        return ""
    if report.metrics.get("kernel_stats_outside_window"):
        # (graph-level tracing: counted in the eager iteration; "75 per steady step" read
        # beside 153 in the whole capture, whose replays' kernels are unseen)
        return f" ({per_step:.3g} per step in the eager warm-up; the graph replays' unseen)"
    return f" ({per_step:.3g} per steady step)"
