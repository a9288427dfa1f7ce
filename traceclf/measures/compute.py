"""The compute wall: the kernel mix of the step (families, sizes, grids, occupancy), CUDA
graphs, GEMM precision, the optimizer's kernels and what the GPU metrics say."""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.ingest.devices import METRIC_NAMES
from traceclf.measures import intervals
from traceclf.measures.intervals import Busy
from traceclf.measures.window import (
    RankWindow,
    optimizer_family,
    optimizer_ranges,
    optimizer_runs,
)
from traceclf.model.taxonomy import Taxonomy, matches, theoretical_occupancy

# Kernel families in the order the report lists their shares; a family a user's taxonomy adds
# is listed after them.
FAMILY_NAMES = (
    "gemm",
    "attention",
    "convolution",
    "elementwise",
    "reduction",
    "permute_moe",
    "optimizer",
    "communication",
    "other",
)
METRICS_OF_INTEREST = {f"{key}_mean": key for key in METRIC_NAMES}
CAPTURE_API = "^(cudaStreamBeginCapture|cuStreamBeginCapture)"
END_CAPTURE_API = "^(cudaStreamEndCapture|cuStreamEndCapture)"
# The warm-up burst before capture ends at a GPU pause longer than this many graph replays (an
# eager iteration runs a few times slower than its replay; setup pauses are far longer).
WARMUP_PAUSE_REPLAYS = 4
WARMUP_PAUSE_MIN_NS = 20_000_000
# (measures/window.py: prepare)
FAMILY_NOTES = {
    "optimizer": " (by name, launched inside an optimizer NVTX range, or inside an optimizer's "
    "run: between the first and last optimizer-named kernel of a stretch no GEMM, attention, "
    "convolution or communication kernel breaks, in one graph replay or on one stream)",
    "convolution": " (cuDNN, TensorRT and CUTLASS implicit-GEMM, Winograd, FFT and direct "
    "convolutions)",
}
MEASURES: dict[str, str] = {
    "kernels_per_step": "kernel rows per step (kernels inside graph-level traced graphs "
    "are not rows)",
    "graph_launches_per_step": "CUDA-graph executions per step (graph-level tracing)",
    "median_kernel_us": "median kernel duration",
    "small_grid_kernel_frac": "kernels whose grid has fewer blocks than the GPU has SMs",
    "theoretical_occupancy_mean": "kernel-time-weighted theoretical occupancy from launch "
    "config and TARGET_INFO_GPU limits",
    "graph_frac": "share of busy time inside CUDA-graph executions",
    "uses_cuda_graphs": "any CUDA-graph execution in the window",
    "kernel_stats_outside_window": "kernel shapes taken from eager kernels outside the window "
    "because graph-level tracing hides the replays' kernels (capture.kernel_mix_source says "
    "which: the eager warm-up right before graph capture)",
    "graph_internal_gap_frac": "node-level graph tracing: share of the graph replays' spans with "
    "no node kernel running (device-side gaps inside graphs; null without node tracing)",
    "gemm_kernels_per_step": "GEMM kernel launches per step",
    "small_gemm_repeats_per_step": "launches per step of the most repeated GEMM shape (name and "
    "grid) whose grid has fewer blocks than SMs: a loop over experts repeats one small GEMM",
    "optimizer_by_position_frac": "share of kernel time in kernels counted as the optimizer's "
    "only by where they run, inside an optimizer's run (not by name, nor by an optimizer NVTX "
    "range): part of optimizer_time_frac, a premise to check",
    "optimizer_pass_frac": "share of kernel time in the optimizer's longest pass over every "
    "parameter: the multi-tensor optimizer kernels of one name (a foreach op, taxonomy "
    "training.optimizer_pass), summed; a fused optimizer still makes at least such a pass, so "
    "it is not part of what fusing the optimizer saves (0 without multi-tensor kernels)",
    "optimizer_kernels_per_step": "optimizer kernels per step (by name, launched inside an "
    "optimizer NVTX range, or inside an optimizer's run; graph-level tracing: the eager "
    "iteration's): dozens mean a per-tensor, unfused optimizer (null when neither an optimizer "
    "NVTX range nor an optimizer kernel shows)",
    "fp8_gemm_frac": "share of GEMM time in FP8 GEMM kernels (e4m3/e5m2/fp8/mxfp8 in the name)",
    "small_grid_gemm_frac": "share of GEMM time in GEMMs whose grid has fewer blocks than SMs",
    "small_grid_gemm_ms": "ms per step in GEMMs whose grid has fewer blocks than SMs (graph-level "
    "tracing: the eager iteration's, per replay)",
    "small_grid_gemm_fill": "the SMs those GEMMs fill: time-weighted mean of grid blocks / SMs "
    "(what a grouped GEMM over all of them would leave idle is 1 minus this)",
    "fusable_chain_ms": "ms per step a fusion of elementwise/normalisation kernel chains can "
    "remove: per stream, each run of 2 or more consecutive elementwise or reduction kernels "
    "(outside the optimizer) counts its time less its longest kernel, the one pass a fused "
    "kernel keeps (graph-level tracing: the eager iteration's, per replay)",
    "sm_active_mean": "mean 'SMs Active' GPU metric in the window (0-1)",
    "sm_issue_mean": "mean 'SM Issue' GPU metric in the window (0-1)",
    "tensor_active_mean": "mean 'Tensor Active' GPU metric in the window (0-1)",
} | {
    f"{fam}_time_frac": f"share of kernel time in {fam} kernels{FAMILY_NOTES.get(fam, '')}"
    for fam in FAMILY_NAMES
}
KERNEL_SHAPE_MEASURES = (
    "median_kernel_us",
    "small_grid_kernel_frac",
    "theoretical_occupancy_mean",
    "optimizer_by_position_frac",
    "optimizer_pass_frac",
    *(f"{fam}_time_frac" for fam in FAMILY_NAMES),
)


