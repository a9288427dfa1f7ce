"""Steps and steady-state windows on the real traces (expectations: ../shared/traces/README.md)."""

from __future__ import annotations

import itertools
import statistics

import polars as pl
import pytest
from realtraces import measured, trace_path

from traceclf.ingest.load import load_trace
from traceclf.steps.find import find_steps
from traceclf.support.errors import TraceError


@pytest.mark.parametrize(
    ("name", "label", "count"),
    [
        ("h100_host_input_stall.sqlite", "batch", 10),
        ("h100_memory_offload.sqlite", "step", 10),
        ("h100_host_cudagraph.sqlite", "step", 10),
        ("h100_comm_ep2.sqlite", "Iteration", 10),
    ],
)
def test_nvtx_steps_are_found_by_name(name, label, count):
    for steps, _ in measured(name):
        assert steps.source == "nvtx"
        assert steps.label == label
        assert steps.count == count
        # the first step pays for warm-up and is never in the steady state; a step after it
        # that still grows the allocator is warm-up too (input_stall's batch 1: issue 22)
        assert not steps.table["steady"][0]
        assert steps.used >= count - 3


def test_steps_are_projected_onto_the_gpu():
    """The CPU ranges of a GPU-bound run are ~1.3 ms; the GPU work they launch takes ~60 ms."""
    ((steps, _),) = measured("h100_compute_dense_gpumetrics.sqlite")
    assert 55 <= steps.durations().median() / 1e6 <= 65


def test_warmup_is_dropped_from_the_window():
    ((steps, _),) = measured("h100_memory_offload.sqlite")
    first = steps.table.row(0, named=True)
    assert first["duration"] > 5 * steps.durations().median()
    assert steps.window[0] >= first["gpu_start"] + first["duration"]
    assert 195 <= steps.durations().median() / 1e6 <= 215


def test_graph_launches_give_steps_without_nvtx():
    ((steps, _),) = measured("h100_compute_low_occupancy.sqlite")
    assert steps.source == "graph"
    assert steps.used >= 8
    assert 5.0 <= steps.durations().median() / 1e6 <= 5.7
    trace = load_trace(trace_path("h100_compute_low_occupancy.sqlite"))
    warmup_end = trace.graphs["start"].min()
    assert steps.window[0] >= warmup_end  # eager warm-up kernels are outside the window


def test_pattern_fallback_when_no_nvtx_and_no_graphs():
    trace = load_trace(trace_path("h100_memory_offload.sqlite"))
    bare = trace.__class__(**{**trace.__dict__, "nvtx": trace.nvtx.clear()})
    steps = find_steps(bare.for_pid(trace.rank_pids[0]))
    assert steps.source == "pattern"
    assert 190 <= steps.durations().median() / 1e6 <= 220


def test_step_range_regex_overrides_the_default():
    trace = load_trace(trace_path("h100_memory_offload.sqlite"))
    rank = trace.for_pid(trace.rank_pids[0])
    steps = find_steps(rank, r"^forward$")
    assert steps.source == "nvtx" and steps.label == "forward" and steps.count == 10


def test_bad_step_regex_is_a_clean_error():
    trace = load_trace(trace_path("h100_memory_offload.sqlite"))
    with pytest.raises(TraceError, match="not a valid regular expression") as raised:
        find_steps(trace, "([unclosed")
    assert "unclosed" in str(raised.value)
    assert "col(" not in str(raised.value) and "expression:" not in str(raised.value)


@pytest.mark.parametrize(
    ("regex", "reason"),
    [
        ("[", "(unclosed character class)"),
        ("(?<=step)", "look-around"),
        (r"(a)\1", "backreferences are not supported"),
    ],
)
def test_bad_step_regex_on_the_command_line_is_one_line(cli, regex, reason):
    code, out, err = cli("analyze", "--step-range", regex, trace_path("h100_comm_ep2.sqlite"))
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"traceclf: error: --step-range {regex!r} is not a valid regular")
    assert reason in line and "polars" not in line.lower() and "occurred" not in line


def test_step_range_that_matches_nothing_warns(cli):
    path = trace_path("h100_comm_ep2.sqlite")
    code, out, err = cli("analyze", "-q", "-f", "json", "--step-range", "^no such range$", path)
    assert code == 0 and out
    (line,) = err.splitlines()
    assert line.startswith("traceclf: warning: ") and "matched no NVTX range on 2 of 2" in line
    assert "steps came from pattern instead" in line
    quiet = cli("analyze", "-q", "-f", "json", "--step-range", "^Iteration", path)
    assert quiet.code == 0 and quiet.stderr == ""


