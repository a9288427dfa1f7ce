"""What every format of ``traceclf compare`` shows about the inside of the step, as strings:
kernels that changed, NVTX phases, idle by cause, exposed communication by kind, launch
shapes, peak memory and the reconciliation with the step change. Names come from traces:
each renderer escapes these strings for its format."""

from __future__ import annotations

import re

from traceclf.report.breakdown import (
    STATUSES,
    Breakdown,
    KernelChange,
    PartChange,
    Thresholds,
)
from traceclf.support.units import fmt_bytes, pct

KERNELS_SHOWN = 12  # changed kernels listed in the terminal, Markdown and HTML
NAME_WIDTH = 40
MARK = "*"  # after a status: the change is material
KERNEL_COLUMNS = ("kernel", "before", "after", "change", "inst./step", "status")
PHASE_COLUMNS = ("phase", "before", "after", "change", "idle before", "idle after")
PART_COLUMNS = ("", "before", "after", "change")
SHAPE_COLUMNS = ("kernel", "before", "after")
PHASE_KINDS = {"nvtx": "", "range": "NVTX ", "graph": ""}


def ms(v: float | None) -> str:
    """A time per step: '4.51 ms', '123 µs', '1.2 s'."""
    if v is None:
        return "–"
    if abs(v) >= 1000:
        return f"{v / 1000:.3g} s"
    if abs(v) < 1 and v:
        return f"{v * 1000:.3g} µs"
    return f"{v:.3g} ms"


def signed_ms(v: float | None) -> str:
    """A change of a time per step: '+1.28 ms', '-205 ms', '0 ms'."""
    if v is None:
        return "–"
    if abs(v) < 5e-7:  # below the ns the times are rounded to
        return "0 ms"
    return ("+" if v > 0 else "-") + ms(abs(v))


def sections(b: Breakdown) -> list[tuple[str, tuple[str, ...], list[tuple[str, ...]]]]:
    """The tables every format shows, with their titles; those without rows left out."""
    found = [
        ("Kernels that changed (regressions first)", KERNEL_COLUMNS, kernel_rows(b)),
        ("Launch shape changed", SHAPE_COLUMNS, shape_rows(b)),
        ("Phases", PHASE_COLUMNS, phase_rows(b)),
        ("Idle by cause", PART_COLUMNS, idle_rows(b)),
        ("Communication the step waits for", PART_COLUMNS, communication_rows(b)),
    ]
    return [s for s in found if s[2]]


def lines(b: Breakdown) -> list[str]:
    """The sentences under the tables: kernel counts, the reconciliation, peak memory."""
    out = [kernel_note(b)] if b.kernels else []
    out += reconciliation_lines(b)
    memory = memory_line(b)
    if memory:
        out.append(memory)
    if b.thresholds and (b.kernels or b.phases or b.memory):
        out.append(material_line(b.thresholds))
    return out


def material_line(t: Thresholds) -> str:
    """What the ``*`` means, with the thresholds used."""
    step = f"{pct(t.part_share)} of the baseline step"
    if t.part_floor_ms is not None:
        step = f"{ms(t.part_floor_ms)} per step ({step})"
    band = f" (±{ms(t.step_noise_ms)})" if t.step_noise_ms is not None else ""
    return (
        f"{MARK} material: a change of at least {step}, and past its own noise for a kernel or "
        f"idle, a phase or a recurring range, past the step's noise band{band} for an idle "
        f"cause or a collective kind; peak memory: {pct(t.memory_share)} of the GPU's memory "
        "(rules/scoring.yaml)."
    )


def changed_kernels(b: Breakdown) -> list[KernelChange]:
    """Kernels whose status is not ``same`` or whose change is material, in report order."""
    return [k for k in b.kernels if k.status != "same" or k.material]


def kernel_rows(b: Breakdown) -> list[tuple[str, ...]]:
    """The first KERNELS_SHOWN changed kernels: name, ms per step before and after, change,
    instances per step, status (``*``: material)."""
    shown = changed_kernels(b)[:KERNELS_SHOWN]
    labels = kernel_labels(b.kernels)
    return [
        (
            labels[k.name],
            ms(k.before_ms_per_step),
            ms(k.after_ms_per_step),
            signed_ms(k.delta_ms_per_step),
            f"{_count(k.before_instances_per_step)} → {_count(k.after_instances_per_step)}",
            k.status + (MARK if k.material else ""),
        )
        for k in shown
    ]