def kernel_mix(w: RankWindow) -> tuple[dict[str, float | bool | None], str]:
    """Kernel counts, shapes and family shares of the window, its CUDA-graph use, and where
    the kernel mix came from (the capture block's ``kernel_mix_source``).

    Graph-level tracing hides the kernels of the replays; the same kernels ran eagerly in the
    warm-up iterations right before the graph was captured, so those stand in for the mix of
    the steady state — never initialisation kernels, never kernels between replays."""
    busy = w.state["busy"]
    out = _kernel_measures(w.kern, w, busy)
    hidden = graph_share_hidden(w.graphs, busy)
    shape_kernels, per_step, source = w.kern, float(w.n_steps), "window"
    if hidden:
        shape_kernels, per_step, source = warmup_kernels(w)
        shape = _kernel_measures(shape_kernels, w, busy)
        out |= {k: shape[k] for k in KERNEL_SHAPE_MEASURES}
    out["kernel_stats_outside_window"] = hidden
    out["graph_internal_gap_frac"] = graph_internal_gap_frac(w)
    out |= _gemm_measures(shape_kernels, w, per_step)
    out["fusable_chain_ms"] = fusable_chain_ms(shape_kernels, per_step)
    out["optimizer_kernels_per_step"] = _optimizer_kernels(shape_kernels, w, per_step)
    return out, source


# Families whose consecutive kernels a fusion merges into one pass over memory.
CHAIN_FAMILIES = ("elementwise", "reduction")