def test_no_steps_at_all_is_one_window():
    trace = load_trace(trace_path("h100_host_input_stall.sqlite"))
    rank = trace.for_pid(trace.rank_pids[0])
    bare = rank.__class__(
        **{**rank.__dict__, "nvtx": rank.nvtx.clear(), "kernels": rank.kernels.head(3)}
    )
    steps = find_steps(bare)
    assert steps.source == "none" and steps.count == 0
    assert steps.window[1] > steps.window[0]


def test_both_ranks_of_a_two_rank_report_have_steps():
    ranks = measured("h100_comm_ep2.sqlite")
    assert len(ranks) == 2
    windows = [s.window for s, _ in ranks]
    assert windows[0] != windows[1]
    assert all(pl.Series(s.durations()).median() / 1e6 > 90 for s, _ in ranks)


@pytest.mark.parametrize(
    ("ratio", "agree"),
    [(1.0, True), (1.08, True), (0.93, True), (2.03, True), (0.334, True), (4.1, True),
     (1.5, False), (0.7, False), (2.6, False), (0.0, False),
     # issue 22: a kernel recurring hundreds of times per step is near some whole multiple
     # whatever the step; it is no second anchor (None), never one that "agrees"
     (0.0019, None), (0.0101, None), (40.4, None), (1 / 7.9, None)],
)  # fmt: skip
def test_two_anchors_agree_when_their_step_times_match_or_are_whole_multiples(ratio, agree):
    from traceclf.steps.find import anchors_agree
    from traceclf.steps.settings import bundled_settings

    assert anchors_agree(ratio, bundled_settings()) is agree


def test_a_second_anchor_cross_checks_the_step_on_real_traces():
    """On our traces the next anchor (graph replays, or a kernel that recurs once per step)
    implies the same step time as the NVTX steps, within 1%."""
    from traceclf.steps.find import find_steps

    for name in (
        "h100_comm_ep2.sqlite",
        "h100_host_cudagraph.sqlite",
        "h100_memory_offload.sqlite",
    ):
        trace = load_trace(trace_path(name))
        steps = find_steps(trace.for_pid(trace.rank_pids[0]))
        assert steps.source == "nvtx"
        assert steps.second["agrees"] and steps.second["ratio"] == pytest.approx(1, abs=0.01)


def test_a_second_anchor_at_a_whole_multiple_says_how_often_it_recurs():
    """The megatron-core MoE trace: a GEMM recurs once in two NVTX steps (its period, from the
    export's own launches, about twice the step); the capture block says so, where its time
    beside the step's read as a mismatch that "agrees"."""
    import sqlite3

    import traceclf
    from traceclf.render.capture_text import capture_rows

    export = trace_path("h100_moe_megatron_ep2.sqlite")
    report = traceclf.analyze(export)
    second = report.capture["second_anchor"]
    with sqlite3.connect(f"file:{export}?mode=ro", uri=True) as db:
        starts = [
            start
            for (start,) in db.execute(
                "SELECT k.start FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
                "ON s.id = k.shortName WHERE s.value = ? "
                "AND (k.globalPid >> 24) & 16777215 = ? "
                "ORDER BY k.start",
                (second["label"], report.ranks[0]["pid"]),
            )
        ]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    period_ms = statistics.median(gaps) / 1e6
    assert period_ms == pytest.approx(2 * report.steps["median_ms"], rel=0.08)
    assert second["agrees"] and second["median_ms"] == pytest.approx(period_ms, rel=0.05)
    text = dict(capture_rows(report))["Steps"]
    assert "agrees: it recurs once in 2 steps" in text


@pytest.mark.parametrize("first", ["a_kernel", "b_kernel"])
@pytest.mark.parametrize("by_id", [False, True])
def test_of_two_kernels_recurring_alike_the_step_pattern_is_the_first_to_run(first, by_id):
    """Constructed kernels (real exports replicated in time showed it): two kernels launched
    once per step each, same period, same count; the step pattern is the one that runs first,
    every time, named by text (``--all-steps``) or by string id (the first pass's probe): the
    grouping has no order, and a tie went either way."""
    from traceclf.steps.find import recurring_kernel
    from traceclf.steps.settings import bundled_settings

    second = "b_kernel" if first == "a_kernel" else "a_kernel"
    starts = [t for step in range(40) for t in (step * 1_000, step * 1_000 + 10)]
    names = [first, second] * 40
    ids = {"a_kernel": 10, "b_kernel": 9}
    kernels = pl.DataFrame(
        {
            "name": [ids[n] for n in names] if by_id else names,
            "start": starts,
            "end": [t + 5 for t in starts],
        },
        schema_overrides={"name": pl.Int64 if by_id else pl.Categorical},
    )
    want = ids[first] if by_id else first
    for _ in range(5):
        assert recurring_kernel(kernels, bundled_settings()) == want


