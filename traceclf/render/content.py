"""What every report format shows, as plain strings: the rows of the per-rank, details,
top-kernel and provenance tables. The terminal, Markdown and HTML renderers only lay them out,
so a number reads the same in each."""

from __future__ import annotations

from pathlib import Path

from traceclf.render.ceilings import ceiling_rows, combined_row
from traceclf.render.text import (
    anchor_label,
    nsys_text,
    sampled,
    span_title,
    steps_counted,
    unit,
    window_text,
)
from traceclf.report.contract import Report
from traceclf.support.escape import visible
from traceclf.support.units import counted, fmt_bytes, fmt_ms, fmt_us, pct, sig

RANK_COLUMNS = (
    "rank",
    "pid",
    "step",
    "busy",
    "compute",
    "exposed comm",
    "copies",
    "idle: launching",
    "sync",
    "input",
    "host",
    "graph",
    "other",
)
TOP_KERNELS = 8
# Families shown by what their kernels do where the JSON name says more: permute_moe holds
# MoE routing and any sort, gather, scatter or histogram (a radix sort in a CUDA sample too).
FAMILY_LABELS = {"permute_moe": "permute/sort/gather"}


# Each figure's caption under it (HTML) or beside its link (Markdown).
CAPTIONS = {
    "step_timeline": "Each steady-state step split into compute (including communication "
    "that runs under it), exposed communication, copies and idle time, per rank.",
    "comm_overlap": "How much of the communication runs under compute (hidden) and how much "
    "the step waits for (exposed), per rank, in ms per step.",
    "idle_gaps": "GPU idle time per step by gap length and by what the host was doing: "
    "issuing launches, returning from a synchronisation, loading input, or busy elsewhere "
    "without CUDA calls (compiling, checkpointing: NVTX says which), else unattributed.",
    "gpu_metrics": "GPU metrics sampled by Nsight Systems over the steady state.",
    "step_lanes": "One steady-state step per rank (the one nearest the median step time) as "
    "the GPU ran it: compute, communication and copies, and the GPU span of each NVTX phase.",
    "memory": "Device memory allocated over the capture (CUDA memory events), against the "
    "GPU's capacity; the steady-state window is shaded.",
}
# The captions of the figures drawn where no step was found (the whole GPU span one window).
WINDOW_CAPTIONS = {
    "idle_gaps": CAPTIONS["idle_gaps"].replace("per step", "in the window"),
    "gpu_metrics": "GPU metrics sampled by Nsight Systems over the window.",
    "memory": CAPTIONS["memory"].replace("steady-state window", "window"),
}


def caption(report: Report, name: str) -> str:
    """The caption of figure ``name``, in the report's terms (steps, or the window)."""
    window = WINDOW_CAPTIONS if unit(report) == "window" else {}
    return window.get(name) or CAPTIONS.get(name, "")


def no_fixes_line(report: Report) -> str:
    """What the fixes section says when it lists none."""
    if report.abstained:
        return "No fixes: traceclf abstains (the reason is above)."
    return (
        "No fix proposed: none of the findings above is both large enough to act on and "
        "backed by the evidence a fix needs."
    )


def rank_rows(report: Report) -> list[list[str]]:
    """One row per rank: step time and the share of wall time of each part (RANK_COLUMNS)."""
    keys = (
        "gpu_busy_frac",
        "compute_frac",
        "exposed_comm_frac",
        "copy_frac",
        "idle_launch_frac",
        "idle_sync_frac",
        "idle_input_frac",
        "idle_host_frac",
        "idle_graph_frac",
        "idle_other_frac",
    )
    return [
        [str(r["rank"]), str(r["pid"]), fmt_ms(r["metrics"].get("step_time_ms"))]
        + [pct(r["metrics"].get(k)) for k in keys]
        for r in report.ranks
    ]


def kernel_columns(report: Report) -> tuple[str, ...]:
    """The top-kernel table's columns: its count is over the analysed steps, not per step."""
    count = f"count in {steps}" if (steps := steps_counted(report)) else "count"
    return ("kernel", "family", count, "median", f"share of {unit(report)}")