def fusable_chain_ms(kern: pl.DataFrame, per_step: float) -> float:
    """ms per step that fusing chains of consecutive elementwise/normalisation kernels can
    remove (per stream, in start order; any other kernel, or one of the optimizer, ends a
    chain). A fused kernel still reads the chain's inputs and writes its outputs: at least the
    traffic of the chain's longest member, so each chain of two or more keeps that one and
    loses the rest: sum - max."""
    if kern.is_empty():
        return 0.0
    optimizer = pl.col("in_optimizer") if "in_optimizer" in kern.columns else pl.lit(False)
    link = pl.col("family").is_in(CHAIN_FAMILIES) & ~optimizer
    chains = kern.select("stream_id", "start", link=link, dur=pl.col("end") - pl.col("start"))
    # per stream in start order: the kernels are in start order already, and a stable sort by
    # stream alone keeps it (a sort by both keys of millions of rows cost 4x as much)
    chains = (
        chains.sort("stream_id", maintain_order=True)
        if chains["start"].is_sorted()
        else chains.sort("stream_id", "start", maintain_order=True)
    )
    # the chain members, in that order
    at = np.flatnonzero(chains["link"].fill_null(False).to_numpy())
    if not len(at):
        return 0.0
    stream, dur = chains["stream_id"].to_numpy()[at], chains["dur"].to_numpy()[at]
    # a chain begins where the member before is not the row before, or on another stream;
    # each keeps its longest member and loses the rest (a lone member loses nothing): the
    # chains as runs of consecutive members, not groups (millions of them)
    begins = np.flatnonzero(np.r_[True, (np.diff(at) != 1) | (stream[1:] != stream[:-1])])
    removable = int(dur.sum()) - int(np.maximum.reduceat(dur, begins).sum())
    return removable / 1e6 / per_step


def warmup_kernels(w: RankWindow) -> tuple[pl.DataFrame, float, str]:
    """The eager kernels of the warm-up iterations right before the first graph capture: the
    contiguous burst of GPU work (split at a pause longer than ``WARMUP_PAUSE_REPLAYS`` replays
    of the graph, at least 20 ms) launched before ``cudaStreamBeginCapture``. Returns the
    kernels, the number of iterations they hold and a description. One iteration is as many
    kernels as launches were recorded into the graph (the calls between
    ``cudaStreamBeginCapture`` and ``cudaStreamEndCapture``): a longer burst is cut to its last
    iteration, a shorter one is that fraction of an iteration. Without a capture in the trace,
    iterations = the burst's GPU span over one replay (eager runs slower: counts come out low)."""
    trace = w.trace
    capture = trace.api.filter(matches(trace.api["name"], CAPTURE_API))
    replay_ns = float(w.graph_spans.select((pl.col("end") - pl.col("start")).median()).item() or 0)
    launched = trace.kernels.with_columns(api_start=trace.launch_starts(trace.kernels))
    if capture.is_empty():
        before = launched.filter(pl.col("end") <= w.window[0])
        what = "eager kernels before the first graph replay"
    else:
        before = launched.filter(pl.col("api_start") < int(capture["start"].min()))
        what = "the eager warm-up right before graph capture"
    before = before.sort("start")
    if before.is_empty():
        return w.kern.clear(), 1.0, "unknown (graph replays hide every kernel)"
    pause = max(WARMUP_PAUSE_REPLAYS * replay_ns, WARMUP_PAUSE_MIN_NS)
    gaps = before["start"] - before["end"].cum_max().shift(1)
    breaks = before.filter(gaps > pause)["start"]
    burst = before.filter(pl.col("start") >= (breaks[-1] if len(breaks) else before["start"][0]))
    per_replay = _captured_launches(w, capture)
    if per_replay and len(burst) > per_replay:
        burst, iterations = burst.tail(per_replay), 1.0  # the last iteration before capture
    elif per_replay:
        iterations = len(burst) / per_replay  # a fraction of one replay
    else:
        span = int(burst["end"].max() - burst["start"].min())
        iterations = max(span / replay_ns, 1.0) if replay_ns else 1.0
    kern = optimizer_family(optimizer_runs(w.taxonomy.classify(burst.drop("api_start"))))
    return kern, iterations, f"{what} ({len(kern)} kernels)"


