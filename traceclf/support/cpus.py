"""The CPUs this process may keep busy: all it may use, or, in a ``--jobs`` worker, its
share of them (the parent's pool sets the share in each worker before polars is imported:
traceclf/pipeline/parallel.py)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

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


def two_at_a_time(fn: Callable[[T], R], items: Sequence[T], name: str) -> list[R]:
    """``fn`` of each of ``items``, in their order: this thread and one beside it (a daemon,
    as :func:`second_lane`'s) each take the next item left, when this analysis may keep two
    cores busy; else one after another here. After an error no item is begun; the first
    error in the items' order is raised once every item begun is done, so no thread is left
    at work after the call (but for Ctrl-C, raised here at once, as :func:`second_lane`'s
    daemon lets it be)."""
    if cpu_share() < 2 or len(items) < 2:
        return [fn(item) for item in items]
    done: list[Future] = [Future() for _ in items]
    left = iter(range(len(items)))
    lock = threading.Lock()

    def take() -> int | None:
        with lock:
            failed = any(f.done() and f.exception() is not None for f in done)
            return None if failed else next(left, None)

    def work() -> None:
        while (i := take()) is not None:
            _run(done[i], fn, (items[i],), {})

    beside = threading.Thread(target=work, name=name, daemon=True)
    beside.start()
    while (i := take()) is not None:
        try:
            done[i].set_result(fn(items[i]))
        except Exception as e:  # (raised below, in the items' order)
            done[i].set_exception(e)
    beside.join()
    # (items are begun in order: every one before a failed one is done, and its error is
    # raised here before any item never begun is reached)
    return [future.result() for future in done]


class InOrder(Generic[T, R]):
    """``fn`` of each of ``keys``, one after another on a daemon thread (as
    :func:`second_lane`'s, but joined: the thread itself is gone after the block), begun at
    once and as fast as it goes (not bounded by what the caller has taken): the caller takes
    each result with :meth:`take` when it needs it and works on it meanwhile, while the next
    are under way; a result taken is held here no longer. Used as a ``with`` block: leaving
    it lets no key be begun and waits for the one under way (but for Ctrl-C, raised at once).
    A key not listed, taken twice or not yet begun is computed on the calling thread; with
    one core, every key is."""

    def __init__(self, fn: Callable[[T], R], keys: Sequence[T], name: str) -> None:
        self.fn = fn
        self.thread: threading.Thread | None = None
        order = deque((key, Future()) for key in dict.fromkeys(keys)) if cpu_share() >= 2 else []
        self.left: dict[T, Future] = dict(order)
        if order:
            self.thread = threading.Thread(target=self._work, args=(order,), name=name, daemon=True)
            self.thread.start()

    def _work(self, order: deque[tuple[T, Future]]) -> None:
        # (each popped: a result is held by ``left`` only, and let go once taken)
        while order:
            key, done = order.popleft()
            if done.set_running_or_notify_cancel():  # (False: cancelled, taken or left)
                _run(done, self.fn, (key,), {})
            del done

    def take(self, key: T) -> R:
        done = self.left.pop(key, None)
        if done is None or done.cancel():  # (cancel: not begun yet, so begun here instead)
            return self.fn(key)
        return done.result()

    def __enter__(self) -> InOrder[T, R]:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_exc) -> None:
        for done in self.left.values():
            done.cancel()
        self.left = {}
        if self.thread is not None and not (kind and issubclass(kind, KeyboardInterrupt)):
            self.thread.join()
