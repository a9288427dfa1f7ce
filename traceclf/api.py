"""Python API: open a trace, analyse it. Placeholder until analysis lands."""

from __future__ import annotations

from pathlib import Path

from traceclf.load import load_trace
from traceclf.model import Trace


def open(path: str | Path) -> Trace:  # noqa: A001
    """Load one SQLite export (or .nsys-rep) into the trace model."""
    return load_trace(path)


def analyze(*paths: str | Path):
    raise NotImplementedError
