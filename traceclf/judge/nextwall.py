"""The wall a run hits once its bound is fixed (the report's ``next_wall``; docs/rules.md,
"Scoring", step 7): another wall that scores, else the bound itself where its fixes with a
measured ceiling leave it the largest wall, else the wall with the largest share of what is
left of the step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from traceclf.judge import ceiling
from traceclf.rulebook.entries import WALLS, Scoring


def next_wall(
    scores: dict[str, float],
    bound: str,
    scoring: Scoring,
    env: Mapping[str, Any],
    fixes: list[dict],
) -> str | None:
    """The wall the run hits once the bound is fixed: the strongest other wall that scores;
    else the bound itself where what its fixes leave of its share (their measured ceilings,
    not all of it) still outweighs every other wall's; else the next wall of the workflow that
    scores, or, before the last wall of the workflow, the wall with the largest share of what
    is left of the step once the bound's share is gone."""
    others = sorted((w for w in WALLS if w != bound), key=lambda w: -scores[w])
    if others and scores[others[0]] >= scoring.meaningful:
        return others[0]
    shares = {w: scoring.time_share[w].value(env) for w in WALLS}
    known = all(isinstance(v, (int, float)) for v in shares.values())
    after = scoring.workflow[scoring.workflow.index(bound) + 1 :]
    # (the last wall of the workflow, compute, names no next wall: it is retuned, not fixed)
    if known and after and _bound_stays(bound, shares, fixes, env):
        return bound
    scored = next((w for w in after if scores[w] > 0), None)
    if scored or not after:
        return scored
    if not known:
        return None
    rest = 1 - shares[bound]
    remaining = {
        w: shares[w] / rest
        for w in others
        if rest > 0 and shares[w] / rest >= scoring.next_wall_min_share
    }
    return max(remaining, key=remaining.__getitem__) if remaining else None


def _bound_stays(bound: str, shares: dict, fixes: list[dict], env: Mapping[str, Any]) -> bool:
    """Whether the bound's share of the step, less what its fixes recover together (their
    combined per-step ceiling, no interval counted twice), still outweighs every other wall's:
    pinned memory for copies that fill 96% of a step leaves 128 ms of them at the link's rate,
    against 21 ms of compute. Only measured ceilings count (a throughput gain stated: "up to
    the exposed all-to-all, nothing bounds how much faster" bounds nothing); False where the
    bound has none: nothing then says how far it can be fixed."""
    step = env.get("step_time_ms")
    if not isinstance(step, (int, float)) or step <= 0:
        return False
    measured = [
        f
        for f in fixes
        if f["wall"] == bound and (f.get("ceiling") or {}).get("throughput_gain") is not None
    ]
    recovered = ceiling.combined(measured, step)["recoverable_ms"]
    if recovered is None:
        return False
    left = shares[bound] - recovered / step
    return all(left >= shares[w] for w in WALLS if w != bound)