def _captured_launches(w: RankWindow, capture: pl.DataFrame) -> int:
    """Kernel launches recorded into the first captured graph: launch calls of the process
    (any thread: the autograd thread launches the backward pass) between the capturing
    thread's cudaStreamBeginCapture and its next cudaStreamEndCapture."""
    if capture.is_empty():
        return 0
    api = w.trace.api
    first = capture.sort("start").row(0, named=True)
    ends = api.filter(matches(api["name"], END_CAPTURE_API)).filter(
        (pl.col("global_tid") == first["global_tid"]) & (pl.col("start") > first["start"])
    )
    if ends.is_empty():
        return 0
    end = int(ends["start"].min())
    recorded = api.filter(pl.col("start").is_between(first["start"], end))  # (the few first)
    return len(recorded.filter(w.taxonomy.is_api("launch") & ~w.taxonomy.is_api("graph_launch")))


def graph_internal_gap_frac(w: RankWindow) -> float | None:
    """With node-level tracing, the time inside graph replays when no node kernel runs."""
    nodes = w.kern.filter(pl.col("graph_node_id").is_not_null())
    if nodes.is_empty():
        return None
    per = (
        nodes.sort("correlation_id", "start")
        .with_columns(reach=pl.col("end").cum_max().shift(1).over("correlation_id"))
        .group_by("correlation_id")
        .agg(
            span=pl.col("end").max() - pl.col("start").min(),
            gaps=(pl.col("start") - pl.col("reach")).clip(lower_bound=0).sum(),
        )
    )
    span = int(per["span"].sum())
    return int(per["gaps"].sum()) / span if span else None


def graph_share_hidden(graphs: pl.DataFrame, busy: int) -> bool:
    """True when graph-level traced replays (kernels not in the kernel table) are most of the
    GPU's busy time, so the window's kernel rows do not show what the GPU ran."""
    return busy > 0 and intervals.total(graphs) > busy / 2


def _kernel_measures(
    kern: pl.DataFrame, w: RankWindow, busy: int
) -> dict[str, float | bool | None]:
    gpu = w.gpu
    sm_count = (gpu or {}).get("sm_count")
    positioned = "optimizer_by_position" in kern.columns
    one_pass = _optimizer_pass_ns(kern, w.taxonomy)
    kern = kern.select(  # (only what is read here: no frame of every column)
        "family",
        "grid_blocks",
        dur=pl.col("end") - pl.col("start"),
        occ=theoretical_occupancy(gpu),
        by_position=pl.col("optimizer_by_position") if positioned else pl.lit(False),
    )
    total = int(kern["dur"].sum())
    # (busy time inside replays: with node-level tracing the gaps between nodes are idle)
    graph_time = w.layers.work.overlap(Busy.of(w.graph_spans))
    out: dict[str, float | bool | None] = {
        "kernels_per_step": len(kern) / w.n_steps,
        "graph_launches_per_step": len(w.graphs) / w.n_steps if len(w.graphs) else 0.0,
        "median_kernel_us": float(kern["dur"].median()) / 1e3 if len(kern) else None,
        "small_grid_kernel_frac": (
            float((kern["grid_blocks"] < sm_count).mean()) if sm_count and len(kern) else None
        ),
        "theoretical_occupancy_mean": (
            float(
                (kern["occ"] * kern["dur"]).sum()
                / kern["dur"].filter(kern["occ"].is_not_null()).sum()
            )
            if len(kern) and kern["occ"].null_count() < len(kern) and total
            else None
        ),
        "graph_frac": graph_time / busy if busy else 0.0,
        "uses_cuda_graphs": bool(len(w.graph_spans)),
    }
    shares = kern.group_by("family").agg(pl.col("dur").sum())
    by_family = dict(zip(shares["family"].to_list(), shares["dur"].to_list(), strict=True))
    for fam in families(w.taxonomy):
        out[f"{fam}_time_frac"] = by_family.get(fam, 0) / total if total else 0.0
    placed = int(kern["dur"].filter(kern["by_position"]).sum())
    out["optimizer_by_position_frac"] = placed / total if total else 0.0
    out["optimizer_pass_frac"] = one_pass / total if total else 0.0
    return out


