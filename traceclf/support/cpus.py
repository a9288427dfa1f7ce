"""The CPUs this process may keep busy: all it may use, or, in a ``--jobs`` worker, its
share of them (the parent's pool sets the share in each worker before polars is imported:
traceclf/pipeline/parallel.py)."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Executor, Future

WORKER_CPUS = "TRACECLF_WORKER_CPUS"  # a worker's share of the CPUs (set in the worker)


def cpus() -> int:
    """CPUs this process may use: its affinity mask where there is one (containers)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def in_worker() -> bool:
    """Whether this process is a ``--jobs`` worker (its share of the CPUs is set)."""
    return WORKER_CPUS in os.environ


def cpu_share() -> int:
    """Cores one analysis may keep busy: CPUs this process may use, or its share of them in a
    worker of ``--jobs``, at most 4 (the loader's parallel reads)."""
    n = cpus()
    with contextlib.suppress(ValueError):
        n = min(n, int(os.environ.get(WORKER_CPUS) or n))
    return max(1, min(4, n))


class _Here(Executor):
    """An executor that runs each call at once, on the calling thread."""

    def submit(self, fn, /, *args, **kwargs) -> Future:  # type: ignore[override]
        done: Future = Future()
        _run(done, fn, args, kwargs)
        return done


class _Beside(Executor):
    """An executor that runs each call on a daemon thread of its own: leaving the ``with``
    block early (Ctrl-C, SIGTERM, an error) does not wait for it, nor does the process's
    exit, where a pool's thread would hold both until its work was done."""

    def __init__(self, name: str) -> None:
        self.name = name

    def submit(self, fn, /, *args, **kwargs) -> Future:  # type: ignore[override]
        done: Future = Future()
        threading.Thread(
            target=_run, args=(done, fn, args, kwargs), name=self.name, daemon=True
        ).start()
        return done


def _run(done: Future, fn, args, kwargs) -> None:
    try:
        done.set_result(fn(*args, **kwargs))
    except BaseException as e:  # (raised again by ``result()``, as a pool's would be)
        done.set_exception(e)


def second_lane(name: str) -> Executor:
    """Where work that may run beside the calling thread's goes: a thread of its own when this
    analysis may keep two cores busy, else the calling thread, at once (a ``--jobs`` worker
    with a share of one core gains nothing from a second thread but its memory)."""
    return _Beside(name) if cpu_share() >= 2 else _Here()