def kernels_title(report: Report) -> str:
    span = "the window" if unit(report) == "window" else "steady state"
    return f"Top kernels (rank 0, {span})"


def ranks_title(report: Report) -> str:
    """'Where the steady-state step goes' (or 'the window', where no step was found)."""
    return f"Where {span_title(report)} goes"


def ranks_note(report: Report) -> str:
    if unit(report) == "window":
        return "Share of the window's wall time, per rank."
    return "Share of the steady-state wall time, per rank; step: the steady steps' mean."


def details_head(report: Report) -> str:
    return "measures over the window" if unit(report) == "window" else "steady-state measures"


def detail_rows(report: Report) -> list[tuple[str, str]]:
    """(wall, what the measures say) lines, as in the terminal's details table; per step, or
    over the window where no step was found."""
    m, u = report.metrics, unit(report)
    comm = ", ".join(
        f"{kind} {pct(v['frac'])} ({pct(v['exposed_frac'])} exposed)"
        for kind, v in report.comm_by_kind.items()
    )
    rows = [
        (
            "Communication",
            f"{pct(m.get('comm_frac'))} of the {u}, {pct(m.get('exposed_comm_frac'))} exposed"
            f" · {comm or 'none'}",
        )
    ]
    cross = report.cross_rank or {}
    if cross.get("straggler_rank") is not None:
        rows.append(
            (
                "Across ranks",
                f"step-time skew {pct(cross.get('step_time_skew_frac'))}, compute skew "
                f"{pct(cross.get('compute_skew_frac'))}, straggler rank {cross['straggler_rank']}",
            )
        )
    rows.append(("Host", _host_line(report)))
    rows.append(
        (
            "Launches",
            f"{_kernels_line(m, u)}, "
            f"{num(m.get('sync_calls_per_step'))} syncs/{u}, "
            f"{num(m.get('small_d2h_per_step'))} tiny D2H copies/{u}, "
            f"CUDA graphs {pct(m.get('graph_frac'))} of busy time",
        )
    )
    rows.append(
        (
            "Memory",
            f"H2D+D2H {fmt_bytes(m.get('h2d_d2h_bytes_per_step'))}/{u} "
            f"({pct(m.get('offload_copy_frac'))} of the {u}), "
            f"device→device {fmt_bytes(m.get('device_copy_bytes_per_step'))}/{u}, "
            f"memset {fmt_bytes(m.get('memset_bytes_per_step'))}/{u}, "
            f"{num(m.get('pageable_copies_per_step'))} pageable copies/{u}, "
            f"{num(m.get('alloc_calls_per_step'))} cudaMalloc/Free per {u}, "
            f"recompute {pct(m.get('recompute_frac'))}, "
            f"peak device memory {pct(m.get('peak_memory_frac'))} of capacity",
        )
    )
    rows.append(("Compute", _compute_line(m)))
    return rows


def _host_line(report: Report) -> str:
    """What the host did while the GPU idled, from NVTX (the longest ranges of any rank)."""
    rows = sorted(
        (row for r in report.ranks for row in r.get("idle_nvtx") or []), key=lambda x: -x["frac"]
    )
    if not rows:
        c, m = report.capture or {}, report.metrics
        if c.get("cuda_api_traced") is False:
            return "no CUDA API trace: what the host did while the GPU idled is unknown"
        long_gaps = (m.get("idle_input_frac") or 0) + (m.get("idle_host_frac") or 0)
        if not long_gaps:
            return "no long idle gaps (1 ms or more with almost no CUDA calls)"
        share = f"{pct(long_gaps)} of the {unit(report)}"
        if "nvtx" not in (c.get("host_sources") or ["nvtx"]):
            return f"the GPU's long idle gaps ({share}): no NVTX captured to name them"
        # (idle_nvtx leaves out step and phase ranges, which say nothing of the host's work)
        return (
            f"the GPU's long idle gaps ({share}) lie in no NVTX range other than a step's or "
            "its forward/backward/optimizer phase"
        )
    parts = [
        f"NVTX '{_short(row['name'], 50)}'"
        + (f" → '{_short(row['detail'], 50)}'" if row.get("detail") else "")
        + (f" ({row['activity']})" if row.get("activity") else "")
        + f" {pct(row['frac'])} of the {unit(report)}"
        for row in rows[:3]
    ]
    return "GPU idle while the host was in " + "; ".join(parts)


