"""The pipeline: inputs -> per-export trace model -> per-rank steps and measures -> report.

``analyze_export`` is the map step (one export file, any number of ranks inside it) and
returns only small, picklable results, so it can run in worker processes or on Dask;
``build_report`` is the reduce step across all ranks.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from traceclf import __version__
from traceclf.errors import TraceError
from traceclf.report import RankMeasures, Report

if TYPE_CHECKING:
    from traceclf.runs import RunSet


@dataclass(frozen=True)
class AnalysisOptions:
    step_regex: str | None = None
    nsys: Path | None = None
    rules_dir: Path | None = None
    use_cache: bool = True
    cache_dir: Path | None = None
    jobs: int | None = None
    dask_address: str | None = None
    quiet: bool = False
    # "auto": several exports are one job only when their job evidence matches (runs.py);
    # "job": all inputs are ranks of one job; "runs": one report per export.
    grouping: str = "auto"
    # Window mode (default): a long capture is analysed on a sample of its steady steps, at
    # most this many event rows (None: traceclf.ingest.twopass.ROW_BUDGET). all_steps: read
    # and analyse every step of the capture.
    all_steps: bool = False
    row_budget: int | None = None


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


def analyze_inputs(inputs: list[str], opts: AnalysisOptions) -> Report | RunSet:
    """Analyse every export named by ``inputs`` (files, folders, .nsys-rep): one report when
    they are one job, else one report per run (:mod:`traceclf.runs`)."""
    from traceclf.ingest.inputs import resolve_sources
    from traceclf.ingest.schema import inspect_export
    from traceclf.judge.schema import load_rules
    from traceclf.parallel import map_exports
    from traceclf.runs import RunSet, group
    from traceclf.steps import check_step_regex, warn_unmatched_step_regex

    # Reject bad options and files before any heavy work starts.
    check_step_regex(opts.step_regex)
    load_rules(opts.rules_dir)
    if opts.grouping not in ("auto", "job", "runs"):
        raise TraceError(None, f"grouping must be auto, job or runs (got {opts.grouping!r})")
    sources = resolve_sources(inputs, nsys=opts.nsys, cache_dir=opts.cache_dir, quiet=opts.quiet)
    exports = [export for export, _named in sources]
    for path in exports:
        inspect_export(path)
    # A spinner per worker process would garble stderr: progress only for in-process loads.
    in_process = len(exports) == 1 or opts.jobs == 1
    results = map_exports(
        functools.partial(
            analyze_export, opts=opts, show_progress=in_process and not opts.dask_address
        ),
        # Workers (other processes, other machines) get absolute paths: a relative one would
        # name whatever file sits there in the worker's folder. Results carry the user's name.
        [path.resolve() for path in exports],
        jobs=opts.jobs,
        dask_address=opts.dask_address,
        quiet=opts.quiet,
    )
    warn_unmatched_step_regex(
        [r.ranks for r in results], [r.path for r in results], opts.step_regex
    )
    # A report exported into the cache is reported under the name the user gave.
    results = [r.named(named) for r, (_export, named) in zip(results, sources, strict=True)]
    grouping = group(results, opts.grouping)
    reports = []
    for members in grouping.groups:
        report = build_report([results[i] for i in members], opts)
        report.grouping = grouping.for_report()
        reports.append(report)
    if len(reports) == 1:
        return reports[0]
    return RunSet(reports, grouping.for_report())


def analyze_export(path: Path, opts: AnalysisOptions, show_progress: bool = False) -> ExportResult:
    """Map step: load one export and measure each rank (process with GPU work) in it.

    The result is cached with the trace model (keyed by the export's identity, the step
    regex and the analysis code), so re-analysing an unchanged export reads one small file.
    The identity is read before the analysis; the result is filed under it only if the export
    still has it afterwards (a file replaced meanwhile must not poison the cache).
    """
    from traceclf.ingest import cache

    path = Path(path)
    variant = _result_variant(opts)
    key = cache.identity(path) if opts.use_cache else None
    if key is not None:
        hit = cache.read_result(path, variant, key, opts.cache_dir)
        if hit is not None:
            with contextlib.suppress(Exception):  # an older or damaged layout: recompute
                return ExportResult.from_dict(hit).named(path)
    result = _measure_export(path, opts, show_progress)
    if key is not None:
        cache.write_result(path, variant, key, result.to_dict(), opts.cache_dir)
    return result


def _measure_export(path: Path, opts: AnalysisOptions, show_progress: bool) -> ExportResult:
    from traceclf.ingest.session import job_evidence
    from traceclf.ingest.twopass import load_for_analysis
    from traceclf.measures import measure_rank
    from traceclf.progress import LoadProgress
    from traceclf.steps import find_steps

    taxonomy = _taxonomy(opts)
    with LoadProgress(path.name, quiet=opts.quiet or not show_progress) as progress:
        read = load_for_analysis(
            path,
            taxonomy,
            opts.step_regex,
            all_steps=opts.all_steps,
            budget=opts.row_budget,
            use_cache=opts.use_cache,
            cache_dir=opts.cache_dir,
            progress=progress,
        )
    trace, plans = read.trace, read.plans
    names = dict(
        zip(
            trace.processes["pid"].to_list(), trace.processes["process_name"].to_list(), strict=True
        )
    )
    pids = sorted(plans) if plans else trace.rank_pids
    if not pids:
        raise TraceError(path, "no process ran GPU work (kernel and copy rows name no process)")
    if trace.kernels.is_empty() and trace.graphs.is_empty():
        raise TraceError(
            path,
            f"no kernel ran in this capture (only {len(trace.copies)} memcpy/memset rows): "
            "nothing to judge",
        )
    result = ExportResult(
        str(path),
        trace.nsys_version,
        trace.schema_version,
        gpu_count=len(trace.gpus),
        job=job_evidence(path, trace),
        unusable_rows=trace.unusable_rows,
    )
    for pid in pids:
        rank_trace = trace.for_pid(pid)
        steps = find_steps(rank_trace, opts.step_regex, taxonomy, plans.get(pid))
        gpu = trace.gpu_of(pid)
        result.ranks.append(
            RankResult(
                pid=pid,
                process_name=names.get(pid),
                path=str(path),
                gpu=gpu,
                steps=_steps_summary(steps),
                measures=measure_rank(rank_trace, steps, gpu, taxonomy),
                placement=_placement(trace, pid, gpu, path),
                clock=_clock(trace, path),
            )
        )
    return result


def _placement(trace, pid: int, gpu: dict | None, path: Path) -> dict:
    """Where a rank ran: ranks with equal ``key`` ran on one GPU when ``mapped`` (the export
    maps their device to a physical GPU, whose UUID names it across files)."""
    device, mapped = trace.device_of(pid)
    if mapped and gpu:
        key = gpu.get("uuid") or f"{path}#gpu{gpu.get('gpu_id')}"
    else:
        key = f"{path}#device{device}"
    return {"device": device, "mapped": mapped, "key": key}


def _clock(trace, path: Path) -> dict:
    """What puts this rank on a common clock with the ranks of other exports."""
    session = trace.session or {}
    return {
        "utc_offset_ns": session.get("utc_offset_ns"),
        "host": session.get("host"),
        "export": str(path),
    }


# Sources that shape a result (relative to the package): an edit to any invalidates the cache.
ANALYSIS_SOURCES = (
    "analysis.py",
    "steps.py",
    "kernels.py",
    "model.py",
    "measures",
    "figures/series.py",
    "ingest",  # what is read, and how (the window mode's choice of steps included)
    "ingest/session.py",
)


def _taxonomy(opts: AnalysisOptions):
    from traceclf.judge.schema import load_rules

    return load_rules(opts.rules_dir).taxonomy


@functools.cache
def _analysis_fingerprint() -> str:
    """Version plus the source of every module that shapes a result, so an edit invalidates."""
    digest = hashlib.sha256(__version__.encode())
    package = Path(__file__).parent
    for name in ANALYSIS_SOURCES:
        source = package / name
        for file in sorted(source.glob("*.py")) if source.is_dir() else [source]:
            with contextlib.suppress(OSError):
                digest.update(file.read_bytes())
    return digest.hexdigest()


def _result_variant(opts: AnalysisOptions) -> str:
    """Options and rules that shape the result: the step regex, the taxonomy, which steps."""
    taxonomy = repr(_taxonomy(opts))
    steps = "all" if opts.all_steps else f"window:{opts.row_budget or ''}"
    return hashlib.sha256(
        f"{_analysis_fingerprint()}:{opts.step_regex or ''}:{taxonomy}:{steps}".encode()
    ).hexdigest()[:24]


def _steps_summary(steps) -> dict:
    from traceclf.steps import slowest_step

    durations = steps.durations()
    return {
        "source": steps.source,
        "label": steps.label,
        "count": steps.count,
        "used": steps.used,
        "analysed": steps.analysed,  # of "used": fewer when a long capture is sampled
        "mean_ms": float(durations.mean()) / 1e6 if len(durations) else None,
        "median_ms": float(durations.median()) / 1e6 if len(durations) else None,
        "cv": float(durations.std()) / float(durations.mean()) if len(durations) > 1 else None,
        "window_ns": list(steps.window),
        "durations_ms": [round(d / 1e6, 4) for d in steps.table["duration"].to_list()],
        "steady": steps.table["steady"].to_list(),
        "outliers": int(steps.steady["outlier"].sum()) if steps.count else 0,
        "worst": slowest_step(steps),
    }


GPU_KEYS = ("name", "chip", "sm_count", "memory_bytes")
REPORT_VERSION = 2


def build_report(results: list[ExportResult], opts: AnalysisOptions) -> Report:
    """Reduce step: number the ranks, average their measures, compare them, say what the
    capture supports, then classify — or abstain (docs/judgement.md)."""
    from traceclf.judge.capture import abstain_reason, capture_block
    from traceclf.judge.ceiling import combined
    from traceclf.judge.engine import abstained, evaluate
    from traceclf.measures.cross_rank import cross_rank

    ranks = [r for export in results for r in export.ranks]
    rank_dicts = [
        {
            "rank": i,
            "pid": r.pid,
            "process": r.process_name,
            "file": r.path,
            "gpu": r.gpu.get("name") if r.gpu else None,
            "steps": r.steps,
            "metrics": r.measures.metrics,
            "comm_by_kind": r.measures.comm_by_kind,
            "top_kernels": r.measures.top_kernels,
            "idle_nvtx": r.measures.idle_nvtx,
            "phases": r.measures.phases,
            "capture": r.measures.capture,
        }
        for i, r in enumerate(ranks)
    ]
    metrics = mean_metrics([r.measures.metrics for r in ranks])
    gpus = _unique([{k: r.gpu.get(k) for k in GPU_KEYS} for r in ranks if r.gpu])
    capture = capture_block(ranks, results)
    cross = cross_rank(
        [
            d
            | {
                "collectives": r.measures.collectives,
                "clock": r.clock | {"gpu": r.placement.get("key")},
                "window": r.steps.get("window_ns"),
            }
            for d, r in zip(rank_dicts, ranks, strict=True)
        ],
        capture,
    )
    comm_by_kind = _mean_comm(ranks)
    first = ranks[0].steps if ranks else {}
    steps = {
        # rank 0's steps; "mixed" when ranks found their steps in different ways
        "source": _common([r.steps["source"] for r in ranks], first.get("source", "none")),
        "label": first.get("label", ""),
        "count": first.get("count", 0),
        "used": first.get("used", 0),
        "analysed": first.get("analysed", first.get("used", 0)),
        "mean_ms": _mean([r.steps["mean_ms"] for r in ranks]),
        "median_ms": _mean([r.steps["median_ms"] for r in ranks]),
        "cv": _mean([r.steps["cv"] for r in ranks]),
        "window_ns": first.get("window_ns", [0, 0]),
        "worst": _worst_step(ranks),
    }
    facts = {
        "metrics": metrics,
        "ranks": rank_dicts,
        "gpu": gpus[0] if gpus else None,
        "rank_count": len(ranks),
        "comm_by_kind": comm_by_kind,
        "cross_rank": cross,
        "capture": capture,
        "steps": steps,
        "idle_nvtx": _top_idle_nvtx(ranks),
    }
    reason = abstain_reason(capture, ranks)
    verdict = abstained(reason) if reason else evaluate(facts, opts.rules_dir)
    return Report(
        report_version=REPORT_VERSION,
        traceclf_version=__version__,
        inputs=[
            {
                "path": e.path,
                "nsys_version": e.nsys_version,
                "schema_version": e.schema_version,
                "ranks": len(e.ranks),
                "unusable_rows": e.unusable_rows,
            }
            for e in results
        ],
        gpus=gpus,
        capture=capture,
        steps=steps,
        ranks=rank_dicts,
        metrics=metrics,
        cross_rank=cross,
        comm_by_kind=comm_by_kind,
        classification=verdict.classification,
        fixes=verdict.fixes,
        applied=verdict.applied,
        next_wall=verdict.next_wall,
        combined_ceiling=combined(verdict.fixes, metrics.get("step_time_ms")),
        series=[
            {
                "rank": i,
                "step_breakdown": r.measures.step_breakdown,
                "idle_gaps": r.measures.idle_gaps,
                "gpu_metrics": r.measures.gpu_metrics_series,
                "step_budget": r.measures.step_budget,
                "step_lanes": r.measures.step_lanes,
                "memory": r.measures.memory_series,
                "kernel_summary": r.measures.kernel_summary,
            }
            for i, r in enumerate(ranks)
        ],
    )


def _worst_step(ranks: list[RankResult]) -> dict | None:
    """The slowest steady step of any rank, with where it lies on that rank's export clock."""
    rows = [
        (r.steps["worst"], i) for i, r in enumerate(ranks) if (r.steps.get("worst") or {}).get("ms")
    ]
    if not rows:
        return None
    worst, rank = max(rows, key=lambda x: x[0]["ms"])
    return worst | {"rank": rank, "file": ranks[rank].path}


