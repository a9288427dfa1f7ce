"""What changed between two runs, kernel by kernel and phase by phase, as data: the parts of a
:class:`~traceclf.report.comparison.Comparison` that ``traceclf compare`` prints and
``--format json`` writes (docs/report-contract.md, "Comparisons"). Times are ms per steady
step, means over ranks; ``material`` is judged by ``traceclf.compare`` against the thresholds
in rules/scoring.yaml (``comparison``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import polars as pl

# A kernel's status against its own step-to-step spread (docs/api.md)
STATUSES = ("slower", "new", "faster", "removed", "same")


@dataclass
class KernelChange:
    """One kernel (full demangled name) before and after."""

    name: str
    short_name: str
    family: str | None
    before_ms_per_step: float
    after_ms_per_step: float
    delta_ms_per_step: float
    before_instances_per_step: float
    after_instances_per_step: float
    # the change its own step-to-step spread allows: noise_standard_errors standard errors of
    # the difference of its two means (null when a side has fewer than 2 steps)
    noise_ms: float | None
    status: str  # one of STATUSES
    material: bool
    # launch shapes [grid blocks, threads per block, instances per step], most launched first
    before_shapes: list[list[float]] = field(default_factory=list)
    after_shapes: list[list[float]] = field(default_factory=list)

    @property
    def shape_changed(self) -> bool:
        """Both runs launched it, with other (grid, block) shapes."""
        return bool(self.before_shapes and self.after_shapes) and _shapes(
            self.before_shapes
        ) != _shapes(self.after_shapes)


def _shapes(rows: list[list[float]]) -> set[tuple[float, float]]:
    return {(r[0], r[1]) for r in rows}


@dataclass
class OtherKernels:
    """The kernels a side did not list (each rank lists its longest: measures/step_kernels.py),
    and those listed on one side only while the other side's list was cut short."""

    before_ms_per_step: float
    after_ms_per_step: float
    delta_ms_per_step: float


@dataclass
class PhaseChange:
    """An NVTX phase (forward, backward, optimizer, outside phases), another NVTX range that
    recurs in both runs' steps (measures/nvtx_ranges.py), or the time inside and outside
    CUDA-graph replays: its time per step, and how much of it was busy and idle."""

    phase: str
    kind: str  # "nvtx" | "range" | "graph"
    # null on the side that has no such phase (no NVTX range matched it), and then no change
    before_ms_per_step: float | None
    after_ms_per_step: float | None
    delta_ms_per_step: float | None
    before_busy_ms: float | None
    after_busy_ms: float | None
    before_idle_ms: float | None
    after_idle_ms: float | None
    material: bool


@dataclass
class PartChange:
    """One number per step before and after: an idle cause, a collective kind's exposed time,
    blocking communication."""

    before_ms_per_step: float
    after_ms_per_step: float
    delta_ms_per_step: float
    material: bool


@dataclass
class IdleChange(PartChange):
    """GPU idle time per step, and by cause (docs/measures.md, idle_*_frac)."""

    noise_ms: float | None = None
    by_cause: dict[str, PartChange] = field(default_factory=dict)


@dataclass
class CommunicationChange:
    """Communication the step waits for: exposed time by collective kind (no compute running),
    and blocking time (compute absent, waiting on a communication kernel)."""

    exposed_by_kind: dict[str, PartChange] = field(default_factory=dict)
    blocking: PartChange | None = None


@dataclass
class Reconciliation:
    """How the parts add up to the step change: kernels + idle = explained, and what is left
    (``unexplained_ms``), itself split into what the parts are known to leave out."""

    step_change_ms: float  # the verdict's: change of the mean steady step
    kernels_ms: float  # sum of every kernel's delta (the listed ones and the rest)
    idle_ms: float
    unexplained_ms: float  # step_change_ms - kernels_ms - idle_ms
    # the unexplained part, term by term (they sum to it): kernel time that overlapped other
    # kernels (counted twice in kernels_ms; negative: gaps inside graph replays counted as
    # busy), copies with no kernel running, and the window's mean step against the mean of
    # the steady steps the verdict uses (outlier steps)
    overlap_ms: float
    copies_ms: float
    outlier_steps_ms: float

    @property
    def explained_ms(self) -> float:
        return self.kernels_ms + self.idle_ms


@dataclass
class MemoryChange:
    """Peak device memory allocated (largest rank), before and after."""

    before_bytes: int | None
    after_bytes: int | None
    delta_bytes: int | None
    capacity_bytes: int | None
    material: bool


@dataclass
class Thresholds:
    """When a part's change is material (rules/scoring.yaml, ``comparison``): a kernel, phase,
    idle cause or collective kind moving by ``part_share`` of the baseline's step
    (``part_floor_ms``; null without steps), and past its own noise (a kernel, idle, a phase
    or range from its step-to-step spread) or else the step's noise band (``step_noise_ms``;
    null: unknown), peak memory by
    ``memory_share`` of the GPU's."""

    part_share: float
    part_floor_ms: float | None
    memory_share: float
    step_noise_ms: float | None = None


