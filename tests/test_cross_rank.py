"""Across ranks: collective matching, wait vs transfer, clock alignment, the rank survey and
shared GPUs, on the real two-rank traces (h100_comm_ep2*: two processes time-slicing one H100),
on per-rank files split from them inside the test, and on CONSTRUCTED exports (tests/helpers/
constructed.py) for what no real trace shows: ranks on two hosts with skewed clocks and a late
rank, and ranks with unlike work."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from helpers.cli import run_cli
from helpers.constructed import Export
from realtraces import trace_path

from traceclf.judge.straggler import cross_rank_block
from traceclf.render.content import budget_rows
from traceclf.report.contract import Report

TWO_RANKS = ("h100_comm_ep2", "h100_comm_ep2_overlap")


def analyze(*paths: Path) -> dict:
    code, out, err = run_cli("analyze", *paths, "-f", "json", "-q", "--no-cache")
    assert code == 0, err
    return json.loads(out)


def nccl_counts(path: Path) -> dict[int, dict[str, int]]:
    """Independent count: NCCL kernels per process and kernel name, straight from SQLite."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    rows = con.execute(
        "SELECT (k.globalPid >> 24) & 16777215, s.value, count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k"
        " JOIN StringIds s ON s.id = k.demangledName WHERE s.value LIKE 'ncclDevKernel%'"
        " GROUP BY 1, 2"
    ).fetchall()
    con.close()
    out: dict[int, dict[str, int]] = {}
    for pid, name, n in rows:
        out.setdefault(pid, {})[name] = n
    return out


@pytest.mark.parametrize("name", TWO_RANKS)
def test_two_ranks_on_one_gpu_are_matched_and_no_straggler_is_claimed(name):
    path = trace_path(name)
    r = analyze(path)
    cr = r["cross_rank"]
    counts = list(nccl_counts(path).values())
    # every collective kernel has its partner on the other rank (same names, same counts)
    assert counts[0] == counts[1]
    assert cr["collectives_matched"] == sum(counts[0].values())
    assert cr["collectives_unmatched"] == 0
    # both processes time-slice GPU 0: recognised, so no straggler, skew or jitter verdict
    assert cr["shared_gpu"] == [[0, 1]]
    assert cr["straggler_rank"] is None and cr["compute_skew_frac"] is None
    assert "time-slice one GPU" in cr["verdict"] and "no straggler" in cr["verdict"]
    assert cr["rank_groups"] == [[0, 1]] and cr["representatives"] == [0, 1]
    assert cr["clock"]["aligned_by"] == "one export" and cr["clock"]["alignment_error_us"] == 0
    # issue 22: on one GPU, when a collective ends is the other process's doing, not waiting:
    # no wait or transfer share (they once read "wait 7.5%, transfer 92%"), and a note says why
    assert cr["comm_wait_frac"] is None and cr["comm_transfer_frac"] is None
    assert "time-slice one GPU" in cr["wait_transfer_note"]
    kinds = cr["comm_by_kind"]
    assert set(kinds) == {"all_to_all"}  # NCCL's NVTX ranges: the SendRecv kernels are all-to-all
    a2a = kinds["all_to_all"]
    assert a2a["comm_ms"] > 0 and a2a["wait_ms"] is None and a2a["transfer_ms"] is None
    assert cr["last_arriver_rank"] is None
    assert not any(r["id"] == "comm-straggler-rank" for r in r["classification"]["rules"])
    lines = dict(budget_rows(Report.from_dict(r)))
    assert "time-slice one GPU" in lines["Across ranks"]
    assert lines["Compute-absent"].startswith("launch-starved 0 ms · blocking")


