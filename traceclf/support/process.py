"""The traceclf process as the system sees it: how it ends on SIGTERM, what it needs of the
address space, and what it writes to a stdout that is not UTF-8.

- SIGTERM (``kill``, a batch scheduler's time limit, a container stop) ends a run the way
  Ctrl-C does: local workers, a running ``nsys export`` and its helpers are stopped and
  temporary files removed before the process exits (143). Left to the default action it killed
  only the parent, leaving ``--jobs`` workers (~180 MB each) and nsys running.
- polars and connectorx reserve address space for their thread pools when they load (about
  1.3 GB on a 2-CPU machine before a byte of a trace is read), so under ``ulimit -v`` below
  :data:`MIN_ADDRESS_SPACE` they fail in ways Python cannot report (a Rust allocation failure
  aborts the process): such a limit is refused up front, in one line.
- At exit the interpreter does not search what it still holds for reference cycles: the
  analysis is written by then, and the search took 0.2 s after a default run.
- A run that stops while a read still runs on a daemon thread (an error on the other lane,
  Ctrl-C, SIGTERM) ends at once, its output flushed (:func:`exit_past_reads`): the
  interpreter's shutdown would stop that thread inside connectorx's Rust code, which aborts
  the process (SIGABRT, exit -6 instead of 2, about one run in 20).
- A stdout whose encoding is not UTF-8 (``PYTHONIOENCODING=ascii``, a latin-1 locale) gets
  ``\\xb7``-style escapes for what it cannot encode, not a UnicodeEncodeError.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable

from traceclf.support.errors import TraceError

# Address space an analysis needs before it reads anything (polars' and connectorx's thread
# pools and allocators); the smallest export needs ~1.7 GiB in all on 2 CPUs.
MIN_ADDRESS_SPACE = 2 << 30
TERMINATED_EXIT = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python is running: every cleanup that Ctrl-C runs (a
    ``KeyboardInterrupt``) runs for it too."""


def end_on_sigterm() -> None:
    """From now on SIGTERM raises :class:`Terminated` in the main thread (the CLI's)."""

    def terminated(_signum, _frame) -> None:
        raise Terminated()

    with contextlib.suppress(ValueError, OSError):  # not the main thread: leave it as it is
        signal.signal(signal.SIGTERM, terminated)


def exit_past_reads(main: Callable[[], None]) -> None:
    """``main()``; when it exits while a daemon thread of traceclf's is still at work (a read
    beside the one that failed, stopped by Ctrl-C), the process ends there, stdout and stderr
    flushed, without the interpreter's shutdown: that stops a daemon thread when it next takes
    the interpreter's lock, which a thread in connectorx's Rust code does on its way back, and
    unwinding Rust frames that way aborts the process. The CLI's entry point only: a caller
    that runs ``main`` in its own process (the tests) keeps its interpreter."""
    try:
        main()
    except SystemExit as e:
        if any(
            t.daemon and t.is_alive() and t.name.startswith("traceclf-")
            for t in threading.enumerate()
        ):
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
        raise


def exit_without_collecting() -> None:
    """At exit, skip the interpreter's last search for reference cycles among the objects it
    still holds (0.2 s after a default kernel-dense run, a worker's too): an exit handler
    freezes them (:func:`gc.freeze`), which frees nothing and closes nothing. Their memory
    goes back with the process; the files traceclf writes, temporary ones included, are
    closed or removed where they were opened, never by a finalizer."""
    atexit.register(gc.freeze)


def check_address_space() -> None:
    """Refuse an address-space limit (``ulimit -v``, ``ulimit -d``) below what an analysis
    needs, before anything is loaded (raises TraceError)."""
    try:
        import resource
    except ImportError:  # not a POSIX system: no such limits
        return
    for name, option in (("RLIMIT_AS", "-v"), ("RLIMIT_DATA", "-d")):
        limit = getattr(resource, name, None)
        if limit is None:
            continue
        soft, _hard = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY and soft < MIN_ADDRESS_SPACE:
            raise TraceError(
                None,
                f"the memory limit (ulimit {option}) of {soft >> 20} MiB is below the "
                f"{MIN_ADDRESS_SPACE >> 30} GiB of address space an analysis needs (polars and "
                "connectorx reserve it for their threads as they load; far less is resident): "
                "raise the limit",
            )


def escape_unencodable_output() -> None:
    """Let stdout and stderr write what their encoding cannot hold as escapes."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, LookupError, ValueError, TypeError):
            if codecs.lookup(stream.encoding).name != "utf-8":
                stream.reconfigure(errors="backslashreplace")
