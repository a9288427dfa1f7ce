"""Kernel by kernel: each kernel's time per step before and after, judged against its own
step-to-step spread (``noise_ms``: so many standard errors of the difference of its two
means, rules/scoring.yaml ``comparison``), and material when its change is at least
``part_share`` of the baseline's step. Regressions come first, largest first; then
improvements, largest first; then the rest."""

from __future__ import annotations

import math

from traceclf.compare.side import Side
from traceclf.report.breakdown import KernelChange, OtherKernels
from traceclf.rulebook.entries import ComparisonSettings

REGRESSED = ("slower", "new")
IMPROVED = ("faster", "removed")


def kernel_diff(
    before: Side, after: Side, settings: ComparisonSettings, step_ms: float
) -> tuple[list[KernelChange], OtherKernels]:
    """Every kernel listed by either side, and the rest as one row. A kernel one side did not
    list while the other side's list was cut short (measures/step_kernels.py: KERNEL_ROWS) may
    have run there unlisted: it joins the rest on both sides rather than read as new or
    removed."""
    b_other, a_other = before.other_ms, after.other_ms
    changes = []
    floor = settings.part_share * step_ms
    for name in dict.fromkeys([*before.kernels, *after.kernels]):
        b, a = before.kernels.get(name), after.kernels.get(name)
        if (b is None and before.truncated) or (a is None and after.truncated):
            b_other += b["ms"] if b else 0.0
            a_other += a["ms"] if a else 0.0
            continue
        changes.append(_change(name, b, a, before.steps, after.steps, settings, floor))
    changes.sort(key=_order)
    return changes, OtherKernels(b_other, a_other, a_other - b_other)


def _change(
    name: str,
    b: dict | None,
    a: dict | None,
    n_before: int,
    n_after: int,
    settings: ComparisonSettings,
    floor: float,
) -> KernelChange:
    either = a or b
    before_ms, after_ms = (b or {}).get("ms", 0.0), (a or {}).get("ms", 0.0)
    delta = after_ms - before_ms
    noise = None
    if b and a:
        noise = _noise(b["sd_ms"], n_before, a["sd_ms"], n_after, settings)
        beyond = abs(delta) > (noise if noise is not None else 0.0)
        material = beyond and abs(delta) >= floor
        # without a spread (one step) only a material change counts as one
        moved = material if noise is None else beyond and delta != 0
        status = ("slower" if delta > 0 else "faster") if moved else "same"
    else:
        status = "new" if b is None else "removed"
        material = abs(delta) >= floor
    return KernelChange(
        name=name,
        short_name=either["short_name"],
        family=either["family"],
        before_ms_per_step=before_ms,
        after_ms_per_step=after_ms,
        delta_ms_per_step=delta,
        before_instances_per_step=(b or {}).get("instances", 0.0),
        after_instances_per_step=(a or {}).get("instances", 0.0),
        noise_ms=noise,
        status=status,
        material=material,
        before_shapes=(b or {}).get("shapes", []),
        after_shapes=(a or {}).get("shapes", []),
    )


def _noise(
    sd_b: float | None, n_b: int, sd_a: float | None, n_a: int, settings: ComparisonSettings
) -> float | None:
    """So many standard errors of the difference of two means of per-step times."""
    if sd_b is None or sd_a is None or n_b < 2 or n_a < 2:
        return None
    return settings.noise_standard_errors * math.hypot(sd_b / math.sqrt(n_b), sd_a / math.sqrt(n_a))


def _order(c: KernelChange) -> tuple[int, float, str]:
    """Regressions (largest first), improvements (largest first), then the rest by size."""
    if c.status in REGRESSED:
        return (0, -c.delta_ms_per_step, c.name)
    if c.status in IMPROVED:
        return (1, c.delta_ms_per_step, c.name)
    return (2, -abs(c.delta_ms_per_step), c.name)
