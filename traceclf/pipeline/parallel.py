"""Apply a per-export function to many exports: in-process, in local processes, or on Dask.

This is the map step of a multi-rank analysis (one export in, a small picklable result out);
the reduce step stays with the caller. Local workers are started with "spawn" because polars'
thread pools do not survive fork. Dask distributed is the engine of nsys' own multi-rank
recipes, so a cluster that already runs those can run traceclf too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Executor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from traceclf.support.cpus import WORKER_CPUS, cpus
from traceclf.support.errors import TraceError, show_warnings, warnings_quiet
from traceclf.support.process import exit_without_collecting

T = TypeVar("T")
R = TypeVar("R")

# Seconds to wait for a Dask scheduler to answer ($TRACECLF_DASK_TIMEOUT overrides): a
# scheduler on any reachable network answers in milliseconds.
DASK_CONNECT_TIMEOUT = 10.0
HEAD_BYTES = 1 << 16
# Each worker holds a whole trace model in memory: more than a few at once trades speed for RSS.
MAX_DEFAULT_JOBS = 4


def map_exports(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    jobs: int | None = None,
    dask_address: str | None = None,
    quiet: bool = False,
    pool: Executor | None = None,
) -> list[R]:
    """``[fn(item) for item in items]``, run in parallel, results in input order.

    ``fn`` must be a picklable top-level function. With ``dask_address`` the calls run on that
    Dask distributed cluster; otherwise on up to ``jobs`` local processes (default: CPUs, at
    most 4; ``pool``: those :func:`started_workers` started), or in this process for one item
    or ``jobs=1``. The first exception raised by a call is re-raised here with its original
    type. Progress goes to stderr unless ``quiet``.
    """
    items = list(items)
    with _progress(len(items), quiet) as advance:
        if dask_address is not None:
            return _map_dask(fn, items, dask_address, advance)
        workers = _local_workers(jobs, len(items))
        if workers <= 1:
            return [_advancing(fn(item), advance) for item in items]
        if pool is not None:
            return _map_on(pool, fn, items, advance)
        with _local_pool(workers) as own:
            return _map_on(own, fn, items, advance)


@contextmanager
def started_workers(
    jobs: int | None, items: int, warm: Callable[[], object]
) -> Iterator[Executor | None]:
    """The local processes that :func:`map_exports` would start for ``items`` items with
    ``jobs``, started now, each running ``warm`` (its imports): pass them to map_exports as
    ``pool``. A worker takes ~0.35 s to start, which then overlaps the caller's own
    preparation (rules, inputs) instead of following it. None where map_exports would run in
    this process. The workers are stopped on leaving."""
    workers = _local_workers(jobs, items)
    if workers <= 1:
        yield None
        return
    with _local_pool(workers) as pool:
        with _main_hidden_from_workers(warm):  # a "spawn" worker starts at each submit
            for _ in range(workers):
                pool.submit(warm)
        yield pool


def _local_workers(jobs: int | None, items: int) -> int:
    return min(default_jobs() if jobs is None else jobs, items)


def default_jobs() -> int:
    """CPUs this process may use (the affinity mask, so containers count right), at most 4."""
    return max(1, min(MAX_DEFAULT_JOBS, cpus()))


def _advancing(result: R, advance: Callable[[], None]) -> R:
    advance()
    return result


@contextmanager
def _local_pool(workers: int) -> Iterator[Executor]:
    """``workers`` "spawn" processes (started at the first submits), stopped on leaving with
    whatever they had not begun cancelled."""
    import multiprocessing  # (with the pool's module: only an analysis of several workers)
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker,
        initargs=(workers, _users_decay(), warnings_quiet()),
    )
    try:
        yield pool
    except KeyboardInterrupt:  # (the executor has no public way to stop its workers at once)
        for process in list(pool._processes.values()):  # type: ignore[attr-defined]
            process.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _stop_resource_tracker()


def _map_on(
    pool: Executor, fn: Callable[[T], R], items: list[T], advance: Callable[[], None]
) -> list[R]:
    from concurrent.futures.process import BrokenProcessPool

    futures: list = []
    try:
        with _main_hidden_from_workers(fn):  # workers not started yet start on a submit
            futures = [pool.submit(fn, item) for item in items]
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()  # re-raises the worker's exception; the finally cancels the rest
                advance()
        return [future.result() for future in futures]
    except BrokenProcessPool:  # (also from a submit: a worker died while it started)
        lost = [i for n, i in enumerate(items) if n >= len(futures) or not _succeeded(futures[n])]
        raise TraceError(None, _worker_died(lost)) from None
    finally:
        for future in futures:
            future.cancel()


def _succeeded(future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _worker_died(lost: list) -> str:
    """A worker process ended without an answer (killed: the OOM killer, kill -9)."""
    names = ", ".join(Path(str(i)).name for i in lost[:3]) + (" ..." if len(lost) > 3 else "")
    return (
        f"a worker process died while analysing {names or 'the inputs'} (killed, perhaps for "
        "lack of memory); rerun with --jobs 1 to analyse one export at a time"
    )


def _start_worker(workers: int, users_decay: bool, quiet: bool) -> None:
    """In a worker, before polars is imported: its share of the cores, its allocator's
    settings (unless ``users_decay``: :func:`_users_decay`), and warnings shown as the CLI
    shows them (``quiet``: ``--quiet``)."""
    # Ctrl-C reaches the whole process group: the parent stops the workers, which would
    # otherwise each print a traceback from their idle wait.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    show_warnings(quiet)
    exit_without_collecting()
    _share_cores(workers)
    if not users_decay:
        _keep_freed_pages()


def _share_cores(workers: int) -> None:
    """In a worker, before polars is imported: its share of the CPUs for every thread pool
    it would start, and for parallel reads (:func:`traceclf.support.cpus.cpu_share`). Two workers with a thread per
    CPU each would put twice as many busy threads as CPUs on the machine and lose time
    switching between them (a user's own settings are kept)."""
    share = str(max(1, cpus() // workers))
    for pool in WORKER_POOLS:
        os.environ.setdefault(pool, share)
    os.environ[WORKER_CPUS] = share


# Thread pools sized by the CPU count unless told: polars'; rayon's global pool, on which
# connectorx runs the queries of one read side by side (a window read is several); and
# OpenBLAS's, which numpy starts on import and whose threads spin ~0.1 CPU-s for nothing
# (traceclf does no linear algebra).
WORKER_POOLS = ("POLARS_MAX_THREADS", "RAYON_NUM_THREADS", "OPENBLAS_NUM_THREADS")


# polars' allocator (jemalloc) reads its settings from this variable as polars is imported:
# polars writes its own there first, then what the variable held (later settings win).
JEMALLOC_CONF = "_RJEM_MALLOC_CONF"
WORKER_DIRTY_DECAY = "dirty_decay_ms:10000"


def _keep_freed_pages() -> None:
    """Let a worker keep the memory one export freed for the next one (10 s, not polars'
    0.5 s). Handed back to the system after half a second, it had every page of the next
    export mapped and zeroed afresh: 8 exports of 128 MB on 2 workers took 30% more page
    faults and 0.6 s more system time. A worker's size stays that of its largest export."""
    conf = os.environ.get(JEMALLOC_CONF, "")
    os.environ[JEMALLOC_CONF] = f"{conf},{WORKER_DIRTY_DECAY}".lstrip(",")


def _users_decay() -> bool:
    """Whether the user set jemalloc's decay: the variable names it once more than polars
    wrote it here (once if this process has imported polars, else not at all)."""
    own = 1 if "polars" in sys.modules else 0
    return os.environ.get(JEMALLOC_CONF, "").count("dirty_decay_ms") > own


def _stop_resource_tracker() -> None:
    """Stop (and reap) the helper process that "spawn" starts to track the pool's semaphores:
    left running, it outlives the command in its process group. Started again if needed."""
    from multiprocessing import resource_tracker

    with contextlib.suppress(Exception):  # a private API: never let it fail an analysis
        resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]


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
        from distributed import Client
    except ImportError:
        raise TraceError(None, "--dask needs Dask: pip install 'traceclf[dask]'") from None
    timeout = _dask_timeout()
    _probe_scheduler(address, timeout)
    try:
        client = Client(address, timeout=f"{timeout}s")
    except (OSError, ValueError, TypeError, MemoryError) as e:
        raise TraceError(None, f"cannot reach the Dask scheduler at {address} ({e})") from None
    with client:
        _wait_for_a_worker(client, address, timeout)
        # Workers run elsewhere: files travel as absolute paths with the identity seen here.
        remote = [RemoteFile.of(i) if isinstance(i, Path) else i for i in items]
        # pure=False: an export rewritten in place must be read again, not served from memory.
        futures = client.map(functools.partial(_on_worker, fn=fn), remote, pure=False)
        try:
            _wait_on_cluster(client, address, futures, timeout, advance)
            return client.gather(futures)
        finally:
            client.cancel(futures)


# How often a wait on the cluster checks that it still has a worker (seconds).
DASK_POLL_S = 1.0


def _wait_for_a_worker(client, address: str, timeout: float) -> None:
    """A scheduler without workers would hold the tasks forever, in silence."""
    try:
        client.wait_for_workers(1, timeout=timeout)
    except (TimeoutError, OSError) as e:
        raise TraceError(
            None,
            f"the Dask scheduler at {address} has no worker (none joined within {timeout:g} s): "
            f"start one (dask worker {address}) or run without --dask",
        ) from e


def _wait_on_cluster(
    client, address: str, futures: list, timeout: float, advance: Callable[[], None]
) -> None:
    """Wait for ``futures``, re-raising the first error; if the cluster has no worker for
    ``timeout`` seconds (the only one died or left), give up in one line instead of waiting
    for a worker that may never come."""
    from distributed import wait as dask_wait

    pending, alone_since = set(futures), None
    while pending:
        try:
            done, pending = dask_wait(pending, timeout=DASK_POLL_S, return_when="FIRST_COMPLETED")
        except TimeoutError:
            done = set()
        for future in done:
            if future.status == "error":
                future.result()  # re-raises the original exception with its traceback
            advance()
        if done:
            continue
        workers = len(client.nthreads())
        alone_since = None if workers else (alone_since or time.monotonic())
        if alone_since is not None and time.monotonic() - alone_since > timeout:
            raise TraceError(
                None,
                f"the Dask cluster at {address} lost its workers ({len(pending)} of "
                f"{len(futures)} exports unfinished, no worker for {timeout:g} s): a worker "
                "died or left; restart them, or run without --dask",
            )


def _dask_timeout() -> float:
    raw = os.environ.get("TRACECLF_DASK_TIMEOUT") or str(DASK_CONNECT_TIMEOUT)
    try:
        value = float(raw.strip().removesuffix("s"))
    except ValueError:
        raise TraceError(
            None, f"TRACECLF_DASK_TIMEOUT={raw!r} is not a number of seconds"
        ) from None
    return value if 0 < value < 3600 else 10.0


def _probe_scheduler(address: str, timeout: float) -> None:
    """Ask ``address`` who it is, within ``timeout`` seconds, before a Client is built on it.

    ``Client()`` waits forever on a server that accepts and never answers, and on one that
    answers with something else (an HTTP server) it reads the reply as a frame length and
    tries to allocate exabytes. An identity call under our own deadline is cancelled cleanly.
    """
    import asyncio

    from distributed.core import rpc

    async def identity() -> dict:
        async with rpc(address, timeout=timeout) as scheduler:
            return await scheduler.identity()

    where = f"cannot reach the Dask scheduler at {address}"
    try:
        found = asyncio.run(asyncio.wait_for(identity(), timeout))
    except (TimeoutError, asyncio.TimeoutError):
        raise TraceError(
            None, f"{where}: no answer within {timeout:g} s (is it running at that address?)"
        ) from None
    except (ValueError, TypeError) as e:  # a malformed address or an unknown scheme
        raise TraceError(None, f"{where}: not a usable address ({e})") from None
    except Exception as e:  # OSError, MemoryError, a protocol error: whatever else answered
        detail = " ".join(str(e).split())[:120] or type(e).__name__
        if isinstance(e, MemoryError):  # a non-Dask reply read as a frame length
            detail = "the reply is not Dask's protocol"
        raise TraceError(
            None,
            f"{where}: no Dask answer within {timeout:g} s ({detail}; is something else "
            "listening there?)",
        ) from None
    if not isinstance(found, dict) or found.get("type") != "Scheduler":
        raise TraceError(None, f"{where}: something else answered within {timeout:g} s")


@dataclass(frozen=True)
class RemoteFile:
    """A file as a Dask worker must find it: by absolute path (a worker's working folder is
    not the user's), and with the size, mtime and head hash seen here, so a worker that sees
    another file at that path says so instead of analysing it under the user's name."""

    path: Path
    size: int | None
    mtime_ns: int | None
    head: str | None

    @classmethod
    def of(cls, path: Path) -> RemoteFile:
        path = path.absolute()
        try:
            st = path.stat()
            return cls(path, st.st_size, st.st_mtime_ns, _head(path))
        except OSError:  # missing here too: the worker reports it as the local run would
            return cls(path, None, None, None)

    def checked(self) -> Path:
        if self.size is None:
            return self.path
        try:
            st = self.path.stat()
            same = (st.st_size, st.st_mtime_ns, _head(self.path)) == (
                self.size,
                self.mtime_ns,
                self.head,
            )
        except OSError as e:
            raise TraceError(
                self.path, f"the Dask worker cannot read it ({e.strerror or e})"
            ) from None
        if not same:
            raise TraceError(
                self.path,
                "the Dask worker sees a different file at this path (size, time or content "
                "differ): workers must see the same files at the same paths",
            )
        return self.path


def _head(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()


def _on_worker(item: Any, fn: Callable[[Any], R]) -> R:
    return fn(item.checked() if isinstance(item, RemoteFile) else item)


@contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr for more than one item; ``advance`` moves it by one."""
    if quiet or total <= 1:  # (rich not even imported: a cached re-analysis stays light)
        yield lambda: None
        return
    from traceclf.support.progress import stderr_console

    console = stderr_console(quiet)  # (None off a terminal: a log file gets no bar, no newline)
    if console is None:
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns: tuple[Any, ...] = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("exports", total=total)
        yield lambda: bar.advance(task)