def split_rank(src: Path, dst: Path, keep_pid: int, shift_ns: int = 0) -> Path:
    """A copy of ``src`` holding one process only (rows of the other processes deleted), its
    timestamps shifted by ``shift_ns`` and its session start moved back by the same amount, as
    if the rank had been captured by its own nsys session started ``shift_ns`` earlier."""
    shutil.copyfile(src, dst)
    with sqlite3.connect(dst) as con:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            cols = {r[1] for r in con.execute(f"PRAGMA table_info('{table}')")}
            for col in ("globalPid", "globalTid"):
                if col in cols:
                    con.execute(
                        f'DELETE FROM "{table}" WHERE {col} IS NOT NULL'
                        f" AND (({col} >> 24) & 16777215) != {keep_pid}"
                    )
            if table == "TARGET_INFO_CUDA_DEVICE":
                con.execute(f"DELETE FROM {table} WHERE pid != {keep_pid}")
            if shift_ns and table.startswith(("CUPTI_", "NVTX_", "PROFILER_", "CUDA_GPU_")):
                for col in ("start", "end", "timestamp"):
                    if col in cols:
                        con.execute(f'UPDATE "{table}" SET "{col}" = "{col}" + {shift_ns}')
        if shift_ns:
            con.execute(
                f"UPDATE TARGET_INFO_SESSION_START_TIME SET utcEpochNs = utcEpochNs - {shift_ns}"
            )
    con.close()
    return dst


@pytest.mark.parametrize("shift_ns", [0, 3_600_000_000_123])
@pytest.mark.parametrize("name", TWO_RANKS)
def test_per_rank_files_give_the_same_cross_rank_result(tmp_path, name, shift_ns):
    src = trace_path(name)
    together = analyze(src)
    pids = sorted(nccl_counts(src))
    files = [
        split_rank(src, tmp_path / f"rank{i}.sqlite", pid, shift_ns if i else 0)
        for i, pid in enumerate(pids)
    ]
    apart = analyze(*files)
    a, b = together["cross_rank"], apart["cross_rank"]
    # two exports, one host: rebased on TARGET_INFO_SESSION_START_TIME, nothing else
    assert b["clock"]["aligned_by"] == "session start"
    assert b["clock"]["offsets_us"]["1"] == pytest.approx(-shift_ns / 1e3, abs=1e-3)
    for key in (
        "collectives_matched",
        "collectives_unmatched",
        "shared_gpu",
        "rank_groups",
        "representatives",
        "straggler_rank",
        "last_arriver_rank",
    ):
        assert a[key] == b[key], key
    assert b["comm_wait_frac"] == pytest.approx(a["comm_wait_frac"], abs=1e-4)
    assert b["clock"]["end_spread_us"] == pytest.approx(a["clock"]["end_spread_us"], abs=0.01)
    for rank in (0, 1):
        ma, mb = together["ranks"][rank]["metrics"], apart["ranks"][rank]["metrics"]
        for key in ("compute_absent_frac", "blocking_comm_frac", "launch_starved_frac"):
            assert mb[key] == pytest.approx(ma[key], abs=1e-6), key


def two_hosts(tmp_path: Path, clock_error_ns: int) -> list[Path]:
    """CONSTRUCTED: ranks 0 and 1 on two hosts (own GPUs), ten all-reduces each; rank 1 reaches
    every one 600 µs late, so rank 0 waits inside each (700 µs against rank 1's 100 µs). Rank 1's session clock is read
    ``clock_error_ns`` wrong (its utcEpochNs is off by that much)."""
    paths = []
    for rank in (0, 1):
        x = Export(pid=100 + rank, host=f"node{rank}", gpu_uuid=f"GPU-{rank}")
        base = 50_000_000 * rank  # rank 1's session started 50 ms earlier: its times are later
        x.utc_epoch_ns = 1_700_000_000_000_000_000 - base + (clock_error_ns if rank else 0)
        for i in range(10):
            t = base + i * 1_000_000
            x.step(i, t, t + 10_000)
            late = 600_000 if rank else 0
            x.kernel("gemm", t + 1_000, t + 200_000 + late, launch_at=t + 100)
            name = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
            x.kernel(name, t + 200_000 + late, t + 900_000, launch_at=t + 200, stream=13)
        paths.append(x.write(tmp_path / f"rank{rank}.sqlite"))
    return paths


