"""What one export's map step hands to the cross-rank stage (the reduce, the judge): small,
picklable results, cached as JSON (:mod:`traceclf.ingest.results`) and read back without
polars or the measures, so that a cached re-analysis stays light."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RankMeasures:
    """Measures of one rank, plus the small series the figures are drawn from (computed by
    :func:`traceclf.measures.measure_rank`)."""

    metrics: dict[str, float | int | bool | None]
    comm_by_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    top_kernels: list[dict] = field(default_factory=list)
    step_breakdown: list[dict] = field(default_factory=list)
    idle_gaps: dict[str, list] = field(default_factory=dict)
    gpu_metrics_series: dict[str, list] = field(default_factory=dict)
    idle_nvtx: list[dict] = field(default_factory=list)
    capture: dict = field(default_factory=dict)
    step_budget: list[dict] = field(default_factory=list)  # ms per step (critical_path)
    collectives: dict[str, list] = field(default_factory=dict)  # for the cross-rank reduce
    phases: list[dict] = field(default_factory=list)  # NVTX phase table (measures/phases.py)
    step_lanes: dict = field(default_factory=dict)  # one representative step, for its figure
    memory_series: dict = field(default_factory=dict)  # allocated device memory over time
    kernel_summary: list[dict] = field(default_factory=list)  # like nsys cuda_gpu_kern_sum


@dataclass
class RankResult:
    """Everything the report needs about one rank; small and picklable."""

    pid: int
    process_name: str | None
    path: str
    gpu: dict | None
    steps: dict
    measures: RankMeasures
    # which GPU: device ordinal, whether the export maps it to a physical GPU, and a key that
    # is equal for two ranks on one GPU (judge/capture.py: gpu_assignment)
    placement: dict = field(default_factory=dict)
    # utc_offset_ns, host, export, gpu (physical GPU identity): to align and compare ranks
    clock: dict = field(default_factory=dict)


@dataclass
class ExportResult:
    path: str
    nsys_version: str | None
    schema_version: str | None
    ranks: list[RankResult] = field(default_factory=list)
    gpu_count: int = 0  # GPUs the export describes (TARGET_INFO_GPU rows)
    # Capture identity (ingest/session.py) plus the span of GPU work in session time (ns).
    job: dict = field(default_factory=dict)
    # rows left out as unusable (Trace.unusable_rows): among the rows read
    unusable_rows: dict[str, int] = field(default_factory=dict)
    # one process of a multi-process export split off as a run of its own (runs.py)
    part: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def named(self, path: Path) -> ExportResult:
        """The same result under the path the user gave this time (a cache hit may have been
        written under another spelling of it)."""
        self.path = str(path)
        for rank in self.ranks:
            rank.path = str(path)
        return self

    @classmethod
    def from_dict(cls, data: dict) -> ExportResult:
        """Rebuild a result saved with :meth:`to_dict`; ValueError when it has another shape
        (a cache written by another version, or damaged). Needs neither polars nor the
        measures: a cache hit stays light."""
        ranks = [
            RankResult(**(r | {"measures": RankMeasures(**r["measures"])})) for r in data["ranks"]
        ]
        result = cls(
            data["path"],
            data["nsys_version"],
            data["schema_version"],
            ranks,
            data["gpu_count"],
            data["job"],
            data["unusable_rows"],
        )
        if not _well_typed(result):
            raise ValueError("cached result has unexpected types")
        return result


def _well_typed(result: ExportResult) -> bool:
    """The types build_report relies on (a cached result is read back from disk)."""
    strs = (result.path, result.nsys_version, result.schema_version)
    if not all(v is None or isinstance(v, str) for v in strs) or not result.ranks:
        return False
    if not isinstance(result.job, dict) or not isinstance(result.gpu_count, int):
        return False
    if not isinstance(result.unusable_rows, dict) or not all(
        isinstance(n, int) for n in result.unusable_rows.values()
    ):
        return False
    for r in result.ranks:
        m = r.measures
        ok = (
            isinstance(r.pid, int)
            and isinstance(r.path, str)
            and (r.process_name is None or isinstance(r.process_name, str))
            and (r.gpu is None or isinstance(r.gpu, dict))
            and isinstance(r.steps, dict)
            and isinstance(m.metrics, dict)
            and all(v is None or isinstance(v, (int, float, bool)) for v in m.metrics.values())
            and isinstance(m.comm_by_kind, dict)
            and all(isinstance(v, dict) for v in m.comm_by_kind.values())
            and isinstance(m.top_kernels, list)
            and isinstance(m.step_breakdown, list)
            and isinstance(m.idle_gaps, dict)
            and isinstance(m.gpu_metrics_series, dict)
            and isinstance(r.placement, dict)
            and isinstance(getattr(r, "clock", {}), dict)
        )
        if not ok:
            return False
    return True
