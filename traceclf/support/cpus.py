"""The CPUs this process may keep busy: all it may use, or, in a ``--jobs`` worker, its
share of them (the parent's pool sets the share in each worker before polars is imported:
traceclf/pipeline/parallel.py)."""

from __future__ import annotations

import contextlib
import os

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
