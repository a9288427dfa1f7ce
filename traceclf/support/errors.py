"""The one exception type the CLI turns into a one-line message and exit code 2, and how
warnings reach the user."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


class TraceError(Exception):
    """Bad input: names the file and the problem, in one line."""

    def __init__(self, path: str | Path | None, problem: str) -> None:
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)

    def __reduce__(self):  # survive the trip back from worker processes and Dask
        return (type(self), (self.path, self.problem))


# The note an unforeseen error gets while an export is analysed (:func:`naming`), so that its
# one line names the file, as bad input's does.
WHILE_ANALYSING = "while analysing "


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """What no check foresaw while the body analyses ``path`` is raised with a note naming
    it (:func:`internal_problem`); bad input names its file already."""
    try:
        yield
    except TraceError:
        raise
    except Exception as e:
        e.add_note(f"{WHILE_ANALYSING}{path}")
        raise


def internal_problem(e: BaseException) -> str:
    """The one line a bug gets: the export it was raised while analysing (the innermost one
    its notes name), its type and the first line of its message."""
    notes = [n for n in getattr(e, "__notes__", ()) if n.startswith(WHILE_ANALYSING)]
    where = f"{notes[-1][len(WHILE_ANALYSING) :]}: " if notes else ""
    what = next((line for line in str(e).splitlines() if line.strip()), "")
    return (
        f"{where}internal error: {type(e).__name__}: {what} (set TRACECLF_DEBUG=1 for a traceback)"
    )


class NoGpuWork(TraceError):
    """An export that holds no GPU work at all (a launcher's, a CPU-only process's), or a file
    that is no nsys export (another tool's SQLite database): alone it is bad input; among
    several, it is left out of the run with a warning."""


class TraceErrors(TraceError):
    """Several problems found in one pass (every faulty entry of the rule files), each a
    TraceError of its own in ``errors``; its text is their lines, one a problem."""

    def __init__(self, errors: Sequence[TraceError]) -> None:
        self.errors = tuple(errors)
        super().__init__(None, "\n".join(str(e) for e in self.errors))

    def __reduce__(self):
        return (type(self), (self.errors,))


class Problems:
    """What a check of many independent entries finds: the problem of each entry is kept and
    the check goes on, so that one run names them all (:meth:`check` raises them together)."""

    def __init__(self) -> None:
        self.errors: list[TraceError] = []

    @contextmanager
    def entry(self) -> Iterator[None]:
        """Checks one entry: its TraceError is kept rather than raised."""
        try:
            yield
        except TraceErrors as e:
            self.errors.extend(e.errors)
        except TraceError as e:
            self.errors.append(e)

    def add(self, error: TraceError) -> None:
        """A problem found without raising it."""
        self.errors.append(error)

    def check(self) -> None:
        """Raises what was found: one TraceError as it is, several as one TraceErrors."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise TraceErrors(self.errors)


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