# What the host did while compute was launch-starved (the idle cause of the gap it fell in)
STARVED_PARTS = (
    ("sync", "in sync idle"),
    ("launch", "while the host launched (in its calls or between them)"),
    ("input", "waiting for input"),
    ("host", "host busy elsewhere"),
    ("graph", "inside graph replays"),
    ("other", "other idle"),
    ("busy", "copies or communication running"),
)


def _starved_parts(ms, m: dict) -> str:
    """' (2.2 ms in sync idle, ...)': launch-starved time by what the host did,
    in the idle table's vocabulary, the parts that are not zero."""
    parts = [
        f"{ms(f'launch_starved_{key}_frac')} {words}"
        for key, words in STARVED_PARTS
        if m.get(f"launch_starved_{key}_frac")
    ]
    return f" ({', '.join(parts)})" if parts else ""


def budget_rows(report: Report) -> list[tuple[str, str]]:
    """The per-step budget in NVIDIA's order (docs/measures.md, "Critical path"): what the step
    is made of, what kept compute away, blocking against exposed time, across ranks and what
    the fixes can recover together; ms per step, averaged over ranks."""
    m = report.metrics
    step = m.get("step_time_ms")
    used = report.steps.get("used") or 0

    def ms(key: str) -> str:
        v = m.get(key)
        return fmt_ms(v * step) if v is not None and step is not None else "–"

    rows = [
        (
            "Budget per step",
            f"iteration {fmt_ms(step)} mean (n = {used}) · device busy {ms('gpu_busy_frac')} · "
            f"non-transfer busy {ms('non_transfer_busy_frac')} · compute busy "
            f"{ms('compute_frac')} · compute-absent {ms('compute_absent_frac')}",
        ),
        (
            "Compute-absent",
            f"launch-starved {ms('launch_starved_frac')}{_starved_parts(ms, m)} · "
            f"blocking {ms('blocking_frac')} "
            f"(communication {ms('blocking_comm_frac')}, copies {ms('blocking_copy_frac')}, "
            f"compute {ms('blocking_compute_frac')}, host sync {ms('blocking_host_sync_frac')})"
            f" · dependency-stalled {ms('dependency_stalled_frac')}"
            + (
                f" · between the kernels of graph replays {ms('graph_internal_frac')}"
                if m.get("graph_internal_frac")
                else ""
            )
            + f" · unresolved {ms('attribution_residual_frac')}",
        ),
        (
            "Blocking vs exposed",
            f"communication {ms('blocking_comm_frac')} blocking of {ms('exposed_comm_frac')} "
            f"exposed · copies {ms('blocking_copy_frac')} of {ms('exposed_copy_frac')}",
        ),
    ]
    if m.get("graph_unresolved_frac"):
        rows.append(
            (
                "CUDA graphs",
                f"{pct(m['graph_unresolved_frac'])} of the step inside graph-level traced "
                "replays: the trace hides their kernels, so what runs inside them is unknown "
                "(counted as compute: an upper bound; --cuda-graph-trace=node shows them)",
            )
        )
    cross = report.cross_rank or {}
    if len(report.ranks) > 1:
        wait = cross.get("comm_wait_frac")
        waits = cross.get("wait_transfer_note") or (
            f"wait {pct(wait)}, transfer {pct(cross.get('comm_transfer_frac'))}"
        )
        steps = report.steps or {}
        sampled = (  # (sampled ranks' collectives are matched where their analysed steps meet)
            " (steps sampled: where every rank's analysed steps meet; --all-steps matches all)"
            if (steps.get("analysed") or 0) < (steps.get("used") or 0)
            else ""
        )
        rows.append(
            (
                "Across ranks",
                f"{cross.get('collectives_matched', 0)} collectives matched, "
                f"{cross.get('collectives_unmatched', 0)} unmatched{sampled} · wait vs transfer: {waits}"
                " · groups "
                f"{cross.get('rank_groups')}, representatives {cross.get('representatives')}"
                + (f" · {cross['verdict']}" if cross.get("verdict") else ""),
            )
        )
    together = combined_row(report)
    if together is not None:
        rows.append(together)
    return rows


