"""Fire the rules on a run's facts, score each wall, name the bound and propose the fixes
(docs/rules.md, "Scoring"), in the workflow order memory -> communication -> host -> compute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceclf.judge import ceiling
from traceclf.judge.confidence import confidence as window_confidence
from traceclf.judge.hostverdict import (
    capture_context,
    capture_options,
    distortions,
    distorts,
    top_context,
)
from traceclf.judge.nextwall import next_wall
from traceclf.judge.vocabulary import COMMUNICATION_FACTS, load_rules
from traceclf.rulebook.entries import WALLS, Fix, GpuFamily, Rule, Scoring
from traceclf.rulebook.expr import Expr
from traceclf.rulebook.fixparts import Pitfall, Precondition
from traceclf.rulebook.layers import RuleSet


@dataclass
class Verdict:
    classification: dict  # {"bound", "confidence", "scores": {wall: float}, "evidence": [str]}
    fixes: list[dict]  # contract fix objects, ordered, each also with "rule_ids" and "score"
    applied: list[str]  # what the trace shows is already applied
    next_wall: str | None


@dataclass(frozen=True)
class _Hit:
    rule: Rule
    score: float
    order: int  # definition order, the last tie-breaker


def evaluate(facts: dict, rules_dir: Path | None = None) -> Verdict:
    """Classify a run from its facts (mean metrics, GPU, ranks, communication by kind, cross-rank
    skew) and propose the fixes, in the workflow order memory -> communication -> host -> compute."""
    rs = load_rules(rules_dir)
    env = build_env(facts, rs)
    hits = _fire(rs, env)
    scores = {w: _combine(h.score for h in hits if h.rule.wall == w) for w in WALLS}
    bound = _bound(scores, rs.scoring)
    # the capture may have changed the verdict (capture.warnings): a factor of reliability
    distorted = rs.capture.distorted_weight if distorts(rs, env, bound) else None
    confidence = window_confidence(bound, env, facts.get("steps") or {}, rs.scoring, distorted)
    # Walls reported with evidence and fixes: the bound and any other wall that matters.
    shown = [w for w in rs.scoring.workflow if w == bound or scores[w] >= rs.scoring.meaningful]
    fixes = _propose(hits, shown, rs, env)
    return Verdict(
        classification=_classification(hits, scores, bound, confidence, shown, rs, env),
        fixes=fixes,
        applied=[_applied_sentence(f, env) for f in by_workflow(rs) if _is_applied(f, env)],
        next_wall=next_wall(scores, bound, rs.scoring, env, fixes),
    )


def capture_quality(facts: dict, rules_dir: Path | None = None) -> dict:
    """The capture block's ``warnings`` (the capture's own distortions that hold) and
    ``host_capture_options`` (what would attribute the idle time no host source does)."""
    rs = load_rules(rules_dir)
    env = build_env(facts, rs)
    return {"warnings": distortions(rs, env), "host_capture_options": capture_options(rs, env)}


def abstained(reason: str) -> Verdict:
    """The verdict when the trace cannot support one: no bound, no fixes, the reason."""
    return Verdict(
        classification={
            "bound": None,
            "confidence": None,
            "abstain_reason": reason,
            "scores": dict.fromkeys(WALLS, 0.0),
            "evidence": [],
            "rules": [],
        },
        fixes=[],
        applied=[],
        next_wall=None,
    )


def _classification(
    hits: list[_Hit],
    scores: dict[str, float],
    bound: str,
    confidence: dict,
    shown: list[str],
    rs: RuleSet,
    env: dict[str, Any],
) -> dict:
    """The contract's classification; evidence of the bound first, then workflow order."""
    workflow = rs.scoring.workflow
    hits = sorted(
        hits, key=lambda h: (h.rule.wall != bound, workflow.index(h.rule.wall), -h.score, h.order)
    )
    noted = [w for w in WALLS if w in shown or scores[w] >= rs.scoring.noteworthy]
    evidence = [h.rule.evidence.render(env) for h in hits if h.rule.wall in noted]
    if max(scores.values()) < rs.scoring.dominant and confidence["explained"] < 0.5:
        evidence.insert(0, rs.scoring.balanced_evidence.render(env))
    return {
        "bound": bound,
        "headline": _headline(bound, rs.scoring, env),
        "confidence": confidence["value"],
        "confidence_basis": {
            k: confidence[k]
            for k in ("explained", "reliability", "factors", "capture_distortion")
            if k in confidence
        },
        "scores": {w: round(scores[w], 3) for w in WALLS},
        "evidence": [e for e in evidence if e],
        "rules": [{"id": h.rule.id, "wall": h.rule.wall, "score": round(h.score, 3)} for h in hits],
    }