def kernel_note(b: Breakdown) -> str:
    """How many kernels were compared, by status, how many are shown, and what the kernels
    not listed one by one add up to."""
    changed = changed_kernels(b)
    statuses = ", ".join(
        f"{n} {status}"
        for status in STATUSES
        if (n := sum(k.status == status for k in b.kernels)) and status != "same"
    )
    material = sum(k.material for k in b.kernels)
    parts = [
        f"{len(b.kernels)} kernels compared over the steady state: "
        f"{statuses or 'none changed beyond its own step-to-step spread'}; {material} "
        f"material{MARK}"
    ]
    if len(changed) > KERNELS_SHOWN:
        parts.append(f"the first {KERNELS_SHOWN} are shown (all in --format json)")
    other = b.other_kernels
    if other and (other.before_ms_per_step or other.after_ms_per_step):
        parts.append(
            f"kernels not listed one by one: {ms(other.before_ms_per_step)} → "
            f"{ms(other.after_ms_per_step)} ({signed_ms(other.delta_ms_per_step)})"
        )
    return "; ".join(parts) + "."


def kernel_labels(kernels: list[KernelChange]) -> dict[str, str]:
    """A display name per kernel: its short name, or where kernels share one, with their
    template arguments reduced to names ('vectorized_elementwise_kernel<8, FillFunctor,
    array>'), numbered if that is not enough; at most NAME_WIDTH characters."""
    count: dict[str, int] = {}
    for k in kernels:
        count[k.short_name] = count.get(k.short_name, 0) + 1
    out: dict[str, str] = {}
    taken: dict[str, int] = {}
    for k in kernels:
        label = k.short_name if count[k.short_name] == 1 else _templated(k.name, k.short_name)
        if len(label) > NAME_WIDTH:
            label = label[: NAME_WIDTH - 1] + "…"
        taken[label] = taken.get(label, 0) + 1
        out[k.name] = label if taken[label] == 1 else f"{label} #{taken[label]}"
    return out


def _templated(name: str, short: str) -> str:
    """``short`` with the top-level template arguments of ``name``, each reduced to its last
    name: 'void ns::f<(int)8, ns::Op<float>, std::array<char *, 1>>(int)' -> 'f<8, Op, array>'."""
    at = name.find(short + "<")
    if at < 0:
        return short
    args, depth, part = [], 0, ""
    for c in name[at + len(short) :]:
        if c in "<(":
            depth += 1
        elif c in ">)":
            depth -= 1
        if depth == 0:
            break
        if depth == 1 and c == ",":
            args.append(part)
            part = ""
        elif not (depth == 1 and c in "<("):  # (not the bracket that opens the list)
            part += c
    args.append(part)
    return f"{short}<{', '.join(_argument(a) for a in args)}>"


def _argument(text: str) -> str:
    """A template argument by its last name: '(int)8' -> '8', 'at::native::Op<float>' -> 'Op'."""
    text = re.sub(r"^\s*\([\w ]+\)\s*", "", text).removeprefix("void ").strip()
    head = re.split(r"[<(\[]", text, maxsplit=1)[0]
    return head.rsplit("::", 1)[-1].strip() or text


def shape_rows(b: Breakdown) -> list[tuple[str, str, str]]:
    """Kernels both runs launched with other (grid × block) shapes."""
    labels = kernel_labels(b.kernels)
    return [
        (labels[k.name], _shapes(k.before_shapes), _shapes(k.after_shapes))
        for k in b.launch_changes
    ]


def _shapes(shapes: list[list[float]]) -> str:
    """'grid 264 × block 128 (8/step), ...'."""
    return ", ".join(
        f"grid {_count(g)} × block {_count(t)} ({_count(n)}/step)" for g, t, n in shapes
    )