@dataclass
class Breakdown:
    """Everything above for one comparison; ``detail_missing`` says why the per-step parts
    are absent (a side without steps, or a report saved without them)."""

    kernels: list[KernelChange] = field(default_factory=list)
    other_kernels: OtherKernels | None = None
    phases: list[PhaseChange] = field(default_factory=list)
    idle: IdleChange | None = None
    communication: CommunicationChange | None = None
    reconciliation: Reconciliation | None = None
    memory: MemoryChange | None = None
    thresholds: Thresholds | None = None
    detail_missing: str | None = None

    @property
    def launch_changes(self) -> list[KernelChange]:
        return [k for k in self.kernels if k.shape_changed]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["kernels"] = [
            row | {"shape_changed": k.shape_changed}
            for row, k in zip(data["kernels"], self.kernels, strict=True)
        ]
        data["launch_changes"] = [
            {k: row[k] for k in ("name", "short_name", "before_shapes", "after_shapes")}
            for row in data["kernels"]
            if row["shape_changed"]
        ]
        if self.reconciliation is not None:
            data["reconciliation"]["explained_ms"] = self.reconciliation.explained_ms
        return data


def comparison_tables(measures: list[dict], b: Breakdown) -> dict[str, pl.DataFrame]:
    """A comparison as polars frames: ``measures`` (one row per measure compared), ``kernels``
    (one row per kernel), ``phases``, ``idle`` (one row per cause, then ``all``),
    ``communication`` (one row per collective kind, then ``blocking``) and ``reconciliation``
    (one row per term)."""
    import polars as pl

    measure_cols = {
        "key": pl.String,
        "label": pl.String,
        "unit": pl.String,
        "before": pl.Float64,
        "after": pl.Float64,
        "change": pl.Float64,
        "material": pl.Boolean,
    }

    kernel_cols = {
        "name": pl.String,
        "short_name": pl.String,
        "family": pl.String,
        "before_ms_per_step": pl.Float64,
        "after_ms_per_step": pl.Float64,
        "delta_ms_per_step": pl.Float64,
        "before_instances_per_step": pl.Float64,
        "after_instances_per_step": pl.Float64,
        "noise_ms": pl.Float64,
        "status": pl.String,
        "material": pl.Boolean,
        "shape_changed": pl.Boolean,
    }
    kernels = pl.DataFrame(
        [
            {k: v for k, v in asdict(c).items() if k in kernel_cols}
            | {"shape_changed": c.shape_changed}
            for c in b.kernels
        ],
        schema=kernel_cols,
    )
    phase_cols = {
        "phase": pl.String,
        "kind": pl.String,
        **dict.fromkeys(
            ("before_ms_per_step", "after_ms_per_step", "delta_ms_per_step"), pl.Float64
        ),
        **dict.fromkeys(
            ("before_busy_ms", "after_busy_ms", "before_idle_ms", "after_idle_ms"), pl.Float64
        ),
        "material": pl.Boolean,
    }
    phases = pl.DataFrame([asdict(p) for p in b.phases], schema=phase_cols)
    part_cols = {
        "before_ms_per_step": pl.Float64,
        "after_ms_per_step": pl.Float64,
        "delta_ms_per_step": pl.Float64,
        "material": pl.Boolean,
    }

    def parts(key: str, rows: dict[str, PartChange]) -> pl.DataFrame:
        return pl.DataFrame(
            [{key: name} | {k: getattr(p, k) for k in part_cols} for name, p in rows.items()],
            schema={key: pl.String, **part_cols},
        )

    idle = b.idle
    comm = b.communication
    recon = b.reconciliation
    terms = (
        [
            ("step_change", recon.step_change_ms),
            ("kernels", recon.kernels_ms),
            ("idle", recon.idle_ms),
            ("unexplained", recon.unexplained_ms),
            ("overlap", recon.overlap_ms),
            ("copies", recon.copies_ms),
            ("outlier_steps", recon.outlier_steps_ms),
        ]
        if recon
        else []
    )
    return {
        "measures": pl.DataFrame(measures, schema=measure_cols),
        "kernels": kernels,
        "phases": phases,
        "idle": parts("cause", (idle.by_cause | {"all": idle}) if idle else {}),
        "communication": parts(
            "kind",
            (comm.exposed_by_kind | ({"blocking": comm.blocking} if comm.blocking else {}))
            if comm
            else {},
        ),
        "reconciliation": pl.DataFrame(
            terms, schema={"term": pl.String, "ms_per_step": pl.Float64}, orient="row"
        ),
    }