def kernel_rows(report: Report) -> list[list[str]]:
    """Top kernels of rank 0 (:func:`kernel_columns`)."""
    rows = report.ranks[0].get("top_kernels", []) if report.ranks else []
    return [
        [
            _short(k["name"]),
            FAMILY_LABELS.get(str(k["family"]), str(k["family"])),
            str(k["count"]),
            _duration(k["median_ns"]),
            pct(k["frac"]),
        ]
        for k in rows[:TOP_KERNELS]
    ]


def provenance_rows(report: Report) -> list[tuple[str, str]]:
    """Where the numbers come from: files, nsys and schema versions, GPU, steps, window."""
    rows = [
        (
            "Files" if len(report.inputs) > 1 else "File",
            "; ".join(
                f"{Path(i['path']).name} ({nsys_text(i)}, {counted(i.get('ranks', 1), 'rank')})"
                for i in report.inputs
            ),
        ),
        ("GPU", "; ".join(_gpu(g) for g in report.gpus) or "unknown"),
        ("Steps", _steps_source(report)),
        ("Window" if unit(report) == "window" else "Steady-state window", window_text(report)),
        ("traceclf", report.traceclf_version or "?"),
    ]
    if grouping_line(report):
        rows.insert(1, ("Grouping", grouping_line(report)))
    return rows


def grouping_line(report: Report) -> str:
    """Why several files became one report (pipeline/grouping.py), or "" for one file and for
    one run of several (the run set says why they are separate once, above all of them)."""
    g = report.grouping if isinstance(report.grouping, dict) else {}
    if not g or g.get("decided_by") in (None, "one export") or g.get("mode") == "runs":
        return ""
    return str(g.get("reason", ""))


def _short(name: str | None, width: int = 60) -> str:
    """A name cut to ``width``; a missing one (deleted StringIds, NULL name ids) is named so.
    Control characters are written out first, so a cut never splits an escape sequence."""
    name = visible(name) if name is not None else "<unknown kernel>"
    return name if len(name) <= width else name[: width - 1] + "…"


def _duration(ns: float) -> str:
    return f"{ns / 1e3:.1f} µs" if ns < 1e6 else fmt_ms(ns / 1e6)