def phase_rows(b: Breakdown) -> list[tuple[str, ...]]:
    return [
        (
            PHASE_KINDS[p.kind] + p.phase,
            ms(p.before_ms_per_step),
            ms(p.after_ms_per_step),
            signed_ms(p.delta_ms_per_step) + (MARK if p.material else ""),
            ms(p.before_idle_ms),
            ms(p.after_idle_ms),
        )
        for p in b.phases
    ]


PHASE_NOTE = (
    "Time per step that the GPU work of each NVTX phase spans (forward, backward, optimizer "
    "and outside them add up to the step), NVTX ranges both runs repeat in their steps, and "
    "the time in CUDA-graph replays; idle: no GPU work inside it."
)


def idle_rows(b: Breakdown) -> list[tuple[str, ...]]:
    """All idle first, then each cause either run has."""
    idle = b.idle
    if idle is None:
        return []
    rows = [_part("idle (all causes)", idle)]
    rows += [
        _part(f"  {cause}", part)
        for cause, part in idle.by_cause.items()
        if part.before_ms_per_step or part.after_ms_per_step
    ]
    return rows


def communication_rows(b: Breakdown) -> list[tuple[str, ...]]:
    """Exposed communication by collective kind, then blocking on communication."""
    comm = b.communication
    if comm is None:
        return []
    rows = [
        _part(f"exposed {kind.replace('_', '-')}", part)
        for kind, part in comm.exposed_by_kind.items()
    ]
    blocking = comm.blocking
    if blocking is not None and (blocking.before_ms_per_step or blocking.after_ms_per_step):
        rows.append(_part("blocking on communication", blocking))
    return rows


def _part(label: str, part: PartChange) -> tuple[str, ...]:
    return (
        label,
        ms(part.before_ms_per_step),
        ms(part.after_ms_per_step),
        signed_ms(part.delta_ms_per_step) + (MARK if part.material else ""),
    )


def reconciliation_lines(b: Breakdown) -> list[str]:
    """The step change against the kernels' and idle deltas, and what is left, term by term."""
    r = b.reconciliation
    if r is None:
        return []
    return [
        f"Step change {signed_ms(r.step_change_ms)} = kernels {signed_ms(r.kernels_ms)} + idle "
        f"{signed_ms(r.idle_ms)} + unexplained {signed_ms(r.unexplained_ms)}.",
        f"Unexplained {signed_ms(r.unexplained_ms)} = kernels overlapping each other "
        f"{signed_ms(r.overlap_ms)} + copies with no kernel running {signed_ms(r.copies_ms)} "
        f"+ outlier steps {signed_ms(r.outlier_steps_ms)}.",
    ]


def memory_line(b: Breakdown) -> str | None:
    m = b.memory
    if m is None:
        return None
    delta = "" if m.delta_bytes is None else f" ({'+' if m.delta_bytes >= 0 else '-'}"
    delta += "" if m.delta_bytes is None else f"{fmt_bytes(abs(m.delta_bytes))})"
    of = f" of {fmt_bytes(m.capacity_bytes)}" if m.capacity_bytes else ""
    flag = MARK if m.material else ""
    return (
        f"Peak device memory {fmt_bytes(m.before_bytes)} → {fmt_bytes(m.after_bytes)}"
        f"{delta}{of}{flag}."
    )


def waterfall_steps(b: Breakdown, top: int = 5) -> list[tuple[str, float]]:
    """The step change as steps of a waterfall: the ``top`` kernels that moved most, the
    other kernels, idle and the unexplained rest (ms per step, adding up to the change); none
    when nothing moved (a waterfall of zeros shows nothing)."""
    r = b.reconciliation
    if r is None or not any((r.step_change_ms, r.kernels_ms, r.idle_ms, r.unexplained_ms)):
        return []
    labels = kernel_labels(b.kernels)
    biggest = sorted(b.kernels, key=lambda k: -abs(k.delta_ms_per_step))[:top]
    biggest = [k for k in biggest if k.delta_ms_per_step]
    rest = r.kernels_ms - sum(k.delta_ms_per_step for k in biggest)
    steps = [(labels[k.name], k.delta_ms_per_step) for k in biggest]
    steps += [("other kernels", rest), ("idle", r.idle_ms), ("unexplained", r.unexplained_ms)]
    return steps


def _count(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:,.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.3g}"
