"""What the traces can support, decided before any wall is judged (docs/judgement.md): the
report's ``capture`` block, and whether to abstain.

traceclf abstains (``classification.bound`` null, no fixes, exit 0) when the capture holds too
little GPU work to judge (less than the ``min_gpu_work_ms`` threshold), or nothing repeats (no step, no graph replay, no regularly recurring
kernel): a verdict on one-off work would be a guess. An export without any kernel at all is bad
input (exit 2) and never reaches this module.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from traceclf.support.units import counted

if TYPE_CHECKING:
    from traceclf.measures.handoff import ExportResult, RankResult, StepSummary

LOOP_ORDER = ("training", "forward_only", "unknown", "not_a_loop")


def rank_capture(facts: dict, thresholds: dict[str, int | float]) -> dict:
    """One rank's capture facts (``ranks[].capture``) with the judge's ``training_loop``
    beside ``repeating``, where the report has always shown it."""
    out = {}
    for key, value in facts.items():
        out[key] = value
        if key == "repeating":
            out["training_loop"] = training_loop(facts, thresholds)
    return out


def training_loop(facts: dict, thresholds: dict[str, int | float]) -> str:
    """training | forward_only | not_a_loop | unknown (docs/judgement.md): a loop trains when
    it shows a backward pass or an optimizer; it is a deep-learning framework's when its
    framework kernels take at least ``framework_kernel_share`` of kernel time (DL runs put most
    of their time in ATen/cuBLAS/CUTLASS/flash/NCCL kernels, an HPC code in its own) and its
    process runs Python (cuBLAS and CUTLASS kernels alone are a benchmark's or an HPC code's
    as much as a framework's: a CUTLASS benchmark read as "forward passes only")."""
    if not facts.get("repeating"):
        return "not_a_loop"
    e = facts.get("training_evidence") or {}
    if e.get("backward_kernels") or e.get("autograd_launches") or e.get("backward_ranges"):
        return "training"
    if e.get("optimizer_kernels") or e.get("optimizer_ranges"):
        return "training"
    framework = (e.get("framework_kernel_frac") or 0) >= thresholds["framework_kernel_share"]
    if framework and facts.get("python_process"):
        return "forward_only"
    return "unknown"


def capture_block(
    ranks: list[RankResult],
    exports: list[ExportResult],
    thresholds: dict[str, int | float],
    skipped: list[dict],
) -> dict:
    """The contract's ``capture`` block from the per-rank facts and the inputs left out."""
    facts = [rank_capture(r.measures.capture, thresholds) for r in ranks]
    first = ranks[0].steps if ranks else None
    assignment = gpu_assignment(ranks, exports)
    return {
        "inputs": len(exports),
        "skipped_inputs": skipped,
        "ranks": len(ranks),
        "gpus_per_rank": [
            {
                "rank": i,
                "pid": r.pid,
                "gpu": (r.gpu or {}).get("name"),
                "device": r.placement.device,
            }
            for i, r in enumerate(ranks)
        ],
        "ranks_share_gpu": assignment == "shared",
        "gpu_assignment": assignment,
        "training_loop": _loop(facts),
        "training_evidence": facts[0].get("training_evidence") if facts else {},
        "moe_evidence": any(
            (f.get("training_evidence") or {}).get("moe_kernels")
            or (f.get("training_evidence") or {}).get("moe_ranges")
            for f in facts
        ),
        "step_anchor": _anchor(first),
        "second_anchor": first.second_anchor if first else None,
        "steps_found": first.count if first else 0,
        "steps_used": first.used if first else 0,
        "steps_analysed": first.analysed if first else 0,
        "warmup_dropped": _warmup(first),
        "window_ns": first.window_ns if first else [0, 0],
        "window_share_of_capture": _min(f.get("window_share_of_capture") for f in facts),
        "kernels_outside": _outside(f.get("kernels_outside") or [] for f in facts),
        # (the rank whose copies outside hold the largest share of its GPU work)
        "copies_outside": max(
            (f["copies_outside"] for f in facts if f.get("copies_outside")),
            key=lambda c: c["share"],
            default=None,
        ),
        "read_path": _common(f.get("read_path", "whole") for f in facts) or "whole",
        "graph_trace_mode": _common(f.get("graph_trace_mode") for f in facts),
        "kernel_mix_source": _common(f.get("kernel_mix_source") for f in facts),
        "gpu_metrics": any(f.get("gpu_metrics") for f in facts),
        "cuda_api_traced": all(f.get("cuda_api_traced", True) for f in facts),
        "nccl_payload": _payload(f.get("nccl_payload") for f in facts),
        "gpu_work_ms": round(sum(f.get("gpu_work_ms") or 0 for f in facts), 4),
        "capture_ms": max((f.get("capture_ms") or 0 for f in facts), default=0),
        "kernels": sum(f.get("kernels") or 0 for f in facts),
        "unusable_rows": _sum_counts(f.get("unusable_rows") or {} for f in facts),
        # the processes given to GPU rows that named none (the CUDA calls' one process)
        "pid_from_calls": sorted({p for f in facts if (p := f.get("pid_from_calls")) is not None}),
        # per export: the strings of one export are shared by its ranks
        "repaired_strings": _sum_counts(e.repaired_strings for e in exports),
        # the host side (docs/judgement.md, "What the host was doing"): the sources every rank
        # has, why one was not read, nsys's messages that matter, the profiler's own work
        "host_sources": _common_sources(f.get("host_sources") for f in facts),
        "host_notes": {k: v for f in facts for k, v in (f.get("host_notes") or {}).items()},
        "diagnostics": _unique_messages(f.get("diagnostics") or [] for f in facts),
        "profiler_overhead_frac": _max(
            r.measures.metrics.get("profiler_overhead_frac") for r in ranks
        ),
        # GPU operations whose launch call the export lacks, the largest share of any rank
        "launch_call_missing_frac": _max(
            r.measures.metrics.get("launch_call_missing_frac") for r in ranks
        ),
        "python_process": any(f.get("python_process") for f in facts),
    }


def gpu_assignment(ranks: list[RankResult], exports: list[ExportResult]) -> str:
    """ "own" (every rank has a GPU of its own), "shared" (two ranks ran on one GPU: they
    time-slice it, so their compute times say nothing about imbalance) or "unknown" (two ranks
    saw the same device ordinal and the export cannot say whether it is one GPU)."""
    groups = Counter(r.placement.key for r in ranks)
    shared = [key for key, n in groups.items() if n > 1]
    if not shared:
        return "own"
    members = [r for r in ranks if r.placement.key in shared]
    if all(r.placement.mapped for r in members):
        return "shared"
    # Pigeonhole: more ranks in one export than it has GPUs.
    gpus = {e.path: e.gpu_count for e in exports}
    per_export = Counter(r.path for r in members)
    if any(gpus.get(path) and n > gpus[path] for path, n in per_export.items()):
        return "shared"
    return "unknown"


def abstain_reason(
    capture: dict, ranks: list[RankResult], thresholds: dict[str, int | float]
) -> str | None:
    """A sentence naming the facts when the trace cannot support a verdict, else None."""
    work, span, kernels = capture["gpu_work_ms"], capture["capture_ms"], capture["kernels"]
    facts = f"{counted(kernels, 'kernel')}, {_ms(work)} of GPU work in a {_ms(span)} GPU span"
    host = _host_story(ranks)
    if work < thresholds["min_gpu_work_ms"]:
        return f"too little GPU work to judge: {facts}{host}"
    if capture["training_loop"] == "not_a_loop":
        return f"no repeating step {_why_no_steps(ranks)}: {facts}{host}"
    return None


def _why_no_steps(ranks: list[RankResult]) -> str:
    """What the trace lacks for steps: NVTX step ranges it has but cannot place on the GPU
    without the CUDA API trace are named, not denied."""
    facts = [r.measures.capture for r in ranks]
    ranges = max((f.get("nvtx_step_ranges") or 0 for f in facts), default=0)
    if ranges and not all(f.get("cuda_api_traced", True) for f in facts):
        return (
            f"on the GPU: the {ranges} NVTX step ranges cannot be placed on it without the CUDA "
            "API trace (profile with -t cuda,nvtx), and no graph replay or kernel recurs "
            "regularly"
        )
    return "(no NVTX step, graph replay or regularly recurring kernel)"


def _host_story(ranks: list[RankResult]) -> str:
    """'; 347 ms of the idle GPU time the host was in NVTX 'X' → 'Y' (compile)' from the rank
    whose idle NVTX range is longest (Y: the innermost range of X's activity)."""
    best = None
    for r in ranks:
        for row in r.measures.idle_nvtx[:1]:
            ms = row["ms_per_step"] * max(r.steps.used or 1, 1)
            if best is None or ms > best[0]:
                best = (ms, row["name"], row.get("detail"), row.get("activity"))
    if best is None:
        return ""
    ms, name, detail, activity = best
    inner = f" → '{detail}'" if detail else ""
    what = f" ({activity})" if activity else ""
    return f"; {_ms(ms)} of the idle GPU time the host was in NVTX '{name}'{inner}{what}"


def _ms(ms: float) -> str:
    return f"{ms:.3g} ms" if ms < 1000 else f"{ms / 1000:.3g} s"


def _loop(facts: list[dict]) -> str:
    loops = [f.get("training_loop") or "unknown" for f in facts]
    return min(loops, key=LOOP_ORDER.index) if loops else "unknown"


def _anchor(steps: StepSummary | None) -> dict:
    """How steps were found; ``unit`` "period" for a recurring kernel's period: nothing marks
    a step, and the period may be one step, several, or one layer of one."""
    if not steps:
        return {"source": "none", "label": "", "unit": "step"}
    unit = "period" if steps.source == "pattern" else "step"
    return {"source": steps.source, "label": steps.label, "unit": unit}


def _warmup(steps: StepSummary | None) -> int:
    steady = steps.steady if steps else []
    return next((i for i, s in enumerate(steady) if s), len(steady))


def _common(values) -> str | None:
    distinct = set(values)
    if not distinct:
        return None
    return distinct.pop() if len(distinct) == 1 else "mixed"


def _payload(values) -> str:
    seen = set(values)
    for state in ("values", "declared_empty"):
        if state in seen:
            return state
    return "absent"


SOURCE_ORDER = ("nvtx", "cuda_api", "osrt", "sampling", "python_sampling", "sched")


def _common_sources(per_rank) -> list[str]:
    """The host sources every rank has, in the contract's order."""
    sets = [set(s or ()) for s in per_rank]
    common = set.intersection(*sets) if sets else set()
    return [s for s in SOURCE_ORDER if s in common]


def _unique_messages(per_rank) -> list[dict]:
    seen, out = set(), []
    for messages in per_rank:
        for m in messages:
            key = (m.get("kind"), m.get("text"))
            if key not in seen:
                seen.add(key)
                out.append(m)
    return out


def _max(values) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _outside(per_rank) -> list[dict]:
    """The ranks' kernels that run only outside the window, by name: a rank's that holds the
    largest share of its capture's kernel time, largest first."""
    best: dict[str, dict] = {}
    for entry in (e for rank in per_rank for e in rank):
        if entry["name"] not in best or entry["share"] > best[entry["name"]]["share"]:
            best[entry["name"]] = entry
    return sorted(best.values(), key=lambda e: (-e["share"], e["name"] or ""))


def _min(values) -> float | None:
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


def _sum_counts(dicts) -> dict:
    total: Counter = Counter()
    for d in dicts:
        total.update(d)
    return dict(total)