def _headline(bound: str, scoring: Scoring, env: dict[str, Any]) -> str:
    """How much of the step the bound takes; for compute, when graph-level traced replays
    hide their kernels, a sentence that says compute is only an upper bound."""
    if bound == "compute" and (env.get("graph_unresolved_frac") or 0) > 0:
        variant = scoring.headline.get("compute_graph_level")
        if variant is not None:
            return variant.render(env)
    return scoring.headline[bound].render(env)


def build_env(facts: dict, rs: RuleSet) -> dict[str, Any]:
    """The names conditions see: every measure (null when absent), the context names, the
    thresholds and the definitions."""
    metrics = facts.get("metrics") or {}
    gpu = facts.get("gpu") or {}
    kinds = facts.get("comm_by_kind") or {}
    cross = facts.get("cross_rank") or {}
    capture = facts.get("capture") or {}
    steps = facts.get("steps") or {}
    idle = facts.get("idle_nvtx") or {}
    env: dict[str, Any] = dict.fromkeys(rs.names) | dict(metrics)
    env |= {
        "gpu_family": gpu_family(gpu, rs.families),
        "gpu_name": gpu.get("name"),
        "gpu_chip": gpu.get("chip"),
        "gpu_sm_count": gpu.get("sm_count"),
        "gpu_memory_bytes": gpu.get("memory_bytes"),
        "rank_count": facts.get("rank_count") or len(facts.get("ranks") or []) or 1,
        "host_count": _count_known(facts.get("hosts") or []),
        "uses_cuda_graphs": bool(metrics.get("uses_cuda_graphs")),
        "comm_libraries": sorted({lib for k in kinds.values() for lib in k.get("libraries") or []}),
        "comm_kinds": sorted(kinds),
        "other_comm_kinds": sorted(k for k in kinds if k != "all_to_all"),
        "straggler_rank": cross.get("straggler_rank"),
        "step_time_skew_frac": cross.get("step_time_skew_frac"),
        "compute_skew_frac": cross.get("compute_skew_frac"),
        "training_loop": capture.get("training_loop") or "unknown",
        "moe_evidence": bool(capture.get("moe_evidence")),
        "ranks_share_gpu": bool(capture.get("ranks_share_gpu")),
        "gpu_assignment": capture.get("gpu_assignment")
        or ("shared" if capture.get("ranks_share_gpu") else "own"),
        "cuda_api_traced": capture.get("cuda_api_traced", True),
        "graph_trace_mode": capture.get("graph_trace_mode") or "none",
        "steps_used": steps.get("used") or 0,
        "step_source": steps.get("source") or "none",
        "idle_top_nvtx": idle.get("name"),
        "idle_top_activity": idle.get("activity"),
        "idle_top_nvtx_frac": idle.get("frac") or 0.0,
        "comm_wait_frac": cross.get("comm_wait_frac"),
        "comm_transfer_frac": cross.get("comm_transfer_frac"),
        "last_arriver_rank": cross.get("last_arriver_rank"),
    } | host_link(gpu, rs)
    env |= facts.get("communication") or dict.fromkeys(COMMUNICATION_FACTS)
    env |= rs.thresholds
    env |= capture_context(capture)
    env |= top_context(facts.get("host_attribution") or [], metrics.get("step_time_ms"))
    for name, definition in rs.definitions.items():  # in order: each may use the ones before
        env[name] = definition.expr.value(env)
    return env


def _count_known(values: list[str | None]) -> int | None:
    """Distinct values, or null when one of them is unknown (or there are none)."""
    return len(set(values)) if values and None not in values else None