@pytest.mark.parametrize("clock_error_ns", [0, 40_000])
def test_two_hosts_are_aligned_on_collective_ends_and_the_late_rank_named(tmp_path, clock_error_ns):
    r = analyze(*two_hosts(tmp_path, clock_error_ns))
    cr = r["cross_rank"]
    assert cr["shared_gpu"] == []
    assert cr["collectives_matched"] == 10 and cr["collectives_unmatched"] == 0
    # rebased on the session starts, then refined: the 40 µs clock error is found and removed
    assert cr["clock"]["aligned_by"] == "session start + matched collective ends" or (
        clock_error_ns == 0 and cr["clock"]["aligned_by"] == "session start"
    )
    # rank 1's session truly started 50 ms before rank 0's
    assert cr["clock"]["offsets_us"]["1"] == pytest.approx(-50_000, abs=0.01)
    assert cr["clock"]["alignment_error_us"] == pytest.approx(0, abs=0.01)
    # transfer proxy: rank 1's 100 µs; rank 0 waited 600 µs more in each of the steady ones
    used = cr["comm_by_kind"]["all_reduce"]
    assert used["transfer_ms"] == pytest.approx(2 * 0.1 * used["instances"], rel=1e-6)
    assert used["wait_ms"] == pytest.approx(0.6 * used["instances"], rel=1e-6)
    assert cr["comm_wait_frac"] == pytest.approx(0.6 / 0.8, abs=1e-3)
    assert cr["last_arriver_rank"] == 1 and cr["last_arriver_share"] == 1.0
    assert "rank 1 arrives last" in cr["verdict"] and "not the fabric" in cr["verdict"]


def rank(i: int, step_ms: float, compute_frac: float, kinds: dict[str, int], kernels: float):
    """CONSTRUCTED reduce-step input of one rank (what the map step hands over)."""
    return {
        "rank": i,
        "metrics": {
            "step_time_ms": step_ms,
            "compute_frac": compute_frac,
            "kernels_per_step": kernels,
        },
        "comm_by_kind": {k: {"kernels": n * 4} for k, n in kinds.items()},
        "steps": {"used": 4},
        "clock": {"export": f"r{i}.sqlite", "host": f"node{i}", "gpu": f"GPU-{i}"},
        "collectives": {},
        "window": [0, 1],
    }


def test_survey_groups_like_ranks_and_never_compares_unlike_ones():
    # ranks 0-2 do the same work (rank 2 computes 30% more: a straggler); rank 3 is another
    # pipeline stage (send/recv, fewer kernels) and is slower still, but not comparable
    ranks = [
        rank(0, 100.0, 0.5, {"all_reduce": 2}, 400),
        rank(1, 101.0, 0.5, {"all_reduce": 2}, 410),
        rank(2, 102.0, 0.65, {"all_reduce": 2}, 400),
        rank(3, 130.0, 0.9, {"send_recv": 6}, 150),
    ]
    cr = cross_rank_block(ranks)
    assert cr["rank_groups"] == [[0, 1, 2], [3]]
    assert cr["representatives"] == [1, 3]  # slowest (3) + the median-step rank of [0, 1, 2]
    assert cr["straggler_rank"] == 2
    # skew within the group only: (65 - 50) / mean(50, 50.5, 66.3)
    compute = [50.0, 50.5, 66.3]
    assert cr["compute_skew_frac"] == pytest.approx((66.3 - 50) / (sum(compute) / 3), abs=1e-3)
    assert cr["step_time_skew_frac"] == pytest.approx(2 / 101, abs=1e-3)


def test_ranks_sharing_a_gpu_are_left_out_of_the_skew():
    ranks = [rank(i, 100.0 + i, 0.5 + 0.1 * i, {"all_to_all": 8}, 129) for i in range(3)]
    for r in ranks[:2]:
        r["clock"]["gpu"] = "GPU-shared"
    cr = cross_rank_block(ranks)
    assert cr["shared_gpu"] == [[0, 1]]
    assert cr["straggler_rank"] is None  # only rank 2 is left unshared: nothing to compare


def test_ranks_that_may_share_a_gpu_get_no_jitter_verdict():
    """Two ranks that saw "device 0" in exports that do not map it to a GPU (capture block:
    gpu_assignment "unknown"): maybe one GPU, maybe two, so neither skew nor verdict."""
    ranks = [rank(i, 100.0 + 5 * i, 0.5 + 0.2 * i, {"all_reduce": 2}, 400) for i in range(2)]
    for r in ranks:
        r["clock"]["gpu"] = "device0"
    cr = cross_rank_block(ranks, {"gpu_assignment": "unknown"})
    assert cr["shared_gpu"] == [] and cr["straggler_rank"] is None
    assert "cannot say whether it is one GPU" in cr["straggler_note"]
    assert "no straggler or jitter verdict" in cr["verdict"]


