"""The terminal report (rich): verdict first, then where the step goes, then the fixes."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from traceclf.render.text import fmt_bytes, fmt_ms, pct, provenance, steps_line
from traceclf.report import WALLS, Report

WALL_STYLE = {"memory": "magenta", "communication": "cyan", "host": "yellow", "compute": "green"}


def render_terminal(report: Report, to_string: bool = False) -> str | None:
    buffer = io.StringIO() if to_string else None
    console = Console(file=buffer, highlight=False, force_terminal=False if to_string else None)
    if not console.is_terminal:  # piped or saved: rich would assume 80 columns
        console.width = 120
    for part in (
        _header(report),
        _verdict(report),
        _ranks_table(report),
        _details(report),
        _top_kernels(report),
        _fixes(report),
    ):
        if part is not None:
            console.print(part)
    return buffer.getvalue() if buffer else None


def _header(report: Report) -> Text:
    files = ", ".join(Path(i["path"]).name for i in report.inputs)
    text = Text()
    text.append(f"traceclf {report.traceclf_version}", style="bold")
    text.append(f" · {files}\n")
    text.append(provenance(report), style="dim")
    text.append("\n" + steps_line(report))
    return text


def _verdict(report: Report) -> Panel:
    cls = report.classification
    bound = cls.get("bound", "unknown")
    style = WALL_STYLE.get(bound, "white")
    scores = cls.get("scores", {})
    top = max(scores.values(), default=0) or 1
    bars = Table.grid(padding=(0, 1))
    for wall in WALLS:
        score = scores.get(wall, 0.0)
        bar = "█" * round(20 * score / top) if score > 0 else "·"
        bars.add_row(
            Text(wall, style=WALL_STYLE[wall]),
            Text(bar, style=WALL_STYLE[wall]),
            Text(f"{score:.2f}", style="dim"),
        )
    evidence = Text()
    for line in cls.get("evidence", []):
        evidence.append(f"• {line}\n")
    tail = Text()
    if report.applied:
        tail.append("Already applied: ", style="bold")
        tail.append("; ".join(report.applied) + "\n")
    if report.next_wall:
        tail.append("Next wall once this one is fixed: ", style="bold")
        tail.append(report.next_wall, style=WALL_STYLE.get(report.next_wall, ""))
    title = Text(f" {bound.upper()}-bound ", style=f"bold {style}")
    title.append(f"(confidence {cls.get('confidence', 0):.2f}) ", style="dim")
    return Panel(
        Group(bars, Text(""), evidence, tail), title=title, title_align="left", border_style=style
    )


def _ranks_table(report: Report) -> Table:
    table = Table(
        title="Where the steady-state step goes (share of wall time)",
        title_justify="left",
        show_edge=False,
    )
    for col in (
        "rank",
        "pid",
        "step",
        "busy",
        "compute",
        "exposed comm",
        "copies",
        "idle: launch",
        "sync",
        "input",
        "other",
    ):
        table.add_column(col, justify="right", no_wrap=True)
    for r in report.ranks:
        m = r["metrics"]
        table.add_row(
            str(r["rank"]),
            str(r["pid"]),
            fmt_ms(m.get("step_time_ms")),
            pct(m.get("gpu_busy_frac")),
            pct(m.get("compute_frac")),
            pct(m.get("exposed_comm_frac")),
            pct(m.get("copy_frac")),
            pct(m.get("idle_launch_frac")),
            pct(m.get("idle_sync_frac")),
            pct(m.get("idle_input_frac")),
            pct(m.get("idle_other_frac")),
        )
    return table


def _details(report: Report) -> Table:
    m = report.metrics
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    comm = (
        ", ".join(
            f"{kind} {pct(v['frac'])} ({pct(v['exposed_frac'])} exposed)"
            for kind, v in report.comm_by_kind.items()
        )
        or "none"
    )
    table.add_row(
        "Communication",
        f"{pct(m.get('comm_frac'))} of the step, "
        f"{pct(m.get('exposed_comm_frac'))} exposed · {comm}",
    )
    cross = report.cross_rank or {}
    if cross.get("straggler_rank") is not None:
        table.add_row(
            "Across ranks",
            f"step-time skew {pct(cross.get('step_time_skew_frac'))}, "
            f"compute skew {pct(cross.get('compute_skew_frac'))}, "
            f"straggler rank {cross['straggler_rank']}",
        )
    table.add_row(
        "Host",
        f"{_num(m.get('kernels_per_step'))} kernels/step, median kernel "
        f"{_num(m.get('median_kernel_us'))} µs vs launch "
        f"{_num(m.get('median_launch_us'))} µs, "
        f"{_num(m.get('sync_calls_per_step'))} syncs/step, "
        f"{_num(m.get('small_d2h_per_step'))} tiny D2H copies/step, "
        f"CUDA graphs {pct(m.get('graph_frac'))} of busy time",
    )
    table.add_row(
        "Memory",
        f"H2D+D2H {fmt_bytes(m.get('h2d_d2h_bytes_per_step'))}/step "
        f"({pct(m.get('offload_copy_frac'))} of the step), "
        f"{_num(m.get('pageable_copies_per_step'))} pageable copies/step, "
        f"{_num(m.get('alloc_calls_per_step'))} cudaMalloc/Free per step, "
        f"recompute {pct(m.get('recompute_frac'))}, "
        f"peak memory {pct(m.get('peak_memory_frac'))} of capacity",
    )
    families = sorted(
        ((k.removesuffix("_time_frac"), v) for k, v in m.items() if k.endswith("_time_frac") and v),
        key=lambda kv: -kv[1],
    )
    table.add_row(
        "Compute",
        ", ".join(f"{f} {pct(v)}" for f, v in families[:5])
        + f" of kernel time · small grids {pct(m.get('small_grid_kernel_frac'))}, "
        f"theoretical occupancy {pct(m.get('theoretical_occupancy_mean'))}"
        + (
            f", SM active {pct(m['sm_active_mean'])}, tensor active "
            f"{pct(m.get('tensor_active_mean'))}"
            if m.get("sm_active_mean") is not None
            else ""
        ),
    )
    return table


def _top_kernels(report: Report) -> Table | None:
    rows = report.ranks[0].get("top_kernels", []) if report.ranks else []
    if not rows:
        return None
    table = Table(title="Top kernels (rank 0, steady state)", title_justify="left", show_edge=False)
    for col, just in (
        ("kernel", "left"),
        ("family", "left"),
        ("count", "right"),
        ("median", "right"),
        ("share of step", "right"),
    ):
        table.add_column(
            col,
            justify=just,
            overflow="ellipsis",
            no_wrap=col == "kernel",
            max_width=60 if col == "kernel" else None,
            min_width=None if col == "kernel" else 6,
        )
    for k in rows[:8]:
        table.add_row(
            k["name"],
            k["family"],
            str(k["count"]),
            f"{k['median_ns'] / 1e3:.1f} µs",
            pct(k["frac"]),
        )
    return table


def _fixes(report: Report) -> Group:
    parts: list = [Text("What to change, in order", style="bold underline")]
    if not report.fixes:
        parts.append(Text("Nothing urgent: no wall dominates this run."))
    for i, fix in enumerate(report.fixes, 1):
        head = Text(f"{i}. ", style="bold")
        head.append(fix.get("title", fix["id"]), style="bold")
        head.append(
            f"  [{fix['id']} · {fix.get('wall', '')}]",
            style=WALL_STYLE.get(fix.get("wall", ""), "dim"),
        )
        parts.append(head)
        if fix.get("why"):
            parts.append(Text("   " + fix["why"].strip()))
        if fix.get("config"):
            parts.append(
                Syntax(
                    fix["config"].strip(),
                    "python",
                    theme="ansi_dark",
                    padding=(0, 3),
                    background_color="default",
                )
            )
        for label, key in (("needs", "preconditions"), ("watch out", "pitfalls")):
            for item in fix.get(key) or []:
                parts.append(Text(f"   {label}: {item}", style="dim"))
    return Group(*parts)


def _num(v) -> str:
    if v is None:
        return "–"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