def host_link(gpu: dict, rs: RuleSet) -> dict[str, Any]:
    """The GPU's link to host memory from hardware.yaml's ``host_links`` (PCIe generation or
    NVLink-C2C; the export itself does not record it): ``link_name``, ``link_gbps`` (GB/s per
    direction), or nulls for an unknown GPU."""
    text = " ".join(str(gpu.get(k) or "") for k in ("name", "chip")) if gpu else ""
    link = next((ln for ln in rs.host_links if text.strip() and ln.match.search(text)), None)
    return {
        "link_name": link.name if link else None,
        "link_gbps": link.gbps if link else None,
    }


def gpu_family(gpu: dict | None, families: list[GpuFamily]) -> str:
    """First family whose pattern matches the GPU's name or chip; "unknown" otherwise."""
    text = " ".join(str(gpu.get(k) or "") for k in ("name", "chip")) if gpu else ""
    return next((f.family for f in families if text.strip() and f.match.search(text)), "unknown")


def _fire(rs: RuleSet, env: dict[str, Any]) -> list[_Hit]:
    hits = []
    for order, rule in enumerate(rs.rules.values()):
        if rule.enabled and rule.when.holds(env):
            score = rule.score.value(env)
            ok = isinstance(score, (int, float)) and not isinstance(score, bool)
            hits.append(_Hit(rule, min(max(float(score), 0.0), 1.0) if ok else 0.0, order))
    return hits


def _combine(scores: Iterable[float]) -> float:
    """Independent pieces of evidence for one wall: 1 - prod(1 - s) stays in [0, 1] and grows
    with every rule that fires without letting overlapping rules add past certainty."""
    return 1.0 - math.prod(1.0 - s for s in scores)


def _bound(scores: dict[str, float], scoring: Scoring) -> str:
    """The strongest wall (workflow order breaks ties); the default when no rule fired."""
    ranked = sorted(scores, key=lambda w: (-scores[w], scoring.workflow.index(w)))
    return ranked[0] if scores[ranked[0]] > 0 else scoring.default_bound


def _propose(hits: list[_Hit], shown: list[str], rs: RuleSet, env: dict[str, Any]) -> list[dict]:
    """Fixes of the reported walls, each placed where its strongest workflow-first rule puts it;
    then fixes worth doing beside the bound (below); fixes whose hardware requirement fails or
    that the trace shows applied are left out. A fix with a premise the capture contradicts
    comes after the others of its wall."""
    hits = sorted(hits, key=lambda h: (rs.scoring.workflow.index(h.rule.wall), -h.score, h.order))
    found: dict[str, dict] = {}
    for beside in (False, True):
        for h in hits:
            if (h.rule.wall in shown) == beside:
                continue
            if beside and h.score < rs.scoring.noteworthy:
                continue
            for fix_id in h.rule.fixes:
                if beside and fix_id in found and not found[fix_id]["beside"]:
                    continue
                entry = found.setdefault(
                    fix_id, {"wall": h.rule.wall, "score": h.score, "rules": [], "beside": beside}
                )
                entry["score"] = max(entry["score"], h.score)
                entry["rules"].append(h.rule.id)
    framework = rs.scoring.framework_advice_when.holds(env)
    out = []
    for fix_id, entry in found.items():
        fix = rs.fixes[fix_id]
        if (fix.requires is not None and not fix.requires.holds(env)) or _is_applied(fix, env):
            continue
        if not framework and fix.generic is None:
            continue  # framework advice only, and this is not a framework's loop
        obj = _fix_object(fix, entry, env, framework, rs)
        if entry["beside"] and not _worth_doing(obj, env, rs):
            continue
        if _wins_nothing(obj, env, rs):
            continue
        out.append(obj)
    # Beside the bound last; by workflow wall, then what the trace contradicts last, then by
    # what each can recover (stable: rule order breaks ties).
    out.sort(
        key=lambda f: (
            f.get("beside_bound", False),
            rs.scoring.workflow.index(f["wall"]),
            bool(f["contradicted_premises"]),
            ceiling.order_key(f),
        )
    )
    ordered = _prerequisites_first(out, rs)
    ceiling.mark_shared(ordered)
    return _order_reasons(ordered, rs)


