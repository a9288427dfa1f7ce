"""map_exports: in-process, local process pool and Dask give the same results, in order."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from realtraces import trace_path

from traceclf.ingest.load import load_trace
from traceclf.ingest.schema import inspect_export
from traceclf.model.trace import Trace
from traceclf.pipeline import parallel
from traceclf.pipeline.parallel import map_exports
from traceclf.support import cpus
from traceclf.support.errors import TraceError

SMALL = ("h100_host_input_stall.sqlite", "h100_compute_low_occupancy.sqlite")


def assert_same_traces(a: list[Trace], b: list[Trace]) -> None:
    assert [t.path for t in a] == [t.path for t in b]
    for ta, tb in zip(a, b, strict=True):
        for name in ("kernels", "api", "copies", "nvtx"):  # frames with a deterministic order
            assert getattr(ta, name).equals(getattr(tb, name)), name


def test_one_item_or_one_job_runs_in_process() -> None:
    # A lambda cannot be pickled, so these only pass if nothing is sent to another process.
    assert map_exports(lambda x: x * 2, [1, 2, 3], jobs=1) == [2, 4, 6]
    assert map_exports(lambda x: x * 2, [5], jobs=4) == [10]
    assert map_exports(lambda x: x, []) == []


def test_local_pool_keeps_input_order() -> None:
    items = list(range(-12, 0))
    assert map_exports(abs, items, jobs=2, quiet=True) == [abs(i) for i in items]


def test_local_pool_reraises_original_type() -> None:
    with pytest.raises(ValueError, match="invalid literal"):
        map_exports(int, ["1", "x", "3"], jobs=2, quiet=True)


def test_local_pool_runs_real_loads_like_in_process() -> None:
    paths = [trace_path(name) for name in SMALL]
    assert_same_traces(
        map_exports(load_trace, paths, jobs=2, quiet=True), [load_trace(p) for p in paths]
    )


def test_workers_keep_freed_pages_for_the_next_export(monkeypatch: pytest.MonkeyPatch) -> None:
    # polars (imported here) wrote its own allocator settings to the variable; a worker
    # appends a longer decay, which jemalloc reads last and so applies.
    import polars  # noqa: F401

    conf = parallel.JEMALLOC_CONF
    seen = map_exports(os.getenv, [conf, conf], jobs=2, quiet=True)
    assert seen == [f"{os.environ[conf]},{parallel.WORKER_DIRTY_DECAY}"] * 2
    # A user's own decay (polars appends it after its own) is theirs to keep.
    mine = f"{os.environ[conf]},dirty_decay_ms:0"
    monkeypatch.setenv(conf, mine)
    assert map_exports(os.getenv, [conf, conf], jobs=2, quiet=True) == [mine] * 2


def test_a_users_own_decay_is_seen_before_polars_is_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A parent that has not imported polars yet (a re-analysis whose rules are stamped) holds
    # the user's variable as the user wrote it: one decay there is the user's.
    conf = parallel.JEMALLOC_CONF
    monkeypatch.delitem(sys.modules, "polars")
    monkeypatch.setenv(conf, "dirty_decay_ms:0")
    assert parallel._users_decay()
    monkeypatch.delenv(conf)
    assert not parallel._users_decay()


def test_workers_size_every_thread_pool_to_their_share(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two workers on this machine's CPUs: each pool (polars', rayon's that connectorx reads
    # on, OpenBLAS's) gets half of them, unless the user sized it.
    for pool in parallel.WORKER_POOLS:
        monkeypatch.delenv(pool, raising=False)
    share = str(max(1, cpus.cpus() // 2))
    pools = list(parallel.WORKER_POOLS)
    assert map_exports(os.getenv, pools, jobs=2, quiet=True) == [share] * len(pools)
    monkeypatch.setenv("RAYON_NUM_THREADS", "7")
    assert map_exports(os.getenv, ["RAYON_NUM_THREADS"] * 2, jobs=2, quiet=True) == ["7"] * 2


def _worker_state(_item: object) -> tuple[int, bool]:
    return os.getpid(), cpus.in_worker()


def _no_op() -> None:
    pass


def test_started_workers_are_the_ones_that_map(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpus.WORKER_CPUS, raising=False)
    assert not cpus.in_worker()
    with parallel.started_workers(2, 4, _no_op) as pool:
        assert pool is not None
        processes = list(pool._processes.values())  # type: ignore[attr-defined]
        started = {p.pid for p in processes}
        seen = map_exports(_worker_state, range(4), jobs=2, quiet=True, pool=pool)
    assert len(started) == 2
    assert {pid for pid, _ in seen} <= started
    assert all(in_worker for _, in_worker in seen)
    assert not any(p.is_alive() for p in processes)  # stopped on leaving


def test_no_workers_where_the_map_runs_here() -> None:
    for jobs, items in ((1, 5), (4, 1), (None, 0)):
        with parallel.started_workers(jobs, items, _no_op) as pool:
            assert pool is None


def test_started_workers_stop_when_the_checks_fail(tmp_path: Path) -> None:
    # Workers start before the rules are read: a bad rules folder still fails in one line,
    # and leaves no process behind.
    from helpers.cli import run_cli

    exports = [trace_path(name) for name in SMALL]
    before = set(multiprocessing.active_children())
    code, _out, err = run_cli(
        "analyze", *exports, "--jobs", "2", "--rules", tmp_path / "absent", "-q"
    )
    assert code == 2
    assert "rules folder not found" in err and len(err.strip().splitlines()) == 1
    assert set(multiprocessing.active_children()) <= before


def test_a_worker_keeps_its_c_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    # Trimming the C heap after a read lowers one analysis's peak; a worker's next export
    # reuses those pages instead.
    from traceclf.ingest import reader

    trims: list[int] = []
    libc = types.SimpleNamespace(malloc_trim=trims.append)
    monkeypatch.setattr(reader.ctypes, "CDLL", lambda _name: libc)
    monkeypatch.setattr(reader.sys, "platform", "linux")
    monkeypatch.delenv(cpus.WORKER_CPUS, raising=False)
    reader.release_read_buffers()
    assert trims == [0]
    monkeypatch.setenv(cpus.WORKER_CPUS, "1")
    reader.release_read_buffers()
    assert trims == [0]


def test_trace_error_pickles() -> None:
    error = pickle.loads(pickle.dumps(TraceError("/x.sqlite", "bad")))
    assert (error.path, error.problem, str(error)) == ("/x.sqlite", "bad", "/x.sqlite: bad")


def test_trace_error_from_local_worker(tmp_path: Path) -> None:
    paths = [trace_path(SMALL[0]), tmp_path / "absent.sqlite"]
    with pytest.raises(TraceError, match="no such file"):
        map_exports(inspect_export, paths, jobs=2, quiet=True)


def test_quiet_writes_nothing_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    map_exports(abs, [-1, -2, -3], jobs=1, quiet=True)
    assert capfd.readouterr().err == ""


@pytest.fixture(scope="module")
def dask_address():
    distributed = pytest.importorskip("distributed")
    # One worker process: results and exceptions really cross a pickle boundary.
    with distributed.LocalCluster(
        n_workers=1,
        threads_per_worker=2,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.CRITICAL,
    ) as c:
        yield c.scheduler_address


def test_dask_runs_real_loads_like_in_process(dask_address: str) -> None:
    paths = [trace_path(name) for name in SMALL]
    assert_same_traces(
        map_exports(load_trace, paths, dask_address=dask_address, quiet=True),
        [load_trace(p) for p in paths],
    )


def test_dask_reraises_original_type(dask_address: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid literal"):
        map_exports(int, ["1", "x"], dask_address=dask_address, quiet=True)
    with pytest.raises(TraceError, match="no such file"):
        map_exports(
            inspect_export, [tmp_path / "absent.sqlite"], dask_address=dask_address, quiet=True
        )


def test_unreachable_dask_is_a_trace_error(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("distributed")
    monkeypatch.setattr(parallel, "DASK_CONNECT_TIMEOUT", "1s")
    with pytest.raises(TraceError, match="cannot reach the Dask scheduler"):
        map_exports(abs, [1, 2], dask_address="tcp://127.0.0.1:9", quiet=True)


@pytest.mark.parametrize(("share", "beside"), [("1", False), ("2", True)])
def test_the_second_lane_is_a_thread_only_with_two_cores_to_keep_busy(
    share: str, beside: bool, monkeypatch
) -> None:
    """measure_rank's GPU-side measures run beside the host side on a thread of their own
    when the analysis may keep two cores busy, on the calling thread in a --jobs worker with
    one core; an error in the lane is raised by ``result()``; the thread is a daemon, so that
    Ctrl-C or SIGTERM in the main thread does not wait for the lane's work."""
    import threading

    monkeypatch.setattr(cpus, "cpus", lambda: 2)
    monkeypatch.setenv(cpus.WORKER_CPUS, share)
    seen = []

    def where() -> tuple[bool, bool]:
        me = threading.current_thread()
        return me is not threading.main_thread(), me.daemon

    with cpus.second_lane("test-lane") as lane:
        seen.append(lane.submit(where).result())
        failed = lane.submit(lambda: 1 // 0)
        with pytest.raises(ZeroDivisionError):
            failed.result()
    assert seen == [(beside, beside)]


@pytest.mark.parametrize("share", ["1", "2"])
def test_two_at_a_time_keeps_order_and_raises_the_first_error(share: str, monkeypatch) -> None:
    """The ranks of one export are measured two at a time (this thread and a daemon beside
    it) when two cores may be kept busy, one after another in a --jobs worker with one core:
    results in the items' order either way; after an error no item is begun, and the first
    error in order is raised once the items begun are done."""
    monkeypatch.setattr(cpus, "cpus", lambda: 2)
    monkeypatch.setenv(cpus.WORKER_CPUS, share)
    threads: set[str] = set()
    begun: list[int] = []
    lock = threading.Lock()

    def slow_square(x: int) -> int:
        with lock:
            threads.add(threading.current_thread().name)
            begun.append(x)
        time.sleep(0.02 * (x % 3))  # (items finish out of order)
        if x in (5, 6):
            raise ValueError(x)
        return x * x

    assert cpus.two_at_a_time(slow_square, list(range(5)), "test-rank") == [x * x for x in range(5)]
    assert len(threads) == (2 if share == "2" else 1)
    begun.clear()
    with pytest.raises(ValueError, match=r"^5$"):
        cpus.two_at_a_time(slow_square, list(range(20)), "test-rank")
    # every item up to the failed one was begun, and after it at most the one or two the
    # other thread took before the error was known
    assert set(range(6)) <= set(begun) and max(begun) <= 7 and len(begun) == len(set(begun))
    assert not any(t.name == "test-rank" for t in threading.enumerate())


def test_two_at_a_time_lets_ctrl_c_go_at_once(monkeypatch) -> None:
    """Ctrl-C (KeyboardInterrupt) in this thread's item is raised at once: the item on the
    daemon thread beside it is not waited for."""
    monkeypatch.setattr(cpus, "cpus", lambda: 2)
    monkeypatch.delenv(cpus.WORKER_CPUS, raising=False)

    def item(_x: int) -> None:
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        time.sleep(3)

    began = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        cpus.two_at_a_time(item, [0, 1], "test-rank")
    assert time.perf_counter() - began < 2


@pytest.mark.parametrize("share", ["1", "2"])
def test_in_order_computes_ahead_and_leaves_no_thread(share: str, monkeypatch) -> None:
    """The tables of a whole read are read one after another beside the build (a daemon when
    two cores may be kept busy, else on the calling thread as each is taken): every key gives
    fn's result, whatever the order it is taken in or how often; an error is raised where its
    key is taken; leaving the block early begins no more keys and waits for the one under
    way."""
    monkeypatch.setattr(cpus, "cpus", lambda: 2)
    monkeypatch.setenv(cpus.WORKER_CPUS, share)
    threads: list[tuple[int, str]] = []

    def square(x: int) -> int:
        threads.append((x, threading.current_thread().name))
        time.sleep(0.01)
        if x == 3:
            raise ValueError(x)
        return x * x

    with cpus.InOrder(square, [0, 1, 2, 3, 4], "test-reads") as reads:
        assert [reads.take(x) for x in (0, 1, 4, 2, 2, 7)] == [0, 1, 16, 4, 4, 49]
        with pytest.raises(ValueError, match=r"^3$"):
            reads.take(3)
    assert sorted(x for x, _ in threads) == [0, 1, 2, 2, 3, 4, 7]
    ahead = {x for x, name in threads if name == "test-reads"}
    assert ahead <= {0, 1, 2, 3, 4} and (bool(ahead) == (share == "2"))
    assert not any(t.name == "test-reads" for t in threading.enumerate())

    threads.clear()
    with cpus.InOrder(square, list(range(100)), "test-reads") as reads:
        assert reads.take(0) == 0
    # the block left after one key: at most the key under way was begun after it
    assert len(threads) <= 3
    assert not any(t.name == "test-reads" for t in threading.enumerate())


def test_a_whole_read_reads_ahead_in_the_order_the_build_takes(monkeypatch) -> None:
    """load_trace reads a whole export's tables ahead of the build in READ_ORDER: the order in
    which build_trace takes them, each once (a table out of that order would be read on the
    build's thread, one never taken read for nothing)."""
    from traceclf.ingest import load
    from traceclf.ingest.assemble import READ_ORDER
    from traceclf.ingest.reader import Reader

    monkeypatch.setenv(cpus.WORKER_CPUS, "1")  # (every table read as the build takes it)
    taken: list[str] = []
    real = Reader.read

    def read(self, logical, *args, **kwargs):
        taken.append(logical)
        return real(self, logical, *args, **kwargs)

    monkeypatch.setattr(Reader, "read", read)
    load.load_trace(trace_path(SMALL[0]))
    assert [t for t in taken if t in READ_ORDER] == list(READ_ORDER)


def test_a_read_on_one_thread_leaves_the_others_running() -> None:
    """Step sampling reads the memory events on a thread while pass 1 plans on another: a read
    must not hold the GIL while SQLite works (connectorx's Arrow stream did, and pass 1 stood
    still for the whole read). The CUDA calls of a real export are read on a thread with a
    condition that keeps SQLite busy on every row (counting to 1000 in a subquery of the row);
    the calling thread, ticking every millisecond, is never held for more than a part of it."""
    from traceclf.ingest.reader import Reader

    reader = Reader(inspect_export(trace_path(SMALL[0]), check_pages=False))
    busy = (
        "(WITH RECURSIVE n(x) AS (SELECT start % 2 UNION ALL SELECT x + 1 FROM n LIMIT 1000) "
        "SELECT count(*) FROM n) > 0"
    )
    done = threading.Event()
    took: list[float] = []

    def read() -> None:
        t = time.perf_counter()
        try:
            assert reader.read("api", where=busy).height == len(reader.read("api"))
        finally:
            took.append(time.perf_counter() - t)
            done.set()

    worker = threading.Thread(target=read)
    last = time.perf_counter()
    worst = 0.0
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    worker.join()
    assert took[0] > 0.05  # (long enough to tell the two apart: 0.7 s on the 2-core CI machine)
    assert worst < took[0] / 2, (worst, took[0])
