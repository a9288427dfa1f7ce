"""The report object: what `traceclf analyze` found, in the shape of the JSON contract
(docs/report-contract.md). Every renderer (terminal, Markdown, HTML) and `compare`
read this object, never the trace."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from traceclf.report import display
from traceclf.support import jsontext
from traceclf.support.errors import TraceError
from traceclf.support.pandas_frames import to_pandas
from traceclf.support.readfile import read_bounded
from traceclf.support.units import counted

# A saved report bigger than this is no report traceclf wrote (a long --all-steps report is a
# few MB): reading it could exhaust memory (a 3 GB file took every byte there was).
MAX_REPORT_BYTES = 64 << 20

# The report contract's version (docs/report-contract.md) that this traceclf writes and reads.
REPORT_VERSION = 2
WALLS = ("memory", "communication", "host", "compute")
ORDER = (
    "report_version",
    "traceclf_version",
    "inputs",
    "gpus",
    "capture",
    "steps",
    "classification",
    "fixes",
    "applied",
    "next_wall",
    "metrics",
    "cross_rank",
    "communication",
    "comm_by_kind",
    "host_attribution",
    "ranks",
    "series",
)


@dataclass
class Report:
    report_version: int
    traceclf_version: str
    inputs: list[dict]
    gpus: list[dict]
    steps: dict
    ranks: list[dict]
    metrics: dict
    classification: dict
    fixes: list[dict]
    capture: dict = field(default_factory=dict)
    cross_rank: dict = field(default_factory=dict)
    comm_by_kind: dict = field(default_factory=dict)
    # where the GPU's idle time went on the host, by source, for the job (measures/hostsources)
    host_attribution: list = field(default_factory=list)
    # per communicator: ranks, dimension, exposed/blocking time, bytes, bandwidth against the
    # link; what overlap costs compute (judge/comm_groups.py)
    communication: dict = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    next_wall: str | None = None
    series: list[dict] = field(default_factory=list)
    # what the proposed fixes can recover together, over disjoint interval classes only
    combined_ceiling: dict = field(default_factory=dict)
    # How several inputs were grouped into this run (runs.py): mode, decided_by, reason.
    grouping: dict = field(default_factory=dict)

    @property
    def bound(self) -> str | None:
        """The wall that bounds the run; None when traceclf abstained (see
        ``classification["abstain_reason"]``)."""
        return self.classification.get("bound")

    @property
    def abstained(self) -> bool:
        return self.classification.get("bound") is None

    def to_dict(self) -> dict:
        """The contract's JSON object, in reading order: what was read and what it supports,
        the verdict and fixes, then the numbers behind them (a copy: changing it leaves the
        report as it was)."""
        return _ordered(asdict(self))

    def to_json(self, indent: int | None = 2) -> str:
        # Serialised straight from the fields: the deep copy of to_dict costs more than the
        # encoding on a long --all-steps report (re-analysis reads a cached result, then this).
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return jsontext.dumps(_ordered(data), indent=indent, default=_jsonable)

    def tables(self) -> dict:
        """The report's tables as polars frames by name (steps, ranks, kernels, idle_gaps,
        collectives, phases, communicators, late_arrivals: traceclf/report/frames.py), as
        ``--export-dir`` writes them."""
        from traceclf.report.frames import report_tables

        return report_tables(self)

    def to_pandas(self, table: str = "ranks"):
        """One of :meth:`tables` as a pandas DataFrame (default: one row per rank, every
        measure). Needs pandas: ``pip install 'traceclf[pandas]'``."""
        return to_pandas(self.tables(), table)

    def _repr_html_(self) -> str:
        """The HTML report in a notebook cell (style scoped to it, figures inline)."""
        return display.notebook_html(self)

    def input_files(self) -> list[Path]:
        """The exports the report was made from, as its ``inputs`` name them: what nothing
        written for it may overwrite, whether or not the caller names them too."""
        return [Path(i["path"]) for i in self.inputs if isinstance(i.get("path"), str)]

    def __repr__(self) -> str:
        files = ", ".join(Path(i.get("path", "?")).name for i in self.inputs) or "no input"
        bound = f"{self.bound}-bound" if self.bound else "no verdict"
        fixes = ", ".join(f["id"] for f in self.fixes[:3]) or "none"
        step = (self.steps or {}).get("median_ms")
        step = f", step {step:.3g} ms" if isinstance(step, (int, float)) else ""
        return (
            f"<Report {files}: {bound}, {counted(len(self.ranks), 'rank')}{step}; fixes: {fixes}>"
        )

    @classmethod
    def from_dict(cls, data: dict) -> Report:
        missing = {"report_version", "metrics", "classification"} - set(data)
        if missing and isinstance(data.get("runs"), list):
            raise TraceError(
                None,
                f"a report of {len(data['runs'])} runs (analysed with --runs, or inputs that "
                "are not one job): compare takes one run's report (analyse that run alone)",
            )
        if missing:
            raise TraceError(None, f"not a traceclf report (missing {', '.join(sorted(missing))})")
        names = {f.name for f in fields(cls)}
        defaults = {
            "traceclf_version": "",
            "inputs": [],
            "gpus": [],
            "steps": {},
            "ranks": [],
            "fixes": [],
        }
        return cls(**(defaults | {k: v for k, v in data.items() if k in names}))

    def misshapen(self) -> list[str]:
        """The sections whose JSON type is not the contract's (a saved report edited or
        damaged: ``"ranks": null``), each as ``'ranks' is null``; [] for a report as
        traceclf writes it. :meth:`load` reads such a report as it is (``compare`` reads what
        it can of it); rendering it or its tables needs every section of its type."""
        hints = {f.name: str(f.type) for f in fields(self)}
        wrong = []
        for name, hint in hints.items():
            value = getattr(self, name)
            kind = hint.split("[", 1)[0].split(" ", 1)[0]
            expected = {"int": int, "str": str, "list": list, "dict": dict}.get(kind)
            if expected is None or (value is None and "None" in hint):
                continue
            if not isinstance(value, expected) or isinstance(value, bool):
                wrong.append(f"{name!r} is {_json_type(value)}")
            elif hint.startswith("list[dict") and not all(isinstance(v, dict) for v in value):
                wrong.append(f"{name!r} holds an entry that is not an object")
        return wrong

    @classmethod
    def load(cls, path: str | Path) -> Report:
        """Read a saved JSON report (``traceclf analyze --format json -o report.json``): a
        regular file of at most MAX_REPORT_BYTES (never a FIFO or a device), whose numbers,
        nesting and size cannot exhaust the process."""
        path = Path(path)
        raw = read_bounded(path, MAX_REPORT_BYTES, "JSON report")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TraceError(path, f"cannot read JSON report ({e})") from None
        except ValueError as e:  # a number longer than Python reads (4,300 digits)
            raise TraceError(
                path, f"cannot read JSON report ({' '.join(str(e).split())[:120]})"
            ) from None
        except RecursionError:
            raise TraceError(path, "cannot read JSON report (nested too deeply)") from None
        except MemoryError:
            raise TraceError(path, "cannot read JSON report (out of memory)") from None
        if not isinstance(data, dict):
            raise TraceError(path, "not a traceclf report (not a JSON object)")
        try:
            return cls.from_dict(data)
        except TraceError as e:
            raise TraceError(path, e.problem) from None


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string"}.get(
        type(value), "a number" if isinstance(value, int | float) else type(value).__name__
    )


def _ordered(data: dict) -> dict:
    return {k: data[k] for k in ORDER if k in data} | data


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy / polars scalars
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
