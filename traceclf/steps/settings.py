"""The numbers that decide the steps (rules/thresholds.yaml, "Steps"): which leading steps are
warm-up, which steady steps are outliers, which kernel recurs regularly enough to mark steps,
and when a second anchor agrees with the first. Rule data like every threshold: the analysis
reads them from its rule set (bundled, or a ``--rules`` folder over it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class StepSettings:
    warmup_step_factor: float  # a leading step slower than this x the median step is warm-up
    outlier_step_factor: float  # outside [median / f, median x f]: left out of the statistics
    recurring_kernel_max_spread: float  # spread of a recurring kernel's later periods
    recurring_kernel_robust_periods: float  # from this many periods on, their robust spread
    recurring_kernel_max_mean_ratio: float  # mean period over median at most (periods tile time)
    recurring_kernel_min_work_share: float  # its occurrences span this share of kernel time
    anchor_same_frac: float  # a second anchor's step time equal within this share
    anchor_multiple_frac: float  # ... or a whole multiple within this share of the multiple
    anchor_max_multiple: float  # ... up to this multiple (beyond: no second anchor at all)

    @classmethod
    def of(cls, thresholds: Mapping[str, int | float]) -> StepSettings:
        """The step settings of a rule set's thresholds."""
        return cls(**{f.name: float(thresholds[f.name]) for f in fields(cls)})


def bundled_settings() -> StepSettings:
    """The step settings of the bundled rules (for API users who pass none)."""
    from traceclf.rulebook.layers import bundled_thresholds

    return StepSettings.of(bundled_thresholds())