def _optimizer_pass_ns(kern: pl.DataFrame, taxonomy: Taxonomy) -> int:
    """ns of the optimizer's longest pass over every parameter: its multi-tensor kernels
    (taxonomy ``training.optimizer_pass``) of one name, summed (a foreach op launches one such
    kernel per chunk of its tensor lists; two ops of one name count as one pass: an Adam's
    two moment updates of one name move fewer bytes than its fused pass over parameters,
    gradients and both moments)."""
    optimizer = kern.filter(pl.col("family") == "optimizer")
    if optimizer.is_empty():
        return 0
    per_name = optimizer.group_by("name").agg(ns=(pl.col("end") - pl.col("start")).sum())
    names = per_name["name"].cast(pl.String)
    passes = per_name.filter(matches(names, taxonomy.training["optimizer_pass"]))
    return int(passes["ns"].max() or 0)


def families(taxonomy: Taxonomy) -> tuple[str, ...]:
    """The report's families, then any that the taxonomy adds."""
    extra = [p.family for p in taxonomy.families if p.family not in FAMILY_NAMES]
    return (*FAMILY_NAMES, *dict.fromkeys(extra))


GEMM_SHARES = (
    "fp8_gemm_frac",
    "small_grid_gemm_frac",
    "small_grid_gemm_ms",
    "small_grid_gemm_fill",
)


def _gemm_measures(kern: pl.DataFrame, w: RankWindow, per_step: float) -> dict[str, float | None]:
    """FP8 share of GEMM time (FP8 already in use?), small-grid share of GEMM time, and how
    often one small GEMM shape repeats per step (many tiny per-expert GEMMs that a grouped GEMM
    would batch, rather than a few already-batched ones)."""
    gemm = kern.select(  # (only the columns read here: no copy of every column's GEMM rows)
        "name", "grid_blocks", dur=pl.col("end") - pl.col("start")
    ).filter(kern["family"] == "gemm")
    total = int(gemm["dur"].sum())
    sm_count = (w.gpu or {}).get("sm_count")
    small_gemms = gemm.filter(pl.col("grid_blocks") < sm_count) if sm_count else gemm.clear()
    repeats = small_gemms.group_by("name", "grid_blocks").len()["len"].max()
    counts = {
        "gemm_kernels_per_step": len(gemm) / per_step,
        "small_gemm_repeats_per_step": (repeats or 0) / per_step if sm_count else None,
    }
    if not total:
        return dict.fromkeys(GEMM_SHARES) | counts
    fp8 = int(gemm.filter(matches(gemm["name"], w.taxonomy.fp8_gemm))["dur"].sum())
    if not sm_count:
        return dict.fromkeys(GEMM_SHARES) | {"fp8_gemm_frac": fp8 / total} | counts
    small = int(small_gemms["dur"].sum())
    # (a small grid fills grid/SMs of the GPU; weighted by time, as the idle SMs cost time)
    fill = (
        (small_gemms["grid_blocks"] / sm_count * small_gemms["dur"]).sum() / small
        if small
        else None
    )
    return {
        "fp8_gemm_frac": fp8 / total,
        "small_grid_gemm_frac": small / total,
        "small_grid_gemm_ms": small / 1e6 / per_step,
        "small_grid_gemm_fill": float(fill) if fill is not None else None,
    } | counts


def _optimizer_kernels(kern: pl.DataFrame, w: RankWindow, per_step: float) -> float | None:
    """Optimizer kernels per step (by name, launched inside an optimizer NVTX range, or inside
    an optimizer's run: measures/window.py), from the kernels the mix comes from: a per-tensor
    optimizer step shows as dozens of small kernels. Null when neither an optimizer NVTX range
    nor an optimizer kernel shows: nothing says whether there is an optimizer."""
    n = int((kern["family"] == "optimizer").sum()) if len(kern) else 0
    if not n and optimizer_ranges(w.trace, w.taxonomy).is_empty():
        return None
    return n / per_step if per_step else None


def gpu_metric_means(metrics: pl.DataFrame, window: intervals.Spans) -> dict[str, float | None]:
    inside = metrics.filter(intervals.inside("timestamp", window))
    out: dict[str, float | None] = {}
    for key, name in METRICS_OF_INTEREST.items():
        values = inside.filter(pl.col("metric") == name)["value"]
        out[key] = float(values.mean()) / 100 if len(values) else None
    return out


