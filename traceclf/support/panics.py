"""Rust panics of the readers are errors, not output.

connectorx reports a failed read (a damaged page, a file cut short while it is read, a value of
the wrong type) by panicking in one of its threads: Rust prints the panic, and a backtrace when
``RUST_BACKTRACE`` is set, straight to file descriptor 2 before Python sees the exception that
traceclf turns into its one-line message. While a read runs, :func:`panics_hidden` holds what
reaches descriptor 2 and afterwards writes it back without the panic reports.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# "thread '<unnamed>' (123) panicked at src/x.rs:1:2:", the message, an optional backtrace and
# a closing "note: ..." line (absent when the process dies: then the rest of the output).
_PANIC = re.compile(
    rb"^thread '[^\n]*' (?:\(\d+\) )?panicked at [^\n]*\n(?:(?!note: )[^\n]*\n)*(?:note: [^\n]*\n?)?",
    re.M,
)
# Descriptor 2 belongs to the whole process: the first of the reads running at once (step
# sampling reads memory events beside its plan) redirects it, the last one gives it back.
_LOCK = threading.Lock()


@dataclass
class _Held:
    readers: int = 0
    file: Any = None  # where descriptor 2 goes meanwhile (None: it could not be redirected)
    saved: int = -1  # descriptor 2 as it was
    released: bool = False  # the process is stopping (release): descriptor 2 is not taken again


_HELD = _Held()


@contextlib.contextmanager
def panics_hidden() -> Iterator[None]:
    """Hold what is written to descriptor 2 while the body runs (and any other read running
    at the same time); then write it back, Rust panic reports removed. Where descriptor 2
    cannot be redirected, the body runs as it is."""
    with _LOCK:
        if not _HELD.readers and not _HELD.released:
            _HELD.file = _scratch()
            if _HELD.file is not None:
                with contextlib.suppress(Exception):
                    sys.stderr.flush()
                _HELD.saved = os.dup(2)
                os.dup2(_HELD.file.fileno(), 2)
        _HELD.readers += 1
    try:
        yield
    finally:
        with _LOCK:
            _HELD.readers -= 1
            if not _HELD.readers and _HELD.file is not None:
                _give_back(_HELD.file, _HELD.saved)
                _HELD.file = None


def release() -> None:
    """Give descriptor 2 back now, with what was held, though reads may still run, and never take
    it again: the process is about to say why it stops and exit, and a reader thread left
    running (a lane beside the one that failed) would otherwise keep the message in memory,
    never written, or take the descriptor again for its next read. (A panic of such a read in
    the moments before the exit is then printed as it is.)"""
    with _LOCK:
        _HELD.released = True
        if _HELD.file is not None:
            _give_back(_HELD.file, _HELD.saved)
            _HELD.file = None


def _give_back(held, saved: int) -> None:
    """Descriptor 2 as it was, and what was held written to it without the panic reports."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
    held.seek(0)
    rest = _PANIC.sub(b"", held.read())
    held.close()
    if rest.strip():
        with contextlib.suppress(OSError):
            os.write(2, rest)


def _scratch():
    """An anonymous file in memory (Linux) or in the temporary folder; None if neither works
    or descriptor 2 is closed."""
    try:
        os.fstat(2)
    except OSError:
        return None
    with contextlib.suppress(OSError, AttributeError):
        return os.fdopen(os.memfd_create("traceclf-stderr"), "w+b")
    with contextlib.suppress(OSError):
        return tempfile.TemporaryFile()
    return None
