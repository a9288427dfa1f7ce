"""What rules may name, and the rule set checked against it: every measure
(:data:`traceclf.measures.MEASURES`) and the context names below, facts about the run that the
judge adds to the measures (:func:`traceclf.judge.engine.build_env`).

The rule files are data read by :mod:`traceclf.rulebook` (below the measures in the layer
order); :func:`load_rules` hands it these names.
"""

from __future__ import annotations

import functools
from pathlib import Path

from traceclf.rulebook import layers
from traceclf.rulebook.layers import RuleSet
from traceclf.support.errors import TraceError

# Names a rule may use besides the measures: facts about the run, not about one rank's step.
CONTEXT_NAMES: dict[str, str] = {
    "gpu_family": 'GPU family from gpu_families: "hopper", "blackwell", "gb200", ... or "unknown"',
    "gpu_name": "GPU name from TARGET_INFO_GPU (null when unknown)",
    "gpu_chip": "GPU chip name, e.g. GH100 (null when unknown)",
    "gpu_sm_count": "streaming multiprocessors of the GPU",
    "gpu_memory_bytes": "device memory capacity in bytes",
    "rank_count": "ranks analysed together",
    "host_count": "hosts the ranks ran on (distinct hostnames; null when an export does not "
    "name its host)",
    "uses_cuda_graphs": "CUDA-graph executions in the steady state on any rank",
    "comm_libraries": 'communication libraries seen, e.g. ["nccl"], ["deepep", "nccl"]',
    "comm_kinds": 'collective kinds seen, e.g. ["all_to_all", "all_reduce"]',
    "other_comm_kinds": "the collective kinds seen other than all-to-all",
    "straggler_rank": "rank with the most compute per step among like ranks (null with one "
    "rank, unlike ranks, ranks that share a GPU, or a skew within the noise)",
    "step_time_skew_frac": "spread of step time across like ranks, as a fraction of the mean",
    "compute_skew_frac": "spread of compute time per step across like ranks, as a fraction",
    "comm_wait_frac": "share of matched collective time spent waiting for the last rank "
    "(duration minus the shortest participant's; null without matched collectives)",
    "comm_transfer_frac": "share of matched collective time that is transfer (shortest "
    "participant's duration)",
    "last_arriver_rank": "rank that starts matched collectives last most often",
    "training_loop": 'capture: "training", "forward_only", "not_a_loop" or "unknown"',
    "ranks_share_gpu": "capture: two or more ranks ran on one GPU (time-slicing it)",
    "moe_evidence": "capture: kernels or NVTX ranges of mixture-of-experts routing (taxonomy moe)",
    "gpu_assignment": 'capture: "own" (a GPU per rank), "shared" or "unknown" (ranks report one '
    "device and the export cannot say whether it is one GPU)",
    "graph_trace_mode": 'capture: CUDA-graph tracing, "graph", "node" or "none"',
    "cuda_api_traced": "capture: the CUDA API was traced on every rank (the export has "
    "CUPTI_ACTIVITY_KIND_RUNTIME rows): idle causes and launch counts are known",
    "steps_used": "steady-state steps in the window",
    "step_source": 'how steps were found: "nvtx", "graph", "pattern", "mixed" or "none"',
    "idle_top_nvtx": "the NVTX range the host was in for the most idle GPU time (null: none)",
    "idle_top_activity": "what that range was doing per the taxonomy (compile, data, mpi, ...)",
    "idle_top_nvtx_frac": "the share of the step that range covers while the GPU idles",
    "ep_exposed_frac": "share of the step the communicators inferred to serve EP run with no "
    "compute (null: none is)",
    "ep_spans_hosts": "an EP communicator's ranks are on several hosts (false: all on one; null: "
    "the export cannot say, e.g. ranks of it are not in the capture)",
    "ep_link_bound": "an EP communicator's bus bandwidth is at least link_bound_frac of its "
    "link's peak (null: sizes or the link's peak not in the export)",
    "ep_busbw_gbs": "the EP communicators' bus bandwidth (GB/s, nccl-tests' formula; the largest)",
    "ep_link_peak_gbs": "the peak per direction of the link they cross (GB/s)",
    "late_rank": "the rank that arrives late at matched collectives for the most time per step",
    "late_frac": "how late it arrives, per step, as a share of the step",
    "late_host_nvtx": "the NVTX range its host was in while its GPU idled for the most of that "
    "lateness (null: none)",
    "late_host_nvtx_frac": "that idle time beyond the median rank's, as a share of the step",
    "late_compute_frac": "its compute time beyond the median rank's in those stretches, as a "
    "share of the step",
    "link_name": "the GPU's link to host memory (hardware.yaml host_links), e.g. PCIe Gen5 x16",
    "link_gbps": "that link's bandwidth per direction in GB/s (null for an unknown GPU)",
    "host_sources": 'capture: the host sources every rank has, e.g. ["nvtx", "cuda_api", '
    '"osrt", "sampling", "python_sampling", "sched"]',
    "python_process": "capture: a rank's process runs Python (its or its threads' names, or "
    "Python samples)",
    "capture_profiler_overhead_frac": "capture: nsys's own work in the window, the largest "
    "share of any rank (profiler_overhead_frac)",
    "capture_launch_call_missing_frac": "capture: the window's GPU operations whose launch call "
    "the export lacks, the largest share of any rank (launch_call_missing_frac)",
    "capture_dropped_data": "capture: nsys says it dropped or lost events, cut the capture or "
    "hit a CUPTI error (diagnostics)",
    "capture_dropped_kinds": 'capture: which of those, e.g. "dropped, truncated"',
    "idle_top_source": "the host source of the largest host_attribution row other than nsys's "
    "own work, NVTX, CUDA calls and the unattributed rest (osrt, python_sampling, sched, "
    "sampling; null: none)",
    "idle_top_source_label": 'that source in words, e.g. "OS runtime", "Python samples"',
    "idle_top_what": "what the launching thread was in for that row, e.g. poll, or a function",
    "idle_top_what_frac": "that row's share of the step",
    "idle_top_what_ms": "that row in ms per step",
    "idle_top_what_evidence": 'its source and numbers in words, e.g. "OS runtime, 18 calls" '
    'or "323 Python samples, 323 in data-loading code"',
}