def top_kernels(w: RankWindow, n: int = 10) -> list[dict]:
    """The ``n`` kernels (by short name and family) with the most kernel time in the window:
    their time summed, count, median, and ``frac``: the share of the window in which one of
    them runs (their union: instances running at once on several streams, as collectives of
    several communicators do, count once; their sum passed 100%)."""
    keys = ["short_name", "family"]
    # (the four columns read here: millions of kernels, every column copied by the join below;
    # in start order, as the window's kernels are, for the union below)
    kern = w.kern.select(*keys, "start", "end")
    if kern.is_empty():
        return []
    if not kern["start"].is_sorted():
        kern = kern.sort("start", maintain_order=True)
    top = (
        kern.with_columns(dur=pl.col("end") - pl.col("start"))
        .group_by(keys)
        .agg(total_ns=pl.col("dur").sum(), count=pl.len(), median_ns=pl.col("dur").median())
        # (equal totals by name: the groups come in no set order, and the report would not
        # read the same twice)
        .sort(
            "total_ns",
            pl.col("short_name").cast(pl.String),
            pl.col("family").cast(pl.String),
            descending=[True, False, False],
        )
        .head(n)
    )
    # each instance covers what it runs past the furthest end of the same kernel's instances
    # started before it (a group's rows in the frame's order, kept by the join: by start)
    reach = pl.col("end").cum_max().shift(1)
    union = (
        kern.join(top.select(keys), on=keys, how="semi", maintain_order="left")
        .group_by(keys)
        .agg(union_ns=(pl.col("end") - pl.max_horizontal("start", reach)).clip(lower_bound=0).sum())
    )
    top = top.join(union, on=keys, how="left", maintain_order="left")
    return (
        top.with_columns(frac=pl.col("union_ns") / w.wall)
        .drop("union_ns")
        .rename({"short_name": "name"})
        .to_dicts()
    )


KERNEL_SUMMARY_ROWS = 500


def kernel_summary(w: RankWindow) -> list[dict]:
    """Kernels that start in the window by full name, as NVIDIA's ``cuda_gpu_kern_sum``:
    share of kernel time, total, instances, mean, median, min, max and sample standard deviation
    (ns, durations not clipped to the window); the KERNEL_SUMMARY_ROWS longest in total."""
    lo, hi = w.window
    kern = w.trace.kernels.select("name", "short_name", "start", "end").filter(
        pl.col("start").is_between(lo, hi, closed="left")
    )
    if kern.is_empty():
        return []
    summary = (
        kern.select("name", "short_name", dur=pl.col("end") - pl.col("start"))
        .group_by("name")  # (by the Categorical's codes: strings only for the few names)
        .agg(
            short_name=pl.col("short_name").first(),
            total_ns=pl.col("dur").sum(),
            instances=pl.len(),
            avg_ns=pl.col("dur").mean(),
            med_ns=pl.col("dur").median(),
            min_ns=pl.col("dur").min(),
            max_ns=pl.col("dur").max(),
            stddev_ns=pl.col("dur").std().fill_null(0.0),
        )
        .with_columns(
            pl.col("name", "short_name").cast(pl.String),
            # (kernels of zero length, as a damaged export may hold: no share, not NaN)
            time_frac=pl.when(pl.col("total_ns").sum() > 0)
            .then(pl.col("total_ns") / pl.col("total_ns").sum())
            .otherwise(0.0),
        )
        .sort(["total_ns", "name"], descending=[True, False])
        .head(KERNEL_SUMMARY_ROWS)
    )
    summary = w.taxonomy.classify(summary)
    cols = ["name", "short_name", "family", "time_frac", "total_ns", "instances"]
    cols += ["avg_ns", "med_ns", "min_ns", "max_ns", "stddev_ns"]
    return [
        {
            k: (round(v, 6 if k == "time_frac" else 1) if isinstance(v, float) else v)
            for k, v in r.items()
        }
        for r in summary.select(cols).to_dicts()
    ]
