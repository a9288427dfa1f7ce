"""The one exception type the CLI turns into a one-line message and exit code 2, and how
warnings reach the user."""

from __future__ import annotations

import sys
import warnings
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


# Whether warnings of other libraries (polars, pyarrow ...) are kept off stderr: ``--quiet``.
_quiet = False
_python_showwarning = warnings.showwarning


def show_warnings(quiet: bool = False) -> None:
    """From now on, traceclf's warnings reach stderr as one line each (``traceclf: warning:
    ...``); other libraries' as Python prints them, or not at all when ``quiet``. The CLI calls
    this, and so does every ``--jobs`` worker, with the CLI's setting."""
    global _quiet
    _quiet = quiet
    warnings.showwarning = _show_warning


def warnings_quiet() -> bool:
    return _quiet


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, TraceWarning):
        from traceclf.support.escape import visible

        print(f"traceclf: warning: {visible(message)}", file=sys.stderr)
    elif not _quiet:
        _python_showwarning(message, category, filename, lineno, file, line)
