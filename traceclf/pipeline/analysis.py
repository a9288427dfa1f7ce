"""The pipeline: inputs -> per-export trace model -> per-rank steps and measures -> report.

``analyze_export`` is the map step (one export file, any number of ranks inside it) and
returns only small, picklable results, so it can run in worker processes or on Dask;
``build_report`` is the reduce step across all ranks.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from traceclf.measures.handoff import Clock, ExportResult, Placement, RankResult, StepSummary
from traceclf.report.contract import Report
from traceclf.support.errors import NoGpuWork, TraceError, naming
from traceclf.support.version import __version__, sources_digest

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from traceclf.report.runset import RunSet

# Ranks (processes with GPU work) one export may hold: a node's capture holds one per GPU (a
# few dozen under MPS); each costs ~60 ms to measure however little it ran, so a file whose
# rows name 50,000 processes would take most of an hour.
MAX_RANKS = 1024


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
    # "auto": several exports are one job only when their job evidence matches (grouping.py);
    # "job": all inputs are ranks of one job; "runs": one report per export.
    grouping: str = "auto"
    # Step sampling (default): a long capture is analysed on a sample of its steady steps, at
    # most this many event rows (None: traceclf.pipeline.twopass.ROW_BUDGET). all_steps: read
    # and analyse every step of the capture.
    all_steps: bool = False
    row_budget: int | None = None


@dataclass(frozen=True)
class Inputs:
    """The exports an analysis of what the user named reads (checked), and the key its report
    is cached under (None: not cached)."""

    files: list[Path]
    run: tuple[str, str] | None

    def cached_json(self, opts: AnalysisOptions) -> str | None:
        """The report of an earlier analysis of the same inputs with the same options, rules
        and code, as ``--format json`` writes it (without the last newline); None when there
        is none. Printed as read, neither decoded nor encoded again: an ``--all-steps``
        report runs to megabytes."""
        from traceclf.ingest import results

        if self.run is None:
            return None
        from traceclf.pipeline.leftout import warn_filed

        text = results.read_run_text(self.files[0], *self.run, opts.cache_dir)
        return warn_filed(text)


def chosen_inputs(inputs: list[str], opts: AnalysisOptions) -> Inputs:
    """Reject bad options and files before any heavy work starts; the exports ``inputs``
    name and the key of their analysis."""
    from traceclf.ingest.inputs import chosen_files

    if opts.step_regex is not None:  # (steps/ imports polars: not without a --step-range)
        from traceclf.steps.find import check_step_regex

        check_step_regex(opts.step_regex)
    if opts.grouping not in ("auto", "job", "runs"):
        raise TraceError(None, f"grouping must be auto, job or runs (got {opts.grouping!r})")
    files = chosen_files(inputs)
    return Inputs(files, run_key(inputs, files, opts))


def analyze_inputs(
    inputs: list[str], opts: AnalysisOptions, chosen: Inputs | None = None
) -> Report | RunSet:
    """Analyse every export named by ``inputs`` (files, folders, .nsys-rep): one report when
    they are one job, else one report per run (:mod:`traceclf.pipeline.grouping`).
    ``chosen``: what :func:`chosen_inputs` made of them, if it was called already."""
    from traceclf.ingest.inputs import named_order

    if chosen is None:
        chosen = chosen_inputs(inputs, opts)
    files, run = chosen.files, chosen.run
    if run is not None:
        cached = _cached_run(files[0], run, opts)
        if cached is not None:
            return cached
    from traceclf.pipeline.grouping import group, split_unrelated_ranks, without_repeats
    from traceclf.pipeline.parallel import started_workers
    from traceclf.pipeline.reduce import build_report
    from traceclf.report.runset import RunSet

    # Local workers start first: their start-up overlaps the checks of the rules and exports.
    local_jobs = 1 if opts.dask_address is not None else opts.jobs
    with started_workers(local_jobs, len(files), _warm_worker) as pool:
        results, skipped = _analyse_files(files, opts, pool)
    if opts.step_regex is not None:
        from traceclf.steps.find import warn_unmatched_step_regex

        warn_unmatched_step_regex(
            [[rank.steps.source for rank in r.ranks] for r in results],
            [r.path for r in results],
            opts.step_regex,
        )
    # (--runs reports each file whole: a process two of them hold is in both reports)
    results = without_repeats(results, each_process=opts.grouping != "runs")
    results = split_unrelated_ranks(results, opts.grouping)
    grouping = group(results, opts.grouping)
    # the inputs left out: in the one report's capture block, or once for several runs
    several = len(grouping.groups) > 1
    reports = []
    for members in grouping.groups:
        report = build_report(
            [results[i] for i in members], opts.rules_dir, [] if several else skipped
        )
        report.grouping = grouping.for_report()
        reports.append(report)
    if len(reports) == 1:
        out: Report | RunSet = reports[0]
    else:
        # runs in the order the user named their files (the first file of each run)
        order = named_order(inputs)
        position = [
            min(order.get(Path(results[i].path).resolve(), len(order)) for i in members)
            for members in grouping.groups
        ]
        ranked = sorted(range(len(reports)), key=position.__getitem__)
        out = RunSet(
            [reports[i] for i in ranked], grouping.for_report() | {"skipped_inputs": skipped}
        )
    if run is not None:
        _store_run(files[0], run, out, opts)
    return out


def run_key(inputs: list[str], files: list[Path], opts: AnalysisOptions) -> tuple[str, str] | None:
    """The key a whole analysis of ``inputs`` (which name ``files``) is cached under, with
    the identity of the first file (whose cache slot holds it): the inputs as named (their
    order orders the runs), every file and its identity, every option that shapes the report,
    the rule files (their identities and times) and traceclf's code. None without the cache, or
    with a step regex (whose warnings name what each export matched: those are recomputed)."""
    from traceclf.ingest import results
    from traceclf.rulebook.rulefiles import rules_digest

    if not opts.use_cache or opts.step_regex is not None or not files:
        return None
    keys = [results.identity(f) for f in files]
    if any(k is None for k in keys):
        return None
    digest = hashlib.sha256(
        f"{_report_fingerprint()}:{rules_digest(opts.rules_dir)}:{opts.grouping}:"
        f"{opts.all_steps}:{opts.row_budget}:{opts.nsys}".encode(errors="surrogateescape")
    )
    for name in inputs:
        digest.update(f"{name}\0".encode(errors="surrogateescape"))
    digest.update(b"\1")
    for f, k in zip(files, keys, strict=True):
        digest.update(f"{f}\0{k}\0".encode(errors="surrogateescape"))
    return keys[0], digest.hexdigest()[:24]  # type: ignore[return-value]


def _cached_run(first: Path, run: tuple[str, str], opts: AnalysisOptions) -> Report | RunSet | None:
    from traceclf.ingest import results
    from traceclf.report.runset import RunSet

    data = results.read_run(first, *run, opts.cache_dir)
    if data is None:
        return None
    out: Report | RunSet | None = None
    with contextlib.suppress(Exception):  # an older or damaged layout: analyse again
        if "runs" in data:
            out = RunSet([Report.from_dict(r) for r in data["runs"]], data["grouping"])
        else:
            out = Report.from_dict(data)
    if out is not None:  # (what the analysis warned about, warned again)
        from traceclf.pipeline.leftout import left_out_of, warn_left_out

        warn_left_out(left_out_of(data))
    return out


def _store_run(first: Path, run: tuple[str, str], out: Report | RunSet, opts) -> None:
    """File the report as the JSON it renders to (what :func:`_cached_run` reads back)."""
    from traceclf.ingest import results

    with contextlib.suppress(Exception):  # a cache never fails an analysis
        results.write_run(first, *run, out.to_json(), opts.cache_dir)


def _analyse_files(
    files: list[Path], opts: AnalysisOptions, pool: Executor | None
) -> tuple[list[ExportResult], list[dict]]:
    """Map step over :func:`~traceclf.ingest.inputs.chosen_files`: their rules and exports
    checked here, then each analysed (on ``pool``'s workers, if any), under the user's name;
    with the inputs left out (:mod:`traceclf.pipeline.leftout`)."""
    from traceclf.ingest.inputs import export_sources
    from traceclf.judge.vocabulary import load_rules
    from traceclf.pipeline.leftout import checked_export, kept_and_left_out
    from traceclf.pipeline.parallel import map_exports

    load_rules(opts.rules_dir, remember=_rules_stamp_root(opts))
    sources = export_sources(files, nsys=opts.nsys, cache_dir=opts.cache_dir, quiet=opts.quiet)
    # (a damaged page would have failed the analysis whose result is cached for this version
    # of the file: the page check, a read of the whole file, is for new ones)
    checked = [
        (checked_export(path, not _result_cached(path, opts)), named) for path, named in sources
    ]
    if all(why is not None for why, _named in checked):  # (none left to analyse: no worker)
        kept_and_left_out(checked)
    sources = [src for src, (why, _named) in zip(sources, checked, strict=True) if why is None]
    exports = [export for export, _named in sources]
    # A spinner per worker process would garble stderr: progress only for in-process loads.
    in_process = len(exports) == 1 or opts.jobs == 1
    resolved = [path.resolve() for path in exports]
    try:
        results = iter(
            map_exports(
                functools.partial(
                    _analysed, opts=opts, show_progress=in_process and not opts.dask_address
                ),
                # Workers (other processes, other machines) get absolute paths: a relative one
                # would name whatever file sits there in the worker's folder. Results carry the
                # user's name, and so do errors.
                resolved,
                jobs=opts.jobs,
                dask_address=opts.dask_address,
                quiet=opts.quiet,
                pool=pool,
            )
        )
    except TraceError as e:
        named = {str(r): n for r, (_e, n) in zip(resolved, sources, strict=True)}
        if e.path in named and type(e) is TraceError:
            raise TraceError(named[e.path], e.problem) from None
        raise
    # each input's outcome in the order the user named them: its result or why it has none
    outcomes = [(why or next(results), named) for why, named in checked]
    kept, skipped = kept_and_left_out(outcomes)
    # A report exported into the cache is reported under the name the user gave.
    return [r.named(named) for r, named in kept], skipped


def _analysed(path: Path, opts: AnalysisOptions, show_progress: bool) -> ExportResult | NoGpuWork:
    """:func:`analyze_export`, or why the export's processes ran no kernel to judge."""
    try:
        return analyze_export(path, opts, show_progress)
    except NoGpuWork as e:
        return e


def _warm_worker() -> None:
    """What a worker process imports before its first export (:func:`started_workers`)."""


def analyze_export(path: Path, opts: AnalysisOptions, show_progress: bool = False) -> ExportResult:
    """Map step: load one export and measure each rank (process with GPU work) in it.

    The result is cached with the trace model (keyed by the export's identity, the step
    regex and the analysis code), so re-analysing an unchanged export reads one small file.
    The identity is read before the analysis; the result is filed under it only if the export
    still has it afterwards (a file replaced meanwhile must not poison the cache).
    """
    from traceclf.ingest import results as cache

    path = Path(path)
    variant = _result_variant(opts)
    key = cache.identity(path) if opts.use_cache else None
    if key is not None:
        hit = cache.read_result(path, variant, key, opts.cache_dir)
        if hit is not None:
            with contextlib.suppress(Exception):  # an older or damaged layout: recompute
                return ExportResult.from_dict(hit).named(path)
    with naming(path):  # (what no check foresaw names the file it came from)
        result = _measure_export(path, opts, show_progress)
    if key is not None:
        cache.write_result(path, variant, key, result.to_dict(), opts.cache_dir)
    return result


def _result_cached(path: Path, opts: AnalysisOptions) -> bool:
    """Whether a result of this version of the export is cached for these options."""
    from traceclf.ingest import results

    key = results.identity(path) if opts.use_cache else None
    if key is None:
        return False
    return results.read_result(path, _result_variant(opts), key, opts.cache_dir) is not None


def _measure_export(path: Path, opts: AnalysisOptions, show_progress: bool) -> ExportResult:
    from traceclf.ingest.session import job_evidence, nccl_ranks, session_info
    from traceclf.measures import measure_rank
    from traceclf.pipeline.twopass import STEP_BUDGET, load_for_analysis
    from traceclf.steps.find import find_steps, steps_alike
    from traceclf.support.cpus import second_lane, two_at_a_time
    from traceclf.support.progress import LoadProgress

    # (a few small queries beside the load; the NCCL payloads' rows, where step sampling's
    # first pass did not find them in its scan of the NVTX table, by a scan beside the rest)
    session = second_lane("traceclf-session").submit(session_info, path, payloads=False)
    taxonomy, settings = _taxonomy(opts), _step_settings(opts)
    with LoadProgress(path.name, quiet=opts.quiet or not show_progress) as progress:
        read = load_for_analysis(
            path,
            taxonomy,
            opts.step_regex,
            settings=settings,
            all_steps=opts.all_steps,
            budget=opts.row_budget,
            use_cache=opts.use_cache,
            cache_dir=opts.cache_dir,
            progress=progress,
        )
    trace, plans = read.trace, read.plans
    ranks_named = second_lane("traceclf-nccl-ranks").submit(nccl_ranks, path, read.payloads)
    names = dict(
        zip(
            trace.processes["pid"].to_list(), trace.processes["process_name"].to_list(), strict=True
        )
    )
    pids = sorted(plans) if plans else trace.rank_pids
    if not pids:  # (rows left out are damage, not an export without work: bad input)
        left_out = [k for k, n in trace.unusable_rows.items() if n]
        kernels = [k for k in left_out if k.split(".")[0] in ("kernels", "graphs")]
        if kernels and not all(k.endswith(".no_process") for k in kernels):
            raise _no_kernel(trace, path)  # (times no capture has, ...: each reason)
        damaged = any(k.endswith(".no_process") for k in left_out)
        error = TraceError if damaged else NoGpuWork
        raise error(path, "no process ran GPU work (kernel and copy rows name no process)")
    if len(pids) > MAX_RANKS:
        raise TraceError(
            path,
            f"{len(pids):,} processes ran GPU work, each a rank: more than {MAX_RANKS:,} in one "
            "export is no training job's capture (a process per GPU; the rows may name "
            "processes wrongly)",
        )
    if trace.kernels.is_empty() and trace.graphs.is_empty():
        raise _no_kernel(trace, path)

    # A capture read whole: its ranks' steps found first, no more analysed than a sampled
    # read's, and the same ones on ranks whose steps match (as step sampling's plans are)
    found = {}
    if not (opts.all_steps or plans):
        found = steps_alike(trace, pids, opts.step_regex, taxonomy, settings, STEP_BUDGET)

    def rank(pid: int) -> RankResult:
        rank_trace = trace.for_pid(pid)
        steps = found.get(pid) or find_steps(
            rank_trace, opts.step_regex, taxonomy, plans.get(pid), settings
        )
        gpu = trace.gpu_of(pid)
        return RankResult(
            pid=pid,
            process_name=names.get(pid),
            path=str(path),
            gpu=gpu,
            steps=StepSummary.of(steps),
            measures=measure_rank(rank_trace, steps, gpu, taxonomy),
            placement=_placement(trace, pid, gpu, path),
            clock=_clock(trace, path),
        )

    # Without --all-steps the read holds at most the row budget's rows (the analysed steps',
    # or a small capture whole): two ranks measured at once keep both cores busy where one
    # rank's two lanes leave one idle at times. A whole big capture's ranks one at a time:
    # two at once held 1 GB more for no time gained.
    if opts.all_steps:
        ranks = [rank(pid) for pid in pids]
    else:
        ranks = two_at_a_time(rank, pids, "traceclf-rank")
    return ExportResult(
        str(path),
        trace.nsys_version,
        trace.schema_version,
        tuple(ranks),
        gpu_count=len(trace.gpus),
        job=job_evidence(session.result() | {"nccl_ranks": ranks_named.result()}, trace),
        unusable_rows=trace.unusable_rows,
        repaired_strings=trace.repaired_strings,
    )


def _no_kernel(trace, path: Path) -> TraceError:
    """Why there is nothing to judge: no kernel row (a process that only copied: left out of a
    run of several), or none a measure can use (each reason and how many rows: a damaged or
    hand-edited table is not an export without kernels, and stays bad input)."""
    bad = {k: n for k, n in trace.unusable_rows.items() if k.split(".")[0] in ("kernels", "graphs")}
    if bad:
        why = ", ".join(f"{k.split('.', 1)[1].replace('_', ' ')}: {n:,}" for k, n in bad.items())
        return TraceError(
            path,
            f"no usable kernel row in this capture ({sum(bad.values()):,} left out: {why}): "
            "nothing to judge",
        )
    return NoGpuWork(
        path,
        f"no kernel ran in this capture (only {len(trace.copies)} memcpy/memset rows): "
        "nothing to judge",
    )


def _placement(trace, pid: int, gpu: dict | None, path: Path) -> Placement:
    """Where a rank ran (ranks with equal ``key`` ran on one GPU when the export maps their
    device to a physical GPU)."""
    device, mapped = trace.device_of(pid)
    if mapped and gpu:
        key = gpu.get("uuid") or f"{path}#gpu{gpu.get('gpu_id')}"
    else:
        key = f"{path}#device{device}"
    return Placement(device, mapped, key)


def _clock(trace, path: Path) -> Clock:
    session = trace.session or {}
    return Clock(session.get("utc_offset_ns"), session.get("host"), str(path))


# Sources that shape a result (relative to the package): an edit to any invalidates the cache.
ANALYSIS_SOURCES = (
    "pipeline/analysis.py",
    "pipeline/twopass.py",  # step sampling's choice of steps
    "pipeline/pass2.py",  # and the rows it reads of them
    "steps",
    "model",
    "measures",
    "ingest",  # what is read, and how
)
# ... and those that shape the report made of the results (a cached whole analysis)
REPORT_SOURCES = (
    *ANALYSIS_SOURCES,
    "pipeline",
    "judge",
    "rulebook",
    "report",
    "support",
)


def _taxonomy(opts: AnalysisOptions):
    from traceclf.model.taxonomy import Taxonomy

    return Taxonomy.of(rule_set(opts).taxonomy)


def _step_settings(opts: AnalysisOptions):
    from traceclf.steps.settings import StepSettings

    return StepSettings.of(rule_set(opts).thresholds)


def rule_set(opts: AnalysisOptions):
    """The rules of these options: bundled, with ``opts.rules_dir`` merged over them."""
    from traceclf.judge.vocabulary import load_rules

    return load_rules(opts.rules_dir, remember=_rules_stamp_root(opts))


def _rules_stamp_root(opts: AnalysisOptions) -> Path | None:
    """Where a rule set that passed its checks is remembered: the cache root, unless the
    cache is off (:mod:`traceclf.rulebook.stamp`)."""
    if not opts.use_cache:
        return None
    from traceclf.ingest.cachedir import cache_root

    return cache_root(opts.cache_dir).path


@functools.cache
def _report_fingerprint() -> str:
    """Version plus the source of every module, for the cache of whole reports."""
    return sources_digest(hashlib.sha256(__version__.encode()), REPORT_SOURCES)


@functools.cache
def _analysis_fingerprint() -> str:
    """Version plus the source of every module that shapes a result, so an edit invalidates."""
    return sources_digest(hashlib.sha256(__version__.encode()), ANALYSIS_SOURCES)


def _result_variant(opts: AnalysisOptions) -> str:
    """Options and rules that shape the result: the step regex, the taxonomy, the step
    thresholds, which steps."""
    taxonomy = f"{_taxonomy(opts)!r}:{_step_settings(opts)!r}"
    steps = "all" if opts.all_steps else f"window:{opts.row_budget or ''}"
    return hashlib.sha256(
        f"{_analysis_fingerprint()}:{opts.step_regex or ''}:{taxonomy}:{steps}".encode()
    ).hexdigest()[:24]
