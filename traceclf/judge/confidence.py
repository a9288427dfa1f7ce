"""The one figure that says how sure a verdict is (docs/judgement.md, "Confidence"):
confidence = explained × reliability, where ``explained`` is how much of the step the bound's
evidence accounts for (its time share) and ``reliability`` how far the window can be trusted,
the product of named factors the report shows, each from rules/scoring.yaml."""

from __future__ import annotations

from typing import Any

from traceclf.rulebook.entries import Scoring


def confidence(
    bound: str,
    env: dict[str, Any],
    steps: dict,
    scoring: Scoring,
    capture_distortion: float | None = None,
) -> dict:
    """``{"value", "explained", "reliability", "factors"}``: the bound's time share, times the
    window's reliability, the product of ``factors`` (each in [0, 1]):

    - ``anchor``: how the steps were found (NVTX range or graph launch name the step; a
      recurring kernel is a guess; without steps the whole capture is the window),
    - ``steps``: steady steps used over ``full_confidence_steps`` (capped at 1; not counted
      without steps),
    - ``spread``: 1 / (1 + the coefficient of variation of the step times),
    - ``second_anchor``: ``disagreeing_anchors`` when a second anchor implies another step,
    - ``graph_replays``: 1 − (1 − ``graph_level_replays``) × the share of the step inside
      graph-level traced CUDA-graph replays, whose kernels the trace hides
      (``graph_unresolved_frac``),
    - ``capture_distortion``: ``capture.distorted_weight`` when the capture itself may have
      changed the verdict (profiler overhead, lost data); then also a key of its own."""
    weight = scoring.step_source_weight
    share = scoring.time_share[bound].value(env)
    explained = min(max(float(share), 0.0), 1.0) if isinstance(share, (int, float)) else 0.0
    source = steps.get("source") or "none"
    cv = steps.get("cv") or 0.0
    factors = {
        "anchor": weight.get(source, weight.get("none", 0.5)),
        "steps": (
            1.0
            if source == "none"  # the whole capture is the window: no step to count
            else min(1.0, (steps.get("used") or 0) / scoring.full_confidence_steps)
        ),
        "spread": 1.0 / (1.0 + cv),
        "second_anchor": (
            weight.get("disagreeing_anchors", 0.5) if steps.get("anchors_agree") is False else 1.0
        ),
        "graph_replays": 1.0
        - (1.0 - weight.get("graph_level_replays", 1.0))
        * float(env.get("graph_unresolved_frac") or 0.0),
    }
    if capture_distortion is not None:
        factors["capture_distortion"] = capture_distortion
    reliability = 1.0
    for factor in factors.values():
        reliability *= factor
    out = {
        "value": round(explained * reliability, 3),
        "explained": round(explained, 3),
        "reliability": round(reliability, 3),
        "factors": {k: round(v, 3) for k, v in factors.items()},
    }
    if capture_distortion is not None:
        out["capture_distortion"] = capture_distortion
    return out