def test_straggler_needs_a_skew_beyond_the_noise():
    ranks = [rank(i, 100.0, 0.5 + 0.01 * i, {"all_reduce": 2}, 400) for i in range(2)]
    for r in ranks:
        r["metrics"]["step_time_cv"] = 0.1  # steps vary by 10%: a 2% compute skew is noise
    cr = cross_rank_block(ranks, {"gpu_assignment": "own"})
    assert cr["straggler_rank"] is None and cr["noise_band_frac"] == pytest.approx(0.2)
    assert "noise band" in cr["straggler_note"]


def test_waiting_on_a_small_communication_share_is_not_called_the_fix():
    """ulysses_2gpu_forward_window: most of the matched all-to-all time is waiting (rank 1
    arrives last), but communication with no compute beside it is ~4% of the step, so the
    late rank costs a few % at most: the verdict says so instead of "fix the late rank"."""
    r = analyze(trace_path("ulysses_2gpu_forward_window"))
    cr = r["cross_rank"]
    exposed = [rank["metrics"]["exposed_comm_frac"] for rank in r["ranks"]]
    cost = cr["comm_wait_frac"] * sum(exposed) / len(exposed)
    assert cr["comm_wait_frac"] >= 0.5 and cost < 0.05
    assert "fix the late rank" not in cr["verdict"] and "not worth chasing" in cr["verdict"]
    assert f"at most {cost:.1%}" in cr["verdict"]


def test_waiting_verdict_keeps_its_advice_when_the_wait_costs_much():
    """CONSTRUCTED reduce-step input: the same wait share on 30% exposed communication."""
    ranks = [rank(i, 100.0, 0.5, {"all_reduce": 2}, 400) for i in (0, 1)]
    for r in ranks:
        r["metrics"]["exposed_comm_frac"] = 0.3
    cr = {"comm_wait_frac": 0.6, "last_arriver_rank": 1, "shared_gpu": []}
    from traceclf.judge.straggler import verdict
    from traceclf.measures.cross_rank import exposed_comm

    assert "fix the late rank" in verdict(cr, [], exposed_comm(ranks))
    assert "not worth chasing" in verdict(cr, [], 0.04)


def test_ranks_of_unknown_placement_get_no_wait_or_transfer_rule(tmp_path):
    """h100_comm_ep2 with TARGET_INFO_GPU and TARGET_INFO_CUDA_DEVICE dropped (a CONSTRUCTED
    copy, as exports without GPU tables look): both ranks report device 0 and nothing says
    whether it is one GPU, so the report must not read their collectives as transfer or
    waiting in the rules either (the two processes in fact time-slice one H100)."""
    path = shutil.copyfile(trace_path("h100_comm_ep2"), tmp_path / "ep2_no_gpu_tables.sqlite")
    con = sqlite3.connect(path)
    con.execute("DROP TABLE TARGET_INFO_GPU")
    con.execute("DROP TABLE TARGET_INFO_CUDA_DEVICE")
    con.commit()
    con.close()
    r = analyze(path)
    assert r["capture"]["gpu_assignment"] == "unknown"
    assert "no straggler or jitter verdict" in r["cross_rank"]["verdict"]
    fired = {rule["id"] for rule in r["classification"]["rules"]}
    assert not fired & {"comm-transfer-dominates", "comm-wait-dominates"}
    assert not any("transfer" in e for e in r["classification"]["evidence"])
    assert r["classification"]["bound"] == "communication"