def _worth_doing(fix: dict, env: dict[str, Any], rs: RuleSet) -> bool:
    """A fix of a wall that is neither the bound nor scores ``meaningful`` is still worth doing
    when its evidence is noteworthy (checked by the caller) and its ceiling, in ms of the step,
    wins back at least ``worth_doing_frac`` of it: a sync after every kernel in a compute-bound
    code costs 6% of the step, though the host wall scores low."""
    c = fix.get("ceiling") or {}
    step = env.get("step_time_ms")
    if c.get("unit") != "step" or c.get("recoverable_ms") is None or not step:
        return False
    return c["recoverable_ms"] >= rs.thresholds["worth_doing_frac"] * step


def _wins_nothing(fix: dict, env: dict[str, Any], rs: RuleSet) -> bool:
    """Whether the trace measures the time a fix can win back and it is next to none (under
    ``negligible_gain_frac`` of the step): the syncs of a loop whose idle gaps the allocator's
    calls end, not a call that only waits (a kNN code's cudaFree per step), leave
    remove-host-syncs nothing, and a public code that idles after no wait got "+0.0%" as its
    only fix; the rule's evidence still shows."""
    c = fix.get("ceiling") or {}
    # (a floor that leaves nothing says the rule data's assumption is off, e.g. a host link
    # slower than the copies the trace measured: the fix stays, its ceiling says 0; a floor
    # below the step did not cut it, the trace measured nothing to win)
    floor, after = c.get("floor_ms"), c.get("step_after_ms")
    measured = floor is None or (after is not None and floor < after)
    ms, step = c.get("recoverable_ms"), env.get("step_time_ms")
    if c.get("unit") != "step" or ms is None or not measured:
        return False
    return ms == 0 or (bool(step) and ms < rs.thresholds["negligible_gain_frac"] * step)


def _fix_object(fix: Fix, entry: dict, env: dict[str, Any], framework: bool, rs: RuleSet) -> dict:
    config = fix.config if framework else fix.generic
    held = [(when, lines) for when, lines in fix.config_when if framework and when.holds(env)]
    extra = [lines for _, lines in held]
    # (premises and pitfalls of a case the trace does not show are left out: no MoE routing
    # advice for a kNN code)
    premises = [p for p in fix.premises if _said(p, env)]
    contradicted = [(p, _contradiction(p, env)) for p in premises]
    obj = {
        "id": fix.id,
        "wall": entry["wall"],
        "title": fix.title,
        "why": fix.why.render(env),
        "config": "\n".join([config or "", *extra]).strip("\n"),
        "advice": "framework" if framework else "generic",
        "preconditions": [p.text for p, shows in contradicted if shows is None],
        "contradicted_premises": [
            {"premise": p.text, "trace_shows": shows[0], "facts": shows[1]}
            for p, shows in contradicted
            if shows is not None
        ],
        "pitfalls": [p.text for p in fix.pitfalls if _said(p, env)],
        "evidence": _evidence(fix, entry["rules"], env, rs, [when for when, _ in held]),
        "rule_ids": list(dict.fromkeys(entry["rules"])),
        "score": round(entry["score"], 3),
        "ceiling": ceiling.ceiling(fix, env),
    }
    if entry["beside"]:
        obj["beside_bound"] = True
    if fix.verify is not None:
        obj["verify"] = fix.verify.render(env)
    if fix.pytorch and framework:
        obj["pytorch"] = " ".join(fix.pytorch.split())
    return obj


def _said(item: Precondition | Pitfall, env: dict[str, Any]) -> bool:
    """Whether a premise or pitfall applies to this trace: it has no ``when``, or it holds."""
    return item.when is None or item.when.holds(env)


def _contradiction(premise: Precondition, env: dict[str, Any]) -> tuple[str, dict] | None:
    """What the trace shows against a premise (the sentence and the facts it rests on), or
    None when it shows nothing against it: then the user checks it."""
    for when, shows in premise.contradicted:
        if when.holds(env):
            return shows.render(env), {n: env[n] for n in sorted(when.names | shows.names)}
    return None


