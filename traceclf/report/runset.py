"""Several unrelated runs analysed together (traceclf/pipeline/grouping.py decides which
exports are runs, not ranks): one report each plus a summary table."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from traceclf.report import display
from traceclf.report.contract import Report, _jsonable
from traceclf.support import jsontext
from traceclf.support.pandas_frames import to_pandas

if TYPE_CHECKING:  # (import traceclf stays light: polars is imported when a frame is asked for)
    import polars as pl

SUMMARY_COLUMNS = ("run", "bound", "step", "busy", "exposed comm", "top fix")
SUMMARY_TEXT = ("run", "bound", "top_fix")  # the summary's text columns; the others numbers


@dataclass
class RunSet:
    """Several unrelated runs analysed together: one report each plus a summary table. In
    JSON ``{"report_version": 2, "runs": [report, ...], "summary": [row, ...], "grouping"}``."""

    runs: list[Report]
    grouping: dict = field(default_factory=dict)

    report_version = 2

    @property
    def summary(self) -> pl.DataFrame:
        """One row per run, in the order the files were named: ``run`` (its file names),
        ``bound``, ``step_ms``, ``busy_frac``, ``exposed_comm_frac``, ``top_fix``."""
        import polars as pl

        rows = self.summary_rows()
        columns = list(summary_row(self.runs[0])) if self.runs else list(SUMMARY_TEXT)
        schema = {c: pl.String if c in SUMMARY_TEXT else pl.Float64 for c in columns}
        return pl.DataFrame(rows, schema=schema, orient="row")

    def summary_rows(self) -> list[dict]:
        """The summary as the JSON holds it: one dict per run."""
        return [summary_row(r) for r in self.runs]

    def input_files(self) -> list[Path]:
        """Every run's :meth:`Report.input_files`."""
        return [path for run in self.runs for path in run.input_files()]

    def to_dict(self) -> dict:
        return {
            "report_version": self.report_version,
            "runs": [r.to_dict() for r in self.runs],
            "summary": self.summary_rows(),
            "grouping": self.grouping,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return jsontext.dumps(self.to_dict(), indent=indent, default=_jsonable)

    def tables(self) -> dict:
        """Every run's tables stacked, with a leading ``run`` column: the run's file names, as
        in :attr:`summary` (traceclf/report/frames.py)."""
        from traceclf.report.frames import stacked_tables

        names = [row["run"] for row in self.summary_rows()]
        return stacked_tables(list(zip(names, self.runs, strict=True)))

    def to_pandas(self, table: str = "ranks"):
        """One of :meth:`tables` as a pandas DataFrame (``pip install 'traceclf[pandas]'``)."""
        return to_pandas(self.tables(), table)

    def _repr_html_(self) -> str:
        """Its summary table, then each run, in a notebook cell."""
        return display.notebook_html(self)


def summary_row(report: Report) -> dict:
    """One run in a line: files, bound, median step, GPU busy, exposed comm, top fix."""
    m = report.metrics
    fix = report.fixes[0] if report.fixes else {}
    return {
        "run": ", ".join(
            Path(i["path"]).name + (f" ({i['part']})" if i.get("part") else "")
            for i in report.inputs
        ),
        "bound": report.classification.get("bound"),
        "step_ms": report.steps.get("median_ms"),
        "busy_frac": m.get("gpu_busy_frac"),
        "exposed_comm_frac": m.get("exposed_comm_frac"),
        "top_fix": fix.get("id"),
    }
