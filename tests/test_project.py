"""Step projection (:mod:`traceclf.ingest.project`): the correlation ids of a step's CUDA calls
from the few calls at each end of its rowid range, against every call of the step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import polars as pl
import pytest
from conftest import FIXTURES

from traceclf.ingest import project, rowindex
from traceclf.ingest.schema import connect_readonly
from traceclf.model.taxonomy import bundled
from traceclf.pipeline import twopass
from traceclf.pipeline.twopass import event_rows


@contextlib.contextmanager
def sampled_projectors(path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """The usable projectors step sampling makes of ``path`` (a third of its rows), their
    connections kept open for searches after the read and closed at the end."""
    made: list[project.Projector] = []
    init = project.Projector.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    opened = []

    @contextlib.contextmanager
    def stays_open(at):  # the projectors' searches go on after the read
        opened.append(connect_readonly(at, check_same_thread=False))
        yield opened[-1]

    monkeypatch.setattr(project.Projector, "__init__", keep)
    monkeypatch.setattr(rowindex, "connect", stays_open)
    twopass.load_sampled(path, bundled(), budget=event_rows(path) // 3)
    try:
        yield [p for p in made if p.usable]
    finally:
        for con in opened:
            con.close()


@pytest.mark.parametrize(
    "name",
    [
        "h100_host_launch_gpumetrics_trimmed",  # thousands of calls a step
        "h100_moe_megatron_ep2",  # two ranks in one file, calls from several threads
        "h100_host_slow_loader",  # two CUDA threads
        "h100_nccl_groups",
    ],
)
def test_a_steps_first_and_last_call_ids_are_those_of_all_its_calls(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each projected step's (smallest, largest) correlation id, read from EDGE_CALLS calls at
    each end, equals the smallest and largest over all the rank's calls that start inside the
    step, computed here from the whole call table in polars."""
    path = FIXTURES / f"{name}.sqlite"
    with sampled_projectors(path, monkeypatch) as projectors:
        assert projectors
        calls = pl.read_database_uri(
            "SELECT start, (globalTid >> 24) & 16777215 AS pid, correlationId AS c "
            "FROM CUPTI_ACTIVITY_KIND_RUNTIME",
            f"sqlite://{path}",
        )
        checked = 0
        for p in projectors:
            mine = calls.filter(pl.col("pid") == p.pid)
            for i, (lo, hi) in enumerate(zip(p.starts, p.ends, strict=True)):
                inside = mine.filter(pl.col("start").is_between(lo, hi))["c"]
                want = None if inside.is_empty() else (int(inside.min()), int(inside.max()))
                assert p._calls(i) == want, (p.pid, i)
                checked += want is not None
        assert checked >= 5
        # the bound is reached: some step holds more calls than are read at its two ends
        most = max(
            calls.filter(pl.col("pid") == p.pid, pl.col("start").is_between(lo, hi)).height
            for p in projectors
            for lo, hi in zip(p.starts, p.ends, strict=True)
        )
        assert most > 2 * project.Projector.EDGE_CALLS


@pytest.mark.parametrize("name", ["h100_moe_megatron_ep2", "h100_host_slow_loader"])
def test_gpu_starts_found_two_at_a_time_are_those_found_one_by_one(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """find_starts finds every other step's GPU start on a second lane with a connection of its
    own (SQLite's work, beside the caller's): each step's start is the one gpu_start finds
    alone, on the caller's connection."""
    from traceclf.support import cpus

    path = FIXTURES / f"{name}.sqlite"
    monkeypatch.setattr(cpus, "cpus", lambda: 2)
    with sampled_projectors(path, monkeypatch) as projectors:
        assert projectors
        found = 0
        for p in projectors:
            steps = range(len(p.starts))
            alone = {i: p._first_start(i) for i in steps}
            p._starts.clear()
            p.find_starts(steps)
            assert p._starts == alone
            found += sum(v is not None for v in alone.values())
        assert found >= 10


@pytest.mark.parametrize(
    "name", ["h100_host_input_stall", "h100_moe_megatron_ep2", "h100_host_slow_loader"]
)
def test_whether_a_step_calls_the_allocator_is_whether_any_of_its_calls_does(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm-up's allocator test (``Projector.allocates``: the first allocator call among the
    step's calls answers) against every call of the rank that starts inside the step, its
    name matched here in polars over the whole call table."""
    path = FIXTURES / f"{name}.sqlite"
    pattern = bundled().cuda_api["alloc"]
    calls = pl.read_database_uri(
        "SELECT c.start, (c.globalTid >> 24) & 16777215 AS pid, c.nameId, s.value AS name "
        "FROM CUPTI_ACTIVITY_KIND_RUNTIME c LEFT JOIN StringIds s ON s.id = c.nameId",
        f"sqlite://{path}",
    ).with_columns(alloc=pl.col("name").str.contains(pattern).fill_null(False))
    ids = calls.filter(pl.col("alloc"))["nameId"].unique().to_list()
    with sampled_projectors(path, monkeypatch) as projectors:
        assert projectors
        seen = set()
        for p in projectors:
            mine = calls.filter(pl.col("pid") == p.pid)
            for i, (lo, hi) in enumerate(zip(p.starts, p.ends, strict=True)):
                want = bool(mine.filter(pl.col("start").is_between(lo, hi))["alloc"].any())
                assert p.allocates(i, ids) is want, (p.pid, i)
                assert p.allocates(i, []) is False
                seen.add(want)
    if name == "h100_host_input_stall":  # (its batch 1 still grows the allocator: issue 22)
        assert seen == {True, False}
