"""The pipeline: inputs -> per-export trace model -> per-rank steps and measures -> report.

``analyze_export`` is the map step (one export file, any number of ranks inside it) and
returns only small, picklable results, so it can run in worker processes or on Dask;
``build_report`` is the reduce step across all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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


def analyze_inputs(inputs: list[str], opts: AnalysisOptions):
    """Analyse every export named by ``inputs`` (files, folders, .nsys-rep) into one report."""
    from traceclf.inputs import resolve_inputs
    from traceclf.schema import inspect_export

    exports = resolve_inputs(inputs, nsys=opts.nsys, cache_dir=opts.cache_dir, quiet=opts.quiet)
    for path in exports:  # reject bad files before any heavy work starts
        inspect_export(path)
    raise NotImplementedError("analysis pipeline not written yet")
