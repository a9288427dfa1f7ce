"""What one export's map step hands to the cross-rank stage (the reduce, the judge): small,
frozen, picklable records, cached as JSON (:mod:`traceclf.ingest.results`) and read back,
checked against these types, without polars or the measures, so that a cached re-analysis
stays light. Also the vocabulary both sides share (:data:`IDLE_CAUSES`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from traceclf.support.escape import path_text
from traceclf.support.records import from_json

if TYPE_CHECKING:
    from traceclf.steps.steady import Steps

# What the host was doing while the GPU idled (measures/host.py: idle_gaps), in the order every
# table and report lists them: the ``idle_<cause>_frac`` measures, the phase table's columns.
# ("graph": between the kernels of a node-traced CUDA-graph replay, which the host launched whole)
IDLE_CAUSES = ("launch", "sync", "input", "host", "graph", "other")


@dataclass(frozen=True)
class RankMeasures:
    """Measures of one rank, plus the small series the figures are drawn from (computed by
    :func:`traceclf.measures.measure_rank`)."""

    metrics: dict[str, float | int | bool | None]
    comm_by_kind: dict[str, dict] = field(default_factory=dict)
    top_kernels: list[dict] = field(default_factory=list)
    step_breakdown: list[dict] = field(default_factory=list)
    idle_gaps: dict[str, list] = field(default_factory=dict)
    longest_gaps: list[dict] = field(default_factory=list)  # one by one (measures/host.py)
    gpu_metrics_series: dict[str, list] = field(default_factory=dict)
    idle_nvtx: list[dict] = field(default_factory=list)
    capture: dict = field(default_factory=dict)
    step_budget: list[dict] = field(default_factory=list)  # ms per step (critical_path)
    collectives: dict[str, list] = field(default_factory=dict)  # for the cross-rank reduce
    phases: list[dict] = field(default_factory=list)  # NVTX phase table (measures/phases.py)
    step_lanes: dict = field(default_factory=dict)  # one representative step, for its figure
    memory_series: dict = field(default_factory=dict)  # allocated device memory over time
    kernel_summary: list[dict] = field(default_factory=list)  # like nsys cuda_gpu_kern_sum
    # per kernel time per step and the step's account, for compare (measures/step_kernels.py)
    step_kernels: dict = field(default_factory=dict)
    # where the GPU's idle time went on the host, by source (measures/hostsources.py)
    host_attribution: list[dict] = field(default_factory=list)
    # per communicator: kinds, calls, bytes, exposed and blocking time (measures/communicators.py)
    comm_groups: list[dict] = field(default_factory=list)
    # kernel shapes slower beside communication (measures/overlap_tax.py)
    overlap_tax: list[dict] = field(default_factory=list)
    # the states of the window before each collective, for the late-arrival walk
    # (measures/arrivals.py)
    arrivals: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepSummary:
    """One rank's steps as its report shows them (``ranks[].steps``, in this order)."""

    source: str  # "nvtx" | "graph" | "pattern" | "none"
    label: str
    count: int
    used: int  # steady-state steps
    analysed: int  # of "used": fewer when a long capture is sampled
    mean_ms: float | None
    median_ms: float | None
    cv: float | None
    window_ns: list[int]  # the steady-state window [start, end)
    durations_ms: list[float]
    steady: list[bool]
    outliers: int
    worst: dict | None  # the slowest steady step (steps/steady.py: slowest_step)
    second_anchor: dict | None  # a second anchor's step time (steps/find.py: cross_check)

    @classmethod
    def of(cls, steps: Steps) -> StepSummary:
        from traceclf.steps.steady import slowest_step  # (not at import: a cached report
        # is read back without polars)

        durations = steps.durations()
        return cls(
            source=steps.source,
            label=steps.label,
            count=steps.count,
            used=steps.used,
            analysed=steps.analysed,
            mean_ms=float(durations.mean()) / 1e6 if len(durations) else None,
            median_ms=float(durations.median()) / 1e6 if len(durations) else None,
            cv=float(durations.std()) / float(durations.mean()) if len(durations) > 1 else None,
            window_ns=list(steps.window),
            durations_ms=[round(d / 1e6, 4) for d in steps.table["duration"].to_list()],
            steady=steps.table["steady"].to_list(),
            outliers=int(steps.steady["outlier"].sum()) if steps.count else 0,
            worst=slowest_step(steps),
            second_anchor=steps.second,
        )


@dataclass(frozen=True)
class Placement:
    """Which GPU a rank ran on: ranks with equal ``key`` ran on one GPU when ``mapped`` (the
    export maps their CUDA device to a physical GPU, whose UUID names it across files)."""

    device: int | None
    mapped: bool
    key: str


@dataclass(frozen=True)
class Clock:
    """What puts a rank on a common clock with the ranks of other exports."""

    utc_offset_ns: int | None  # add to a timestamp for UTC ns (null: no session start time)
    host: str | None
    export: str


@dataclass(frozen=True)
class RankResult:
    """Everything the report needs about one rank."""

    pid: int
    process_name: str | None
    path: str
    gpu: dict | None  # the GPU's TARGET_INFO_GPU row (Trace.gpu_of)
    steps: StepSummary
    measures: RankMeasures
    placement: Placement
    clock: Clock


@dataclass(frozen=True)
class ExportResult:
    """One export's analysis: its ranks, and what ties it to the other exports of a job."""

    path: str
    nsys_version: str | None
    schema_version: str | None
    ranks: tuple[RankResult, ...]
    gpu_count: int = 0  # GPUs the export describes (TARGET_INFO_GPU rows)
    # Capture identity (ingest/session.py) plus the span of GPU work in session time (ns).
    job: dict = field(default_factory=dict)
    # rows left out as unusable (Trace.unusable_rows): among the rows read
    unusable_rows: dict[str, int] = field(default_factory=dict)
    # strings that were not UTF-8, repaired (Trace.repaired_strings), by "TABLE.column"
    repaired_strings: dict[str, int] = field(default_factory=dict)
    # one process of a multi-process export split off as a run of its own (grouping.py)
    part: str | None = None

    def to_dict(self) -> dict:
        """The result as :func:`dataclasses.asdict` gives it, except that the dicts and lists
        the records hold are shared, not deep-copied nor searched for records (read it, do
        not change it): they are JSON values already, and an ``--all-steps`` result holds
        millions of them, which ``asdict`` copied one by one (most of a multi-rank
        ``--all-steps`` analysis)."""
        return _plain(self)

    def named(self, path: Path) -> ExportResult:
        """The same result under the path the user gave this time (a cache hit may have been
        written under another spelling of it), as text the report can hold
        (:func:`traceclf.support.escape.path_text`)."""
        name = path_text(path)
        ranks = tuple(replace(rank, path=name) for rank in self.ranks)
        return replace(self, path=name, ranks=ranks)

    @classmethod
    def from_dict(cls, data: dict) -> ExportResult:
        """Rebuild a result saved with :meth:`to_dict`; ValueError when it has another shape
        (a cache written by another version, or damaged) or no rank."""
        result = from_json(cls, data)
        if not result.ranks:
            raise ValueError("cached result has no rank")
        return result


def _plain(value: object) -> object:
    """``value`` with every record in it (a dataclass, or a tuple of them) a dict of its
    fields; the records' other values as they are."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value
