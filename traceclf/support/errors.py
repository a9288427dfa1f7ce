"""The one exception type the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations

from pathlib import Path


class TraceError(Exception):
    """Bad input: names the file and the problem, in one line."""

    def __init__(self, path: str | Path | None, problem: str) -> None:
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)

    def __reduce__(self):  # survive the trip back from worker processes and Dask
        return (type(self), (self.path, self.problem))


class TraceWarning(UserWarning):
    """Something the user should know that does not stop the analysis (the CLI prints it as
    one line, ``traceclf: warning: ...``)."""
