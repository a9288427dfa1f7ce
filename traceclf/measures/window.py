"""One rank's steady-state window, prepared once for every wall's measures: the event frames
clipped to the window and classified with the taxonomy, and the state timeline (how many
compute, communication, copy and profiler intervals are active in each segment)."""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from traceclf.kernels import Taxonomy, by_name
from traceclf.measures import timeline
from traceclf.model import Trace
from traceclf.steps import Steps


@dataclass(frozen=True)
class RankWindow:
    trace: Trace
    steps: Steps
    taxonomy: Taxonomy
    gpu: dict | None
    kern: pl.DataFrame  # kernels in the window, with family / is_comm / comm_kind columns
    graphs: pl.DataFrame  # graph-level traced graph executions
    graph_spans: pl.DataFrame  # one interval per graph replay, either tracing mode
    copies: pl.DataFrame
    api: pl.DataFrame  # CUDA calls with is_sync / is_launch / is_alloc flags
    compute: pl.DataFrame  # intervals of compute kernels and graph replays
    comm: pl.DataFrame  # intervals of communication kernels
    timeline: pl.DataFrame  # segments with counts per layer (timeline.timeline)
    state: dict[str, int]  # ns of the window in each state (state_times)

    @property
    def window(self) -> tuple[int, int]:
        """The hull of the window (first to last analysed ns)."""
        return self.steps.window

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The window itself: one span, or the runs of analysed steps in window mode."""
        return self.steps.spans

    @property
    def wall(self) -> int:
        """ns of the window (its spans only): the denominator of every ``*_frac``."""
        return self.steps.wall

    @property
    def n_steps(self) -> int:
        """Steady steps the window covers: the denominator of every ``*_per_step``."""
        return max(self.steps.analysed, 1)

    @property
    def host_traced(self) -> bool:
        """Whether CUDA API rows exist at all: without them host-side counts are unknown."""
        return not self.trace.api.is_empty()


def prepare(trace: Trace, steps: Steps, gpu: dict | None, taxonomy: Taxonomy) -> RankWindow:
    window = steps.spans
    kern = taxonomy.classify(timeline.clip(trace.kernels, window))
    graphs = timeline.clip(trace.graphs, window)
    graph_spans = timeline.clip(trace.graph_executions, window)
    copies = timeline.clip(trace.copies, window)
    api = classify_api(
        timeline.clip(trace.api.select("start", "end", "name", "correlation_id"), window), taxonomy
    )
    compute = pl.concat(
        [kern.filter(~pl.col("is_comm")).select("start", "end"), graph_spans.select("start", "end")]
    )
    comm = kern.filter(pl.col("is_comm")).select("start", "end")
    step_starts = steps.steady["gpu_start"].to_list() if steps.count else []
    # Profiler overhead (CUPTI buffer flushes, ...) is a layer of its own: not GPU work, but
    # idle time it covers is the profiler's, not the training loop's.
    tl = timeline.timeline(
        {"compute": compute, "comm": comm, "copy": copies, "profiler": trace.overhead},
        window,
        cuts=step_starts,
    )
    return RankWindow(
        trace,
        steps,
        taxonomy,
        gpu,
        kern,
        graphs,
        graph_spans,
        copies,
        api,
        compute,
        comm,
        tl,
        state_times(tl),
    )


def state_times(tl: pl.DataFrame) -> dict[str, int]:
    """ns of the window in each state of the timeline (busy, compute, exposed comm, ...)."""
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


def classify_api(api: pl.DataFrame, taxonomy: Taxonomy) -> pl.DataFrame:
    """Flag sync, launch and allocation calls (regexes once per distinct API name)."""
    names = (
        api.select("name")
        .unique()
        .with_columns(
            is_sync=taxonomy.is_api("sync"),
            is_launch=taxonomy.is_api("launch"),
            is_alloc=taxonomy.is_api("alloc"),
        )
    )
    return by_name(api, names)
