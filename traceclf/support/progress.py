"""Progress on stderr for the slow steps: exporting a report with nsys, loading an export.

Nothing is shown when ``quiet``, when stderr is not a terminal (pipes and CI logs stay clean,
and a bad-input error stays the only line on stderr), or, for loads, when the load is over
before anyone would wonder what is going on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (rich is imported only where progress may show: --quiet runs skip it)
    from rich.console import Console
    from rich.status import Status

# A load shorter than this shows nothing; a spinner that flashes for 200 ms is just noise.
SHOW_AFTER_S = 1.0


def stderr_console(quiet: bool = False) -> Console | None:
    """A rich console on stderr, or None when progress must stay hidden."""
    if quiet:
        return None
    from rich.console import Console

    console = Console(stderr=True)
    return console if console.is_terminal else None


@contextmanager
def status(message: str, *, quiet: bool = False, console: Console | None = None) -> Iterator[None]:
    """A spinner with ``message`` on stderr (or ``console``) while the block runs."""
    console = console or stderr_console(quiet)
    if console is None:
        yield
        return
    with console.status(message):
        yield


class LoadProgress:
    """A ``progress(stage)`` callback for :func:`traceclf.ingest.load.load_trace`.

    Shows "Loading NAME: stage" with a spinner, but only once the load has taken ``delay``
    seconds, so the usual sub-second load prints nothing::

        with LoadProgress(path.name, quiet=quiet) as progress:
            trace = load_trace(path, progress=progress)

    A timer thread brings the spinner up, so one long stage (a multi-GB kernel table) still
    shows it; ``console`` replaces stderr (tests pass one that records).
    """

    def __init__(
        self,
        label: str,
        *,
        quiet: bool = False,
        delay: float = SHOW_AFTER_S,
        console: Console | None = None,
    ) -> None:
        self._label = label
        self._console = None if quiet else console or stderr_console()
        self._delay = delay
        self._lock = threading.Lock()
        self._stage = "opening"
        self._status: Status | None = None
        self._timer: threading.Timer | None = None
        self._closed = False

    def __enter__(self) -> LoadProgress:
        if self._console is not None:
            self._timer = threading.Timer(self._delay, self._show)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __call__(self, stage: str) -> None:
        with self._lock:
            self._stage = stage
            if self._status is not None:
                self._status.update(self._text())

    def close(self) -> None:
        """Stop the timer and take the spinner off the screen."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._status is not None:
                self._status.stop()
                self._status = None

    def _show(self) -> None:
        with self._lock:
            if self._closed or self._console is None:
                return
            self._status = self._console.status(self._text())
            self._status.start()

    def _text(self) -> str:
        return f"Loading {self._label}: {self._stage}…"