def _late_case(analysed: int, mean_ms: float) -> tuple:
    """Constructed (no real trace has drifted matches in few rows): two ranks, four matched
    collectives a 10 ms step apart; rank 1 starts the second and third 2 ms after rank 0, and
    the fourth 50 ms after it, later than any step lasts (a match that drifted)."""
    import polars as pl

    from traceclf.measures.arrivals import late_arrivals, packed

    ms = 1_000_000
    starts = {0: [0, 10 * ms, 20 * ms, 30 * ms], 1: [0, 12 * ms, 22 * ms, 80 * ms]}
    rows = [
        {
            "rank": rank,
            "ordinal": "g0",
            "kind": "all_reduce",
            "instance": i,
            "row": i,
            "a_start": s,
            "a_end": s + ms // 10,
            "in_window": True,
        }
        for rank, ss in starts.items()
        for i, s in enumerate(ss)
    ]
    clock = {  # all compute: the stretch since the previous collective is compute
        rank: {
            "states": ["compute"],
            "first_row": 0,
            "at_start": packed(np.array([[s] for s in ss])),
            "at_end": packed(np.array([[s + ms // 10] for s in ss])),
        }
        for rank, ss in starts.items()
    }
    ranks = [
        {
            "rank": rank,
            "arrivals": clock[rank],
            "steps": {"analysed": analysed, "mean_ms": mean_ms, "durations_ms": [10.0] * 4},
        }
        for rank in starts
    ]
    return late_arrivals(pl.DataFrame(rows), ranks, [], {rank: analysed for rank in starts})


def test_arrival_clocks_travel_packed_and_come_back_exact():
    """A rank's arrival clock (ns in each state before each collective, launches before it)
    travels in its result packed (each column's steps, deflated, base64): the same integers
    come back, whatever their sign or size. Read back from a result file, a clock inflates to
    no more than arrival_clock writes (every collective it clocks, in every state it has), its
    columns as long as each other: a damaged or planted one is an error, not a guess."""
    import base64
    import zlib

    from traceclf.measures.arrivals import (
        MAX_COLLECTIVES,
        MAX_STATES,
        TOP_NAMES,
        _Clock,
        _unpacked,
        packed,
    )

    rng = np.random.default_rng(7)
    rows = np.cumsum(rng.integers(0, 10**9, (2000, 5)), axis=0)
    extremes = np.array([[2**62, -5], [-(2**62), 2**63 - 1], [0, -(2**63)]])
    for values, width in ((rows, 5), (extremes, 2), (rows[:, 0], None)):
        back = _unpacked(packed(values), width)
        assert back.dtype == np.int64 and np.array_equal(back, values)
        assert back.flags["C_CONTIGUOUS"]
    # a real clock's states mostly do not move from one collective to the next
    sparse = np.cumsum(rng.integers(0, 10**6, (2000, 5)) * (rng.random((2000, 5)) < 0.1), axis=0)
    assert len(packed(sparse)) * 10 < len(json.dumps(sparse.tolist()))
    assert _unpacked("", 3).shape == (0, 3) and _unpacked(None).shape == (0,)
    bomb = base64.b64encode(zlib.compress(bytes(MAX_COLLECTIVES * 5 * 8 + 8))).decode()
    for damaged in (bomb, packed(rows)[:-8], "not base64!", packed(rows) + packed(rows)):
        with pytest.raises(ValueError):
            _unpacked(damaged, 5)
    clock = {
        "states": [f"s{i}" for i in range(5)],
        "at_start": packed(rows),
        "at_end": packed(rows),
        "launches_at_start": {"k": packed(rows[:, 0])},
        "launches_at_end": {"k": packed(rows[:, 0])},
    }
    assert np.array_equal(_Clock(clock).ends["k"], rows[:, 0])
    for planted in (
        {"at_end": packed(rows[:-1])},  # columns of other lengths
        {"launches_at_end": {"k": packed(rows[:-1, 0])}},
        {"states": [f"s{i}" for i in range(MAX_STATES + 1)]},  # more than it writes
        {"launches_at_start": {f"k{i}": packed(rows[:, 0]) for i in range(TOP_NAMES + 1)}},
    ):
        with pytest.raises(ValueError):
            _Clock(clock | planted)


def test_a_rank_later_than_a_step_is_a_drifted_match_not_a_late_rank():
    """Ranks wait at a collective inside one of their steps: the instance 50 ms late (steps
    last 10 ms) is left out and counted; the two 2 ms late ones stay, 4 ms over 3 steps."""
    late, left_out = _late_case(analysed=3, mean_ms=10.0)
    assert left_out == 1
    (rank1,) = late
    assert rank1["rank"] == 1 and rank1["instances"] == 2
    assert rank1["late_ms_per_step"] == pytest.approx(4 / 3, abs=1e-4)
    # the causes still add up to the lateness
    assert sum(c["ms_per_step"] for c in rank1["causes"]) == pytest.approx(4 / 3, abs=1e-3)


def test_a_rank_later_per_step_than_a_step_lasts_is_left_out_whole():
    """4 ms of lateness in one analysed step whose ranks' mean step is 1 ms cannot be waited
    for inside it: the rank is not listed, its instances are counted as left out."""
    late, left_out = _late_case(analysed=1, mean_ms=1.0)
    assert late == [] and left_out == 3


def test_an_instance_whose_ranks_end_a_step_apart_is_unmatched():
    """Constructed: ranks end a collective together, inside a step; an instance whose ends lie
    further apart than the longest step (10 ms) pairs two different collectives and is
    unmatched (instance null), the others stay; without steps nothing bounds it."""
    import polars as pl

    from traceclf.measures.collectives import longest_step_ns, undrifted

    ms = 1_000_000
    matched = pl.DataFrame(
        {
            "rank": [0, 1, 0, 1],
            "ordinal": ["g0"] * 4,
            "kind": ["all_reduce"] * 4,
            "instance": [0, 0, 1, 1],
            "a_end": [5 * ms, 9 * ms, 20 * ms, 70 * ms],
        }
    )
    ranks = [{"steps": {"durations_ms": [8.0, 10.0]}}, {"steps": {"durations_ms": [9.0]}}]
    assert longest_step_ns(ranks) == 10 * ms
    assert undrifted(matched, longest_step_ns(ranks))["instance"].to_list() == [0, 0, None, None]
    assert undrifted(matched, longest_step_ns([{}, {}]))["instance"].to_list() == [0, 0, 1, 1]


def _sampled_rank(rank: int, starts_ms: list[int], spans_ms: list[tuple[int, int]]) -> dict:
    """A rank of one export with step sampling: the all-reduces it read (each 1 ms long,
    ending with the other rank's: a collective completes on all participants together), its
    analysed spans and their steps (10 ms each)."""
    ms = 1_000_000
    n = len(starts_ms)
    return {
        "rank": rank,
        "clock": {"export": "one.sqlite"},
        "window": [spans_ms[0][0] * ms, spans_ms[-1][1] * ms],
        "steps": {"analysed": 20, "durations_ms": [10.0] * 20, "mean_ms": 10.0},
        "collectives": {
            "spans": [[lo * ms, hi * ms] for lo, hi in spans_ms],
            "steps": [
                (t * ms, (t + 10) * ms) for lo, hi in spans_ms for t in range(lo, hi - 9, 10)
            ],
            "stream_id": [7] * n,
            "kind": ["all_reduce"] * n,
            "start": [s * ms for s in starts_ms],
            "end": [(s + 1) * ms for s in starts_ms],
            "group": ["0xabc"] * n,
            "call": ["ncclAllReduce"] * n,
            "msg_bytes": [1024] * n,
        },
    }


def test_sampled_runs_are_matched_run_by_run():
    """Constructed (the real two-rank fixtures are read whole: small): an all-reduce every
    10 ms; each rank analysed two runs of ten steps, [0, 100) and [1000, 1100) ms, and read
    rows past a run's end: rank 0 twelve more collectives after its first run, rank 1 none.
    Numbered from the first collective, rank 0's second run would be 12 collectives ahead,
    beyond the shift matching tries; matched run by run every pair ends together, and the
    collectives outside the runs both ranks analysed are left out, not unmatched."""
    from traceclf.measures.collectives import matched

    run0, run1 = list(range(0, 100, 10)), list(range(1000, 1100, 10))
    extra = list(range(100, 220, 10))
    ranks = [
        _sampled_rank(0, run0 + extra + run1, [(0, 100), (1000, 1100)]),
        _sampled_rank(1, run0 + run1, [(0, 100), (1000, 1100)]),
    ]
    m = matched(ranks)
    full = m.instances.filter(pl.col("instance").is_not_null())
    ends = full.group_by("instance").agg(pl.col("a_end").n_unique(), pl.len())
    assert ends.height == 20 and ends["a_end"].to_list() == [1] * 20
    assert ends["len"].to_list() == [2] * 20
    assert m.waits["collectives_matched"] == 20 and m.waits["collectives_unmatched"] == 0
    # the late-arrival walk counts the steps the matched collectives come from
    assert m.steps_matched(ranks[0]) == m.steps_matched(ranks[1]) == 20


def test_ranks_that_analysed_no_time_in_common_match_nothing():
    """Constructed: runs of steps that never overlap across ranks (plans apart, or a clock
    read far off) leave nothing to match: no instance, no step to count, and no error."""
    from traceclf.measures.collectives import matched

    ranks = [
        _sampled_rank(0, [0, 10, 20, 500, 510], [(0, 30), (500, 530)]),
        _sampled_rank(1, [40, 50, 60, 600, 610], [(40, 70), (600, 630)]),
    ]
    m = matched(ranks)
    assert m.waits["collectives_matched"] == 0 and m.waits["collectives_unmatched"] == 0
    assert m.instances.is_empty()
    assert m.steps_matched(ranks[0]) == 1  # (no step: per step of one, never a division by 0)


def test_steps_cut_by_the_shared_runs_count_whole():
    """Constructed: rank 1's steps start 5 ms after rank 0's, so the runs both analysed cut
    every step of each; the late-arrival walk still counts each rank's ten steps per run
    (their collectives are matched, bar those the cut leaves out), not half as many."""
    from traceclf.measures.collectives import matched

    run0, run1 = list(range(10, 100, 10)), list(range(1010, 1100, 10))
    ranks = [
        _sampled_rank(0, run0 + run1, [(0, 100), (1000, 1100)]),
        _sampled_rank(1, run0 + run1, [(5, 105), (1005, 1105)]),
    ]
    m = matched(ranks)
    assert m.waits["collectives_matched"] == 18
    assert [m.steps_matched(r) for r in ranks] == [20, 20]


def test_runs_every_rank_analysed_are_where_their_spans_meet():
    """Constructed: the shared runs are the times all ranks analysed (on the common clock);
    none when each rank analysed one span (then one sequence from the capture's start)."""
    from traceclf.measures.collectives import shared_runs

    ms = 1_000_000
    a = _sampled_rank(0, [5], [(0, 100), (1000, 1100)])
    b = _sampled_rank(1, [5], [(2, 90), (95, 102), (1010, 1200)])
    assert shared_runs([a, b], {0: 0, 1: 0}) == [
        (2 * ms, 90 * ms),
        (95 * ms, 100 * ms),
        (1010 * ms, 1100 * ms),
    ]
    # rank 1's clock 5 ms behind: its spans move onto rank 0's clock
    assert shared_runs([a, b], {0: 0, 1: 5 * ms})[0] == (7 * ms, 95 * ms)
    whole = _sampled_rank(1, [5], [(0, 1200)])
    assert shared_runs([_sampled_rank(0, [5], [(0, 1100)]), whole], {0: 0, 1: 0}) is None


@pytest.mark.parametrize("clock_error_ms", [0, 20])
def test_ranks_on_hosts_whose_clocks_stay_apart_get_no_wait_or_late_claim(tmp_path, clock_error_ms):
    """ulysses_2gpu_forward_window split into per-rank files (tests/helpers/files.py), rank 1 on
    another host whose session clock is read ``clock_error_ms`` wrong. Aligned on matched
    collective ends, right clocks agree within 22 µs (p95) and rank 1 is late; 20 ms apart,
    more than the collectives matching can shift by, the matches pair other collectives (the
    ends still disagree by ms once aligned): no wait, last rank or late arrival is claimed
    (it named rank 0 late, wrongly), and the note says why."""
    from helpers.files import split_ranks
    from helpers.independent import rank_pids

    src = trace_path("ulysses_2gpu_forward_window")
    files = split_ranks(src, tmp_path, rank_pids(src), ["rank_0.sqlite", "rank_1.sqlite"])
    with sqlite3.connect(files[1]) as con:
        con.execute(
            "UPDATE TARGET_INFO_SESSION_START_TIME SET utcEpochNs = utcEpochNs + ?",
            (clock_error_ms * 1_000_000,),
        )
        con.execute("UPDATE TARGET_INFO_SYSTEM_ENV SET value = 'node1' WHERE name = 'Hostname'")
    con.close()
    cr = analyze(*files, "--all-steps")["cross_rank"]
    clock = cr["clock"]
    assert clock["aligned_by"] == "session start + matched collective ends"
    if clock_error_ms == 0:
        assert clock["alignment_error_us"] < 100
        assert [x["rank"] for x in cr["late_arrivals"]][:1] == [1]
        assert cr["comm_wait_frac"] is not None and cr["wait_transfer_note"] is None
    else:
        assert clock["alignment_error_us"] > 1000
        assert cr["late_arrivals"] == [] and cr["late_arrivals_left_out"] > 0
        assert cr["comm_wait_frac"] is None and cr["last_arriver_rank"] is None
        assert "clocks not aligned" in cr["wait_transfer_note"]