def num(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _kernels_line(m: dict, u: str) -> str:
    """Kernels per step and the median kernel against the median launch call; where
    graph-level tracing hides the replays' kernels, what is seen: the kernels outside them, the
    graph launches, the eager warm-up's median kernel (the mix's source), and no comparison of
    a kernel with a whole graph's launch call."""
    kernels = f"{num(m.get('kernels_per_step'))} kernels/{u}"
    median = fmt_us(m.get("median_kernel_us"))
    launch = fmt_us(m.get("median_launch_us"))
    if not m.get("kernel_stats_outside_window"):
        return f"{kernels}, median kernel {median} vs launch {launch}"
    return (
        f"{kernels} outside {num(m.get('graph_launches_per_step'))} graph launches/{u} (their "
        f"kernels unseen: graph-level tracing), median kernel {median} (the eager warm-up's), "
        f"median launch call {launch}"
    )


def _compute_line(m: dict) -> str:
    families = sorted(
        ((k.removesuffix("_time_frac"), v) for k, v in m.items() if k.endswith("_time_frac") and v),
        key=lambda kv: -kv[1],
    )
    mix = ", ".join(f"{FAMILY_LABELS.get(f, f)} {pct(v)}" for f, v in families[:5])
    small = m.get("small_grid_kernel_frac")
    line = (
        (f"{mix} of kernel time" if mix else "no kernel time in the window")
        # (a share of the kernels, not of their time: a line about kernel time around it)
        + (f" · {pct(small)} of kernels with fewer blocks than SMs" if small is not None else "")
        + f" · theoretical occupancy {pct(m.get('theoretical_occupancy_mean'))}"
    )
    if m.get("sm_active_mean") is not None:
        line += (
            f", SM active {pct(m['sm_active_mean'])}, "
            f"tensor active {pct(m.get('tensor_active_mean'))}"
        )
    return line


def _steps_source(report: Report) -> str:
    s = report.steps
    if s.get("source") in (None, "none") or not s.get("count"):
        return "none found: the whole GPU span is one window"
    label = anchor_label(s.get("source"), s.get("label"))  # a kernel's function, not its signature
    spread = f", spread (CV) {pct(s['cv'])}" if s.get("cv") is not None else ""
    noun = "periods of a recurring kernel" if s["source"] == "pattern" else "steps"
    return (
        f"from {s['source']}{label}: {s['used']} of {s['count']} {noun} used (warm-up, the last "
        f"one and outliers dropped){sampled(s)}; mean {fmt_ms(s.get('mean_ms'))}, median "
        f"{fmt_ms(s.get('median_ms'))}{spread}"
    )


def _gpu(g: dict) -> str:
    extra = [
        g.get("chip"),
        f"{g['sm_count']} SMs" if g.get("sm_count") else None,
        fmt_bytes(g["memory_bytes"]) if g.get("memory_bytes") else None,
    ]
    extra = [e for e in extra if e]
    return (g.get("name") or "unknown GPU") + (f" ({', '.join(extra)})" if extra else "")


def config_caption(fix: dict) -> str | None:
    """What a fix's config block is, when it is a framework's config rather than generic advice:
    the rule files write Megatron-Bridge recipes as ``cfg.…`` assignments, and a plain PyTorch
    user must see at a glance that those lines are not theirs (their hint is the PyTorch row)."""
    if fix.get("advice") != "framework":
        return None
    lines = [ln.strip() for ln in (fix.get("config") or "").splitlines()]
    code = [ln for ln in lines if ln and not ln.startswith("#")]
    if code and all(ln.startswith("cfg.") for ln in code):
        return "Megatron-Bridge config"
    return None


# What each list of a fix is, as its heading says it (every format).
PRECONDITIONS_NOTE = "check these first: the trace cannot show them"
CONTRADICTED_NOTE = "what the trace contradicts"


def beside_bound_line(fix: dict) -> str | None:
    """Why a fix of a wall that does not bound the run is listed at all."""
    if not fix.get("beside_bound"):
        return None
    return (
        f"Also worth doing: the {fix.get('wall')} wall is not the bound, but the evidence is "
        "noteworthy and this ceiling wins back a measurable share of the step."
    )


def fix_facts(fix: dict) -> list[tuple[str, str]]:
    """What a fix rests on and what it can win, as (label, text) rows: the same change in plain
    PyTorch, the measured facts that triggered it, its gain ceiling, and what the next capture
    shows once it works."""
    rows = []
    if fix.get("order"):
        rows.append(("Order", fix["order"]))
    if fix.get("pytorch"):
        rows.append(("In PyTorch", fix["pytorch"]))
    evidence = fix.get("evidence") or {}
    if evidence:
        rows.append(("Because", ", ".join(f"{k} {_fact(k, v)}" for k, v in evidence.items())))
    rows += ceiling_rows(fix)
    if fix.get("verify"):
        rows.append(("Verify", f"in the next capture: {fix['verify']}"))
    return rows


def _fact(name: str, value) -> str:
    """A measure's value as the "Because" row gives it: bytes in their unit ("2.82 GB", not
    "2.82e+09"), big numbers whole, never in scientific notation."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and "bytes" in name:
        return fmt_bytes(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else sig(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)