def _top_idle_nvtx(ranks: list[RankResult]) -> dict | None:
    """The NVTX range that covers the most idle time on any rank (with its rank)."""
    rows = [(row, i) for i, r in enumerate(ranks) for row in r.measures.idle_nvtx[:1]]
    if not rows:
        return None
    row, rank = max(rows, key=lambda x: x[0]["frac"])
    return row | {"rank": rank}


def mean_metrics(per_rank: list[dict]) -> dict:
    """Mean over ranks of each measure; booleans are true if true on any rank."""
    keys = list(dict.fromkeys(k for m in per_rank for k in m))
    out = {}
    for k in keys:
        values = [m.get(k) for m in per_rank if m.get(k) is not None]
        if values and all(isinstance(v, bool) for v in values):
            out[k] = any(values)
        else:
            out[k] = _mean(values)
    return out


def _mean_comm(ranks: list[RankResult]) -> dict:
    kinds = list(dict.fromkeys(k for r in ranks for k in r.measures.comm_by_kind))
    out = {}
    for kind in kinds:
        rows = [r.measures.comm_by_kind.get(kind) for r in ranks]
        present = [row for row in rows if row]
        out[kind] = {
            "frac": round(sum(row["frac"] for row in present) / len(ranks), 4),
            "exposed_frac": round(sum(row["exposed_frac"] for row in present) / len(ranks), 4),
            "kernels": sum(row["kernels"] for row in present),
            "libraries": sorted({lib for row in present for lib in row["libraries"]}),
        }
    return out


def _common(values: list[str], default: str) -> str:
    distinct = set(values)
    return default if len(distinct) <= 1 else "mixed"


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.fmean(vals), 6) if vals else None


def _unique(rows: list[dict]) -> list[dict]:
    seen, out = set(), []
    for row in rows:
        key = tuple(sorted(row.items()))
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out
