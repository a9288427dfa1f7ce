"""The numbers behind the four walls, for one rank over its steady-state window.

Every ``*_frac`` is a fraction of the window's wall time unless its definition says otherwise.
``MEASURES`` below defines each one in a line; ``traceclf measures`` prints them and
docs/measures.md lists them with the function that computes each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from traceclf import intervals, kernels
from traceclf.load import METRIC_NAMES
from traceclf.model import Trace
from traceclf.steps import Steps

MEASURES: dict[str, str] = {
    "step_time_ms": "mean duration of steady-state steps (GPU start to next step's GPU start)",
    "step_time_median_ms": "median of the same",
    "step_time_cv": "standard deviation / mean of steady-state step times",
    "gpu_busy_frac": "union of kernels, CUDA-graph executions, memcpy and memset",
    "gpu_idle_frac": "1 - gpu_busy_frac",
    "compute_frac": "time at least one non-communication kernel or graph execution runs",
    "comm_frac": "union of communication kernels (NCCL, DeepEP, HybridEP, NVSHMEM, userbuffers)",
    "exposed_comm_frac": "communication time with no compute kernel running at the same time",
    "comm_overlap_frac": "share of communication time hidden under compute (of comm time)",
    "compute_under_comm_frac": "share of compute time that runs while communication is in "
    "flight (of compute time): > 0 means comm/compute overlap is in place",
    "a2a_frac": "union of all-to-all kernels (EP dispatch/combine)",
    "a2a_exposed_frac": "all-to-all time with no compute kernel running",
    "copy_frac": "union of memcpy/memset time",
    "exposed_copy_frac": "copy time with neither compute nor communication running",
    "offload_copy_frac": "union of host<->device copy time",
    "h2d_d2h_bytes_per_step": "bytes copied host<->device per step",
    "h2d_bytes_per_step": "bytes copied host->device per step",
    "d2h_bytes_per_step": "bytes copied device->host per step",
    "pageable_copies_per_step": "memcpys from/to pageable host memory per step",
    "pageable_bytes_per_step": "bytes of those copies per step",
    "small_d2h_per_step": "device->host copies of <= 1 KiB per step (.item(), nonzero results)",
    "sync_calls_per_step": "cudaStream/Device/EventSynchronize and blocking cudaMemcpy per step",
    "alloc_calls_per_step": "cudaMalloc/cudaFree (and driver equivalents) per step",
    "launch_calls_per_step": "kernel and graph launch calls per step",
    "median_launch_us": "median duration of a launch call on the host",
    "idle_launch_frac": "idle time while the host was issuing CUDA calls (launch-bound)",
    "idle_sync_frac": "idle time right after a synchronising call returned (sync-bound)",
    "idle_input_frac": "idle gaps >= 1 ms with CUDA calls covering < half of them (input-bound)",
    "idle_other_frac": "remaining idle time (host work between launches, profiler flushes, "
    "unattributed)",
    "kernels_per_step": "kernel rows per step (kernels inside graph-level traced graphs "
    "are not rows)",
    "graph_launches_per_step": "CUDA-graph executions per step (graph-level tracing)",
    "median_kernel_us": "median kernel duration",
    "short_kernel_frac": "kernels shorter than the median launch call",
    "small_grid_kernel_frac": "kernels whose grid has fewer blocks than the GPU has SMs",
    "theoretical_occupancy_mean": "kernel-time-weighted theoretical occupancy from launch "
    "config and TARGET_INFO_GPU limits",
    "graph_frac": "share of busy time inside CUDA-graph executions",
    "uses_cuda_graphs": "any CUDA-graph execution in the window",
    "kernel_stats_outside_window": "kernel shapes taken from eager kernels outside the window "
    "because graph-level tracing hides the replays' kernels",
    "recompute_frac": "share of forward GEMM/attention kernels re-run in backward (needs "
    "forward/backward NVTX ranges; null otherwise)",
    "optimizer_kernels_per_step": "kernels per step launched inside an optimizer NVTX range "
    "(null without one): dozens mean a per-tensor, unfused optimizer",
    "fp8_gemm_frac": "share of GEMM time in FP8 GEMM kernels (e4m3/e5m2/fp8/mxfp8 in the name)",
    "small_grid_gemm_frac": "share of GEMM time in GEMMs whose grid has fewer blocks than SMs",
    "peak_memory_bytes": "peak device memory allocated (CUDA_GPU_MEMORY_USAGE_EVENTS)",
    "peak_memory_frac": "peak_memory_bytes over the GPU's capacity",
    "sm_active_mean": "mean 'SMs Active' GPU metric in the window (0-1)",
    "sm_issue_mean": "mean 'SM Issue' GPU metric in the window (0-1)",
    "tensor_active_mean": "mean 'Tensor Active' GPU metric in the window (0-1)",
}
FAMILY_NAMES = (
    "gemm",
    "attention",
    "elementwise",
    "reduction",
    "permute_moe",
    "optimizer",
    "communication",
    "other",
)
MEASURES |= {f"{fam}_time_frac": f"share of kernel time in {fam} kernels" for fam in FAMILY_NAMES}

SYNC_API = (
    r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy_|"
    r"cudaMemcpy2D_|cudaMemcpyFromSymbol_|cudaMemcpyToSymbol_|cuStreamSynchronize|"
    r"cuCtxSynchronize|cuEventSynchronize|cuMemcpyDtoH_|cuMemcpyHtoD_)"
)
LAUNCH_API = (
    r"^(cudaLaunchKernel|cudaLaunchCooperativeKernel|cuLaunchKernel|cudaGraphLaunch|"
    r"cuGraphLaunch|cudaLaunchKernelExC|cuLaunchKernelEx)"
)
ALLOC_API = (
    r"^(cudaMalloc_|cudaFree_|cudaMallocManaged|cuMemAlloc_|cuMemFree_|cuMemCreate|"
    r"cuMemRelease|cuMemMap_|cuMemUnmap)"
)
FORWARD_NVTX = r"(?i)^(forward|fwd)\b|[_ .:]forward$|\bforward pass"
BACKWARD_NVTX = r"(?i)^(backward|bwd)\b|[_ .:]backward$|\bbackward pass"
OPTIMIZER_NVTX = r"(?i)optimi[sz]er|optim\.|\.step$"
FP8_GEMM = r"(?i)e4m3|e5m2|fp8|mxf8|nvfp4|f8f6f4"
SMALL_D2H_BYTES = 1024
INPUT_GAP_NS = 1_000_000  # a host that makes no CUDA call for >= 1 ms is doing other work
SYNC_SLACK_NS = 20_000  # a sync returns this soon after the GPU drains
METRICS_OF_INTEREST = {f"{key}_mean": key for key in METRIC_NAMES}


@dataclass
class RankMeasures:
    """Measures of one rank, plus the small series the figures are drawn from."""

    metrics: dict[str, float | int | bool | None]
    comm_by_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    top_kernels: list[dict] = field(default_factory=list)
    step_breakdown: list[dict] = field(default_factory=list)
    idle_gaps: dict[str, list] = field(default_factory=dict)
    gpu_metrics_series: dict[str, list] = field(default_factory=dict)


def measure_rank(trace: Trace, steps: Steps, gpu: dict | None) -> RankMeasures:
    window = steps.window
    wall = max(window[1] - window[0], 1)
    n_steps = max(steps.used, 1)
    kern = kernels.classify(intervals.clip(trace.kernels, window))
    graphs = intervals.clip(trace.graphs, window)
    graph_spans = intervals.clip(trace.graph_executions, window)
    copies = intervals.clip(trace.copies, window)
    api = _classify_api(
        intervals.clip(trace.api.select("start", "end", "name", "correlation_id"), window)
    )

    compute = pl.concat(
        [kern.filter(~pl.col("is_comm")).select("start", "end"), graph_spans.select("start", "end")]
    )
    comm = kern.filter(pl.col("is_comm")).select("start", "end")
    step_starts = steps.steady["gpu_start"].to_list() if steps.count else []
    # Profiler overhead (CUPTI buffer flushes, ...) is a layer of its own: not GPU work, but
    # idle time it covers is the profiler's, not the training loop's.
    tl = intervals.timeline(
        {"compute": compute, "comm": comm, "copy": copies, "profiler": trace.overhead},
        window,
        cuts=step_starts,
    )
    state = _state_times(tl)

    m: dict[str, float | int | bool | None] = {
        "step_time_ms": _ms(steps.durations().mean()),
        "step_time_median_ms": _ms(steps.durations().median()),
        "step_time_cv": _cv(steps.durations()),
        "gpu_busy_frac": state["busy"] / wall,
        "gpu_idle_frac": 1 - state["busy"] / wall,
        "compute_frac": state["compute"] / wall,
        "comm_frac": state["comm"] / wall,
        "exposed_comm_frac": state["exposed_comm"] / wall,
        "comm_overlap_frac": (1 - state["exposed_comm"] / state["comm"]) if state["comm"] else None,
        "compute_under_comm_frac": (state["compute"] - state["compute_only"]) / state["compute"]
        if state["compute"]
        else None,
        "copy_frac": state["copy"] / wall,
        "exposed_copy_frac": state["exposed_copy"] / wall,
    }
    comm_by_kind = _comm_by_kind(kern, compute, trace, window, wall)
    a2a = comm_by_kind.get("all_to_all", {})
    m["a2a_frac"] = a2a.get("frac", 0.0)
    m["a2a_exposed_frac"] = a2a.get("exposed_frac", 0.0)
    m |= _copy_measures(copies, wall, n_steps)
    # Without CUDA API rows (not traced) host-side counts are unknown, not zero.
    host_traced = not trace.api.is_empty()
    m |= _host_measures(api, kern, n_steps) if host_traced else dict.fromkeys(HOST_MEASURES)
    gaps = _idle_gaps(tl, api if host_traced else None)
    for cause in ("launch", "sync", "input", "other"):
        m[f"idle_{cause}_frac"] = float(gaps.filter(pl.col("cause") == cause)["dur"].sum()) / wall
    m |= _kernel_measures(kern, graphs, graph_spans, state["busy"], gpu, n_steps)
    # Graph-level tracing hides the kernels of the replays; the same kernels ran eagerly
    # before capture, so their shapes stand in for the kernel mix of the steady state.
    hidden = graph_share_hidden(graphs, state["busy"])
    shape_kernels = kernels.classify(trace.kernels) if hidden else kern
    if hidden:
        shape = _kernel_measures(shape_kernels, graphs, graph_spans, state["busy"], gpu, n_steps)
        m |= {k: shape[k] for k in KERNEL_SHAPE_MEASURES}
    m["kernel_stats_outside_window"] = hidden
    m |= _gemm_measures(shape_kernels, gpu)
    m["recompute_frac"] = _recompute_frac(trace, kern)
    optimizer = _optimizer_kernels(trace, kern)
    m["optimizer_kernels_per_step"] = optimizer / n_steps if optimizer is not None else None
    m |= _memory_measures(trace, gpu)
    gpu_samples = trace.metrics_of_gpu((gpu or {}).get("gpu_id"))
    m |= _gpu_metric_means(gpu_samples, window)

    return RankMeasures(
        metrics={k: _round(v) for k, v in m.items()},
        comm_by_kind=comm_by_kind,
        top_kernels=_top_kernels(kern, wall),
        step_breakdown=_step_breakdown(tl, steps),
        idle_gaps=_gap_histogram(gaps),
        gpu_metrics_series=_metric_series(gpu_samples, window),
    )


def graph_share_hidden(graphs: pl.DataFrame, busy: int) -> bool:
    """True when graph-level traced replays (kernels not in the kernel table) are most of the
    GPU's busy time, so the window's kernel rows do not show what the GPU ran."""
    return busy > 0 and intervals.total(graphs) > busy / 2


def _state_times(tl: pl.DataFrame) -> dict[str, int]:
    c, k, p = pl.col("compute") > 0, pl.col("comm") > 0, pl.col("copy") > 0

    def t(cond: pl.Expr) -> int:
        return int(tl.filter(cond)["dur"].sum())

    return {
        "busy": t(c | k | p),
        "compute": t(c),
        "compute_only": t(c & ~k),
        "comm": t(k),
        "exposed_comm": t(k & ~c),
        "copy": t(p),
        "exposed_copy": t(p & ~c & ~k),
    }


def _comm_by_kind(
    kern: pl.DataFrame, compute: pl.DataFrame, trace: Trace, window: tuple[int, int], wall: int
) -> dict[str, dict[str, float]]:
    comm = _refine_comm_kinds(kern.filter(pl.col("is_comm")), trace)
    out: dict[str, dict[str, float]] = {}
    for (kind,), rows in comm.group_by(["comm_kind"]):
        tl = intervals.timeline({"compute": compute, "comm": rows.select("start", "end")}, window)
        busy = int(tl.filter(pl.col("comm") > 0)["dur"].sum())
        exposed = int(tl.filter((pl.col("comm") > 0) & (pl.col("compute") == 0))["dur"].sum())
        out[str(kind)] = {
            "frac": round(busy / wall, 4),
            "exposed_frac": round(exposed / wall, 4),
            "kernels": len(rows),
            "libraries": sorted(rows["comm_library"].drop_nulls().unique().to_list()),
        }
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["frac"]))


def _refine_comm_kinds(comm: pl.DataFrame, trace: Trace) -> pl.DataFrame:
    """NCCL runs all-to-all and P2P through one SendRecv kernel; NCCL's own NVTX range around
    the launching call (domain "NCCL", e.g. ``ncclAlltoAll``) says which it was."""
    nccl = (
        trace.nvtx.filter(pl.col("domain") == "NCCL")
        .with_columns(nvtx_kind=kernels.nccl_nvtx_kind())
        .filter(pl.col("nvtx_kind").is_not_null())
    )
    if nccl.is_empty() or comm.is_empty():
        return comm
    launches = trace.api.join(comm.select("correlation_id"), on="correlation_id")
    tagged = (
        launches.sort("start")
        .join_asof(
            nccl.select("start", "global_tid", "nvtx_kind", nvtx_end="end").sort("start"),
            on="start",
            by="global_tid",
            strategy="backward",
            check_sortedness=False,
        )
        .filter(pl.col("start") <= pl.col("nvtx_end"))
        .select("correlation_id", "nvtx_kind")
        .unique("correlation_id")
    )
    return (
        comm.join(tagged, on="correlation_id", how="left")
        .with_columns(
            comm_kind=pl.when(
                pl.col("comm_kind").is_in(["send_recv", "other"])
                & pl.col("nvtx_kind").is_not_null()
            )
            .then(pl.col("nvtx_kind"))
            .otherwise(pl.col("comm_kind"))
        )
        .drop("nvtx_kind")
    )


def _copy_measures(copies: pl.DataFrame, wall: int, n_steps: int) -> dict[str, float]:
    memcpy = copies.filter(pl.col("op") == "memcpy")
    h2d = memcpy.filter(pl.col("direction").is_in(["HtoD", "UVM_HtoD"]))
    d2h = memcpy.filter(pl.col("direction").is_in(["DtoH", "UVM_DtoH"]))
    offload = pl.concat([h2d, d2h])
    pageable = memcpy.filter(pl.col("pageable"))
    return {
        "h2d_d2h_bytes_per_step": int(offload["bytes"].sum()) / n_steps,
        "h2d_bytes_per_step": int(h2d["bytes"].sum()) / n_steps,
        "d2h_bytes_per_step": int(d2h["bytes"].sum()) / n_steps,
        "offload_copy_frac": intervals.total(offload) / wall,
        "pageable_copies_per_step": len(pageable) / n_steps,
        "pageable_bytes_per_step": int(pageable["bytes"].sum()) / n_steps,
        "small_d2h_per_step": len(d2h.filter(pl.col("bytes") <= SMALL_D2H_BYTES)) / n_steps,
    }


def _classify_api(api: pl.DataFrame) -> pl.DataFrame:
    """Flag sync, launch and allocation calls (regexes once per distinct API name)."""
    names = (
        api.select("name")
        .unique()
        .with_columns(
            is_sync=pl.col("name").cast(pl.String).str.contains(SYNC_API),
            is_launch=pl.col("name").cast(pl.String).str.contains(LAUNCH_API),
            is_alloc=pl.col("name").cast(pl.String).str.contains(ALLOC_API),
        )
    )
    return api.join(names, on="name", how="left", maintain_order="left")


HOST_MEASURES = (
    "sync_calls_per_step",
    "alloc_calls_per_step",
    "launch_calls_per_step",
    "median_launch_us",
    "short_kernel_frac",
)


def _host_measures(api: pl.DataFrame, kern: pl.DataFrame, n_steps: int) -> dict[str, float]:
    launches = api.filter(pl.col("is_launch"))
    launch_ns = launches["end"] - launches["start"]
    launch_median = float(launch_ns.median()) if len(launches) else None
    durations = kern["end"] - kern["start"]
    return {
        "sync_calls_per_step": len(api.filter(pl.col("is_sync"))) / n_steps,
        "alloc_calls_per_step": len(api.filter(pl.col("is_alloc"))) / n_steps,
        "launch_calls_per_step": len(launches) / n_steps,
        "median_launch_us": launch_median / 1e3 if launch_median is not None else None,
        "short_kernel_frac": (
            float((durations < launch_median).mean())
            if launch_median is not None and len(kern)
            else None
        ),
    }


def _idle_gaps(tl: pl.DataFrame, calls: pl.DataFrame | None) -> pl.DataFrame:
    """Idle stretches of the GPU with their host-side cause (docs/measures.md); all "other"
    when the CUDA API was not traced (``calls`` None), since the causes are read from it."""
    idle = tl.filter((pl.col("compute") == 0) & (pl.col("comm") == 0) & (pl.col("copy") == 0))
    gaps = intervals.union(idle.select("start", "end")).with_columns(
        dur=pl.col("end") - pl.col("start")
    )
    schema = {"start": pl.Int64, "end": pl.Int64, "dur": pl.Int64, "cause": pl.String}
    if gaps.is_empty():
        return pl.DataFrame(schema=schema)
    if calls is None:
        return gaps.with_columns(cause=pl.lit("other")).select(list(schema))
    gstart, gend = gaps["start"].to_numpy(), gaps["end"].to_numpy()
    profiled = idle.filter(pl.col("profiler") > 0)
    pidx = np.searchsorted(gstart, profiled["start"].to_numpy(), side="right") - 1
    profiler_ns = np.bincount(pidx, weights=profiled["dur"].to_numpy(), minlength=len(gaps))
    start, end = calls["start"].to_numpy(), calls["end"].to_numpy()
    # Host coverage: CUDA calls that start inside a gap, clipped to it.
    idx = np.searchsorted(gstart, start, side="right") - 1
    inside = (idx >= 0) & (start < gend[np.maximum(idx, 0)])
    idx_in = idx[inside]
    covered = np.minimum(end[inside], gend[idx_in]) - start[inside]
    api_ns = np.bincount(idx_in, weights=covered, minlength=len(gaps))
    n_calls = np.bincount(idx_in, minlength=len(gaps))
    # A synchronising call that returns at (or just before) the start of a gap drained the queue.
    sync_end = end[calls["is_sync"].fill_null(False).to_numpy()]
    sidx = np.searchsorted(gstart - SYNC_SLACK_NS, sync_end, side="right") - 1
    synced = (sidx >= 0) & (sync_end <= gend[np.maximum(sidx, 0)])
    after_sync = np.zeros(len(gaps), dtype=bool)
    after_sync[sidx[synced]] = True
    gaps = gaps.with_columns(
        api_ns=pl.Series(api_ns),
        calls=pl.Series(n_calls),
        after_sync=pl.Series(after_sync),
        profiler_ns=pl.Series(profiler_ns),
    )
    return gaps.with_columns(
        cause=pl.when(pl.col("profiler_ns") * 2 >= pl.col("dur"))
        .then(pl.lit("other"))  # a profiler flush, not the host's doing
        .when((pl.col("dur") >= INPUT_GAP_NS) & (pl.col("api_ns") * 2 < pl.col("dur")))
        .then(pl.lit("input"))
        .when(pl.col("after_sync"))
        .then(pl.lit("sync"))
        .when(pl.col("calls") > 0)
        .then(pl.lit("launch"))
        .otherwise(pl.lit("other"))
    ).select(list(schema))


KERNEL_SHAPE_MEASURES = (
    "median_kernel_us",
    "small_grid_kernel_frac",
    "theoretical_occupancy_mean",
    *(f"{fam}_time_frac" for fam in FAMILY_NAMES),
)


def _kernel_measures(
    kern: pl.DataFrame,
    graphs: pl.DataFrame,
    graph_spans: pl.DataFrame,
    busy: int,
    gpu: dict | None,
    n_steps: int,
) -> dict[str, float | bool | None]:
    sm_count = (gpu or {}).get("sm_count")
    kern = kern.with_columns(
        dur=pl.col("end") - pl.col("start"), occ=kernels.theoretical_occupancy(gpu)
    )
    total = int(kern["dur"].sum())
    graph_time = intervals.total(graph_spans)
    out: dict[str, float | bool | None] = {
        "kernels_per_step": len(kern) / n_steps,
        "graph_launches_per_step": len(graphs) / n_steps if len(graphs) else 0.0,
        "median_kernel_us": float(kern["dur"].median()) / 1e3 if len(kern) else None,
        "small_grid_kernel_frac": (
            float((kern["grid_blocks"] < sm_count).mean()) if sm_count and len(kern) else None
        ),
        "theoretical_occupancy_mean": (
            float(
                (kern["occ"] * kern["dur"]).sum()
                / kern.filter(pl.col("occ").is_not_null())["dur"].sum()
            )
            if len(kern) and kern["occ"].null_count() < len(kern) and total
            else None
        ),
        "graph_frac": graph_time / busy if busy else 0.0,
        "uses_cuda_graphs": bool(len(graph_spans)),
    }
    shares = kern.group_by("family").agg(pl.col("dur").sum())
    by_family = dict(zip(shares["family"].to_list(), shares["dur"].to_list(), strict=True))
    for fam in FAMILY_NAMES:
        out[f"{fam}_time_frac"] = by_family.get(fam, 0) / total if total else 0.0
    return out


def _optimizer_kernels(trace: Trace, kern: pl.DataFrame) -> int | None:
    """Kernels of the window launched inside an optimizer NVTX range: a per-tensor optimizer
    step shows as many small elementwise kernels, which only the range identifies."""
    ranges = trace.nvtx.filter(pl.col("text").str.contains(OPTIMIZER_NVTX)).with_columns(
        opt=pl.lit(True)
    )
    if ranges.is_empty():
        return None
    return len(kern.join(trace.calls_in(ranges, "opt"), on="correlation_id"))


def _gemm_measures(kern: pl.DataFrame, gpu: dict | None) -> dict[str, float | None]:
    """FP8 share of GEMM time (FP8 already in use?) and small-grid share of GEMM time (many
    tiny per-expert GEMMs that a grouped GEMM would batch)."""
    gemm = kern.filter(pl.col("family") == "gemm").with_columns(dur=pl.col("end") - pl.col("start"))
    total = int(gemm["dur"].sum())
    sm_count = (gpu or {}).get("sm_count")
    if not total:
        return {"fp8_gemm_frac": None, "small_grid_gemm_frac": None}
    fp8 = int(gemm.filter(pl.col("name").cast(pl.String).str.contains(FP8_GEMM))["dur"].sum())
    small = int(gemm.filter(pl.col("grid_blocks") < sm_count)["dur"].sum()) if sm_count else None
    return {
        "fp8_gemm_frac": fp8 / total,
        "small_grid_gemm_frac": small / total if small is not None else None,
    }


def _recompute_frac(trace: Trace, kern: pl.DataFrame) -> float | None:
    """Forward GEMM/attention kernels seen again in backward: a full-recompute signature.
    Without recompute, backward runs different GEMMs (dgrad/wgrad shapes and layouts)."""
    phases = trace.nvtx.with_columns(
        phase=pl.when(pl.col("text").str.contains(FORWARD_NVTX))
        .then(pl.lit("fwd"))
        .when(pl.col("text").str.contains(BACKWARD_NVTX))
        .then(pl.lit("bwd"))
    ).filter(pl.col("phase").is_not_null())
    if (
        phases.filter(pl.col("phase") == "fwd").is_empty()
        or phases.filter(pl.col("phase") == "bwd").is_empty()
    ):
        return None
    tagged = trace.calls_in(phases, "phase")
    heavy = kern.filter(pl.col("family").is_in(["gemm", "attention"])).join(
        tagged, on="correlation_id"
    )
    sig = ["name", "grid_blocks", "block_threads"]
    counts = (
        heavy.group_by([*sig, "phase"])
        .len()
        .pivot(on="phase", index=sig, values="len")
        .fill_null(0)
    )
    if "fwd" not in counts.columns or "bwd" not in counts.columns:
        return 0.0 if "fwd" in counts.columns else None
    forward = int(counts["fwd"].sum())
    if not forward:
        return None
    repeated = int(counts.select(pl.min_horizontal("fwd", "bwd")).to_series().sum())
    return repeated / forward


def _memory_measures(trace: Trace, gpu: dict | None) -> dict[str, float | None]:
    """Peak of allocated device memory (allocation events over the whole capture, since memory
    allocated during warm-up is still held in the steady state)."""
    mem = trace.memory
    capacity = (gpu or {}).get("memory_bytes")
    if mem.is_empty():
        return {"peak_memory_bytes": None, "peak_memory_frac": None}
    peak = (
        mem.sort("start")
        .with_columns(
            delta=pl.when(pl.col("op") == 0).then(pl.col("bytes")).otherwise(-pl.col("bytes"))
        )
        .with_columns(level=pl.col("delta").cum_sum().over("device_id"))["level"]
        .max()
    )
    peak = int(peak or 0)
    return {"peak_memory_bytes": peak, "peak_memory_frac": peak / capacity if capacity else None}


def _gpu_metric_means(metrics: pl.DataFrame, window: tuple[int, int]) -> dict[str, float | None]:
    inside = metrics.filter(pl.col("timestamp").is_between(*window))
    out: dict[str, float | None] = {}
    for key, name in METRICS_OF_INTEREST.items():
        values = inside.filter(pl.col("metric") == name)["value"]
        out[key] = float(values.mean()) / 100 if len(values) else None
    return out


def _top_kernels(kern: pl.DataFrame, wall: int, n: int = 10) -> list[dict]:
    if kern.is_empty():
        return []
    top = (
        kern.with_columns(dur=pl.col("end") - pl.col("start"))
        .group_by("short_name", "family")
        .agg(total_ns=pl.col("dur").sum(), count=pl.len(), median_ns=pl.col("dur").median())
        .sort("total_ns", descending=True)
        .head(n)
        .with_columns(frac=pl.col("total_ns") / wall)
    )
    return top.rename({"short_name": "name"}).to_dicts()


def _step_breakdown(tl: pl.DataFrame, steps: Steps) -> list[dict]:
    """Per steady step: ns of compute, exposed communication, exposed copies and idle."""
    steady = steps.steady
    if steady.is_empty():
        return []
    c, k, p = pl.col("compute") > 0, pl.col("comm") > 0, pl.col("copy") > 0
    seg = (
        tl.with_columns(
            state=pl.when(c)
            .then(pl.lit("compute"))
            .when(k)
            .then(pl.lit("exposed_comm"))
            .when(p)
            .then(pl.lit("copy"))
            .otherwise(pl.lit("idle")),
            comm_ns=pl.when(k).then(pl.col("dur")).otherwise(0),
        )
        .sort("start")
        .join_asof(
            steady.select("index", step_start="gpu_start").sort("step_start"),
            left_on="start",
            right_on="step_start",
            strategy="backward",
        )
        .filter(pl.col("index").is_not_null())
    )
    per = (
        seg.group_by("index", "step_start")
        .agg(
            *(
                pl.col("dur").filter(pl.col("state") == s).sum().alias(s)
                for s in ("compute", "exposed_comm", "copy", "idle")
            ),
            comm_total=pl.col("comm_ns").sum(),
        )
        .sort("index")
    )
    return per.to_dicts()


GAP_BINS_NS = [1_000 * 10 ** (i / 2) for i in range(15)]  # 1 µs .. 10 s, half-decade steps


def _gap_histogram(gaps: pl.DataFrame) -> dict[str, list]:
    """Count and total time of idle gaps per cause in log-spaced length bins
    (bin i holds gaps in [edges[i-1], edges[i]); bin 0 is below 1 µs)."""
    n_bins = len(GAP_BINS_NS) + 1
    binned = (
        gaps.with_columns(
            bin=pl.lit(pl.Series(GAP_BINS_NS)).search_sorted(pl.col("dur"), side="right")
        )
        .group_by("cause", "bin")
        .agg(count=pl.len(), time=pl.col("dur").sum())
    )
    out: dict[str, list] = {"edges_ns": GAP_BINS_NS}
    for cause in ("launch", "sync", "input", "other"):
        rows = binned.filter(pl.col("cause") == cause)
        counts, time = [0] * n_bins, [0] * n_bins
        for b, c, t in rows.select("bin", "count", "time").iter_rows():  # <= 16 rows
            counts[b], time[b] = int(c), int(t)
        out[cause] = counts
        out[f"{cause}_ns"] = time
    return out


def _metric_series(
    metrics: pl.DataFrame, window: tuple[int, int], points: int = 400
) -> dict[str, list]:
    inside = metrics.filter(
        pl.col("timestamp").is_between(*window)
        & pl.col("metric").is_in(list(METRICS_OF_INTEREST.values()))
    )
    if inside.is_empty():
        return {}
    width = max((window[1] - window[0]) // points, 1)
    binned = (
        inside.with_columns(bin=((pl.col("timestamp") - window[0]) // width))
        .group_by("metric", "bin")
        .agg(pl.col("value").mean())
        .sort("bin")
    )
    out: dict[str, list] = {}
    for (metric,), rows in binned.group_by(["metric"]):
        out[str(metric)] = [
            [int(b * width), round(float(v), 2)]
            for b, v in zip(rows["bin"], rows["value"], strict=True)
        ]
    return out


def _ms(ns: float | None) -> float | None:
    return float(ns) / 1e6 if ns is not None else None


def _cv(durations: pl.Series) -> float | None:
    if len(durations) < 2:
        return None
    return float(durations.std()) / float(durations.mean())


def _round(v):
    return round(v, 6) if isinstance(v, float) else v