@pytest.mark.parametrize(("gap_us", "want"), [(2.5, None), (500.0, "copy")])
def test_a_regular_burst_that_holds_a_sliver_of_the_work_marks_no_loop(gap_us, want):
    """A public TensorRT export (one inference: 36 kernels, 6.4 ms of convolutions at
    irregular times) holds 12 reformat copies 2.5 µs apart: regular, so they were taken for
    the loop, and the report judged a 26 µs "steady state" (0.4% of the capture) and proposed
    training fixes. A recurring kernel marks steps only where its occurrences span at least
    recurring_kernel_min_work_share (10%) of the kernel time. Constructed kernels in that
    shape; the same copies spread over the convolutions mark the loop."""
    from traceclf.steps.find import recurring_kernel
    from traceclf.steps.settings import bundled_settings

    copies = [1_000_000 + int(i * gap_us * 1_000) for i in range(12)]
    waits = [100, 900, 300, 700, 150, 1200, 400, 60, 800, 250, 1000, 500]  # µs: irregular
    convs = list(itertools.accumulate((w * 1_000 for w in waits), initial=1_050_000))[:12]
    rows = [("copy", t, t + 1_600) for t in copies] + [("conv", t, t + 50_000) for t in convs]
    kernels = pl.DataFrame(rows, schema=["name", "start", "end"], orient="row").sort("start")
    assert recurring_kernel(kernels, bundled_settings()) == want


def test_warm_up_by_allocator_calls_is_decided_as_by_their_counts_asking_only_what_it_needs():
    """A leading step is warm-up while it calls the allocator and the median step does not.
    Step sampling answers "does step i call it" by the first such call and the median step's
    only when a leading step calls it: on counts drawn at random (constructed, with durations
    that never decide), the steady range equals the rule applied to the counts themselves,
    and the median is never asked when no leading step calls the allocator."""
    import random

    from traceclf.steps.settings import bundled_settings
    from traceclf.steps.steady import Allocations, steady_bounds, steady_range

    settings = bundled_settings()
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(3, 12)
        counts = [rng.choice([0, 0, 0, 1, 3, None]) for _ in range(n)]
        durations = [100] * n
        known = sorted(c for c in counts[1:] if c is not None)
        mid = len(known) // 2
        median = (
            0.0
            if not known
            else known[mid]
            if len(known) % 2
            else (known[mid - 1] + known[mid]) / 2
        )
        first = 1
        while first < n - 2 and median == 0 and (counts[first] or 0) > 0:
            first += 1
        assert steady_range(durations, settings, counts) == (first, n - 2)
        asked = []

        def typical(counts=counts, median=median, asked=asked) -> bool:
            asked.append(1)
            return median > 0

        growth = Allocations(lambda i, c=counts: None if c[i] is None else c[i] > 0, typical)
        assert steady_bounds(n, durations.__getitem__, 100.0, settings, growth) == (first, n - 2)
        if not any((c or 0) > 0 for c in counts[1 : n - 2]):
            assert not asked


def test_a_kernel_without_an_end_adds_no_time_to_a_recurring_kernels_span():
    """A damaged export's probe may read a kernel whose end is no number (null): the work
    share then summed to null and the step finder failed with an internal error. CONSTRUCTED
    kernels: a regular kernel, the last row without an end."""
    from traceclf.steps.find import recurring_kernel
    from traceclf.steps.settings import bundled_settings

    starts = [i * 1_000_000 for i in range(12)]
    kernels = pl.DataFrame(
        {"name": ["k"] * 12, "start": starts, "end": [s + 500_000 for s in starts[:-1]] + [None]}
    )
    assert recurring_kernel(kernels, bundled_settings()) == "k"


@pytest.mark.parametrize(
    "name",
    ["h100_memory_offload", "h100_comm_ep2", "h100_compute_low_occupancy", "cloverleaf_a100"],
)
def test_the_steps_row_accounts_for_every_step_found(name: str) -> None:
    """ "8 steady of 10 found; 1 warm-up dropped" left one step unaccounted for (a public
    CUTLASS benchmark: "4 of 6; 1 warm-up"): a step runs to the next one's start, so the last
    has none to end it. The row now says so; its numbers add up to the steps found."""
    import re

    import traceclf
    from traceclf.render.capture_text import capture_rows

    report = traceclf.analyze(trace_path(name))
    text = " ".join(dict(capture_rows(report))["Steps"].split())
    used, found = map(int, re.search(r"(\d+) steady(?: periods)? of (\d+) found", text).groups())
    warmup = int(re.search(r"(\d+) warm-up dropped", text).group(1))
    more = re.search(r", (?:the last|(\d+) more) left out", text)
    left = 0 if more is None else int(more.group(1) or 1)
    assert used + warmup + left == found, text
    c = report.capture
    assert (c["steps_used"], c["steps_found"], c["warmup_dropped"]) == (used, found, warmup)
