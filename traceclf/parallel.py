"""Apply a per-export function to many exports: in-process, in local processes, or on Dask.

This is the map step of a multi-rank analysis (one export in, a small picklable result out);
the reduce step stays with the caller. Local workers are started with "spawn" because polars'
thread pools do not survive fork. Dask distributed is the engine of nsys' own multi-rank
recipes, so a cluster that already runs those can run traceclf too.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, TypeVar

from traceclf.errors import TraceError

T = TypeVar("T")
R = TypeVar("R")

DASK_CONNECT_TIMEOUT = "30s"
# Each worker holds a whole trace model in memory: more than a few at once trades speed for RSS.
MAX_DEFAULT_JOBS = 4


def map_exports(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    jobs: int | None = None,
    dask_address: str | None = None,
    quiet: bool = False,
) -> list[R]:
    """``[fn(item) for item in items]``, run in parallel, results in input order.

    ``fn`` must be a picklable top-level function. With ``dask_address`` the calls run on that
    Dask distributed cluster; otherwise on up to ``jobs`` local processes (default: CPUs, at
    most 4), or in this process for one item or ``jobs=1``. The first exception raised by a
    call is re-raised here with its original type. Progress goes to stderr unless ``quiet``.
    """
    items = list(items)
    with _progress(len(items), quiet) as advance:
        if dask_address is not None:
            return _map_dask(fn, items, dask_address, advance)
        workers = min(default_jobs() if jobs is None else jobs, len(items))
        if workers <= 1:
            return [_advancing(fn(item), advance) for item in items]
        return _map_local(fn, items, workers, advance)


def default_jobs() -> int:
    """CPUs this process may use (the affinity mask, so containers count right), at most 4."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_DEFAULT_JOBS, cpus or 1))


def _advancing(result: R, advance: Callable[[], None]) -> R:
    advance()
    return result


def _map_local(
    fn: Callable[[T], R], items: list[T], workers: int, advance: Callable[[], None]
) -> list[R]:
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        with _main_hidden_from_workers(fn):  # workers start on the first submit
            futures = [pool.submit(fn, item) for item in items]
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()  # re-raises the worker's exception; the finally cancels the rest
                advance()
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def _main_hidden_from_workers(fn: Callable) -> Iterator[None]:
    """Let a plain script without an ``if __name__ == "__main__":`` guard use local workers.

    A "spawn" worker re-runs the parent's main script to rebuild ``__main__`` (so that
    functions defined there can be unpickled), and an unguarded script would start the whole
    analysis again in every worker, which multiprocessing refuses. Our ``fn`` lives in an
    importable module, so while the workers start, ``__main__`` is made to look like an
    interactive session's (no file, no spec), which workers do not re-run.
    """
    main = sys.modules.get("__main__")
    target = getattr(fn, "func", fn)  # functools.partial
    if main is None or getattr(target, "__module__", None) == "__main__":
        yield
        return
    saved = {
        name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__
    }
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _map_dask(
    fn: Callable[[T], R], items: list[T], address: str, advance: Callable[[], None]
) -> list[R]:
    try:
        from distributed import Client, as_completed
    except ImportError:
        raise TraceError(None, "--dask needs Dask: pip install 'traceclf[dask]'") from None
    try:
        client = Client(address, timeout=DASK_CONNECT_TIMEOUT)
    except OSError as e:
        raise TraceError(None, f"cannot reach the Dask scheduler at {address} ({e})") from None
    with client:
        # pure=False: an export rewritten in place must be read again, not served from memory.
        futures = client.map(fn, items, pure=False)
        try:
            for future in as_completed(futures):
                if future.status == "error":
                    future.result()  # re-raises the original exception with its traceback
                advance()
            return client.gather(futures)
        finally:
            client.cancel(futures)


@contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr for more than one item; ``advance`` moves it by one."""
    if quiet or total <= 1:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns: tuple[Any, ...] = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("exports", total=total)
        yield lambda: bar.advance(task)