# The context names the communication block gives (judge/comm_groups.py rule_facts).
COMMUNICATION_FACTS = (
    "ep_exposed_frac",
    "ep_spans_hosts",
    "ep_link_bound",
    "ep_busbw_gbs",
    "ep_link_peak_gbs",
    "late_rank",
    "late_frac",
    "late_host_nvtx",
    "late_host_nvtx_frac",
    "late_compute_frac",
)


@functools.cache
def known_names() -> frozenset[str]:
    """Every measure and context name a rule may use (importing every measure costs a cached
    re-analysis more than the rest of it: a rule stamp that vouches for the names spares it,
    and the rule set carries the names it was checked against as ``RuleSet.names``)."""
    from traceclf.measures import MEASURES

    return frozenset(MEASURES) | frozenset(CONTEXT_NAMES)


# The thresholds (rules/thresholds.yaml) the judge's own code reads; conditions may use them all.
JUDGE_THRESHOLDS = (
    "min_gpu_work_ms",  # abstention (judge/abstention.py)
    "framework_kernel_share",  # training_loop (judge/abstention.py)
    "like_ranks_tolerance",  # which ranks are compared (judge/straggler.py)
    "straggler_min_skew",
    "straggler_noise_factor",
    "wait_dominates_frac",  # the cross-rank verdict (judge/straggler.py)
    "clock_alignment_max_us",  # matched collectives across hosts trusted (judge/straggler.py)
    "link_bound_frac",  # a communicator near its link's peak (judge/comm_groups.py)
    "local_exchange_slow_gbps",  # a communicator of one host far below any link (comm_groups)
    "local_exchange_min_bytes",
    "worth_doing_frac",  # a fix beside the bound (judge/engine.py)
    "negligible_gain_frac",  # a fix that wins back next to nothing (judge/engine.py)
)


def load_rules(rules_dir: Path | str | None = None, remember: Path | None = None) -> RuleSet:
    """The bundled rules with ``rules_dir`` merged over them, checked against
    :func:`known_names` (:func:`traceclf.rulebook.layers.load_rules`), with every threshold
    the judge reads."""
    rs = layers.load_rules(rules_dir, remember, known_names)
    missing = [name for name in JUDGE_THRESHOLDS if name not in rs.thresholds]
    if missing:
        raise TraceError(rs.folders[0], f"threshold {missing[0]!r}: missing from the bundled rules")
    return rs