def _evidence(
    fix: Fix, rule_ids: list[str], env: dict[str, Any], rs: RuleSet, shown: Iterable[Expr] = ()
) -> dict:
    """The measured facts that triggered a fix: every name in the conditions of the rules that
    proposed it, in its own ``requires`` and in the ``config_when`` conditions whose config it
    shows, with its value (definitions are expanded into the names they use, so each fact is a
    measure or a context fact)."""
    names: set[str] = set()
    for rule_id in rule_ids:
        names |= rs.rules[rule_id].when.names
    if fix.requires is not None:
        names |= fix.requires.names
    for when in shown:
        names |= when.names
    names = _expand(names, rs)
    # a null or empty fact triggered nothing (the other side of an "or")
    return {n: env[n] for n in sorted(names) if env.get(n) not in (None, [], "")}


def _expand(names: set[str], rs: RuleSet) -> set[str]:
    out: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        if name in rs.definitions:
            todo += rs.definitions[name].expr.names
    # thresholds are not facts of the run: a fix's evidence names what was measured
    return {n for n in out if n not in rs.definitions and n not in rs.thresholds}


def _prerequisites_first(fixes: list[dict], rs: RuleSet) -> list[dict]:
    """A fix listed in another's ``after`` moves just ahead of it (remove host syncs before CUDA
    graphs: a sync inside a capture fails)."""
    ordered = list(fixes)
    for fix in fixes:
        for before in rs.fixes[fix["id"]].after:
            ids = [f["id"] for f in ordered]
            if before in ids and ids.index(before) > ids.index(fix["id"]):
                moved = ordered.pop(ids.index(before))
                ordered.insert(ids.index(fix["id"]), moved)
    return ordered


WORKFLOW_WHY = "fit first, scale second, then feed the GPU, then speed up its kernels"


def _order_reasons(fixes: list[dict], rs: RuleSet) -> list[dict]:
    """``order`` on a fix listed above a fix with a larger ceiling: why it comes first (a
    prerequisite of that fix, the bound's wall before a fix beside it, a premise the trace
    contradicts, or an earlier wall of the workflow); no key where the order is the ceilings'
    own."""
    workflow = rs.scoring.workflow
    for i, fix in enumerate(fixes):
        mine = (fix.get("ceiling") or {}).get("recoverable_ms")
        larger = [
            f
            for f in fixes[i + 1 :]
            if (ms := (f.get("ceiling") or {}).get("recoverable_ms")) is not None
            and (mine is None or ms > mine)
        ]
        needs = [f["id"] for f in larger if fix["id"] in rs.fixes[f["id"]].after]
        beside = [f for f in larger if f.get("beside_bound") and not fix.get("beside_bound")]
        walls = [f for f in larger if workflow.index(f["wall"]) > workflow.index(fix["wall"])]
        doubted = [
            f
            for f in larger
            if f["wall"] == fix["wall"]
            and f.get("contradicted_premises")
            and not fix.get("contradicted_premises")
        ]
        if needs:
            verb = "needs" if len(needs) == 1 else "need"
            fix["order"] = f"ahead of {', '.join(needs)}, which {verb} it done first"
        elif walls and not walls[0].get("beside_bound"):
            fix["order"] = (
                f"ahead of {walls[0]['id']} (a larger ceiling): the {fix['wall']} wall comes "
                f"first in the workflow, {' → '.join(workflow)} ({WORKFLOW_WHY})"
            )
        elif beside:
            fix["order"] = (
                f"ahead of {beside[0]['id']} (a larger ceiling): that one is beside the bound, "
                "after every fix of the bound's wall"
            )
        elif doubted:
            fix["order"] = (
                f"ahead of {doubted[0]['id']} (a larger ceiling): the trace contradicts a "
                "premise of that one"
            )
    return fixes


def _is_applied(fix: Fix, env: dict[str, Any]) -> bool:
    return fix.applied_when is not None and fix.applied_when.holds(env)


def _applied_sentence(fix: Fix, env: dict[str, Any]) -> str:
    return fix.applied.render(env) if fix.applied else f"{fix.title}: already applied"


def by_workflow(rs: RuleSet) -> list[Fix]:
    return sorted(rs.fixes.values(), key=lambda f: rs.scoring.workflow.index(f.wall))
