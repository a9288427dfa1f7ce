"""Rules and fixes as data (traceclf.rules, rules/*.yaml): the expression language, rule-file
validation, user overrides, hardware-aware and already-applied fixes, ordering, and the verdict
on every real trace (../shared/traces/README.md)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
from realtraces import measured, trace_path

from traceclf.judge.abstention import training_loop
from traceclf.judge.engine import evaluate
from traceclf.judge.vocabulary import load_rules
from traceclf.render.rules import explain_fix, list_rules
from traceclf.rulebook.expr import Expr, ExprError, Template
from traceclf.rulebook.layers import CONTRACT_FIX_IDS
from traceclf.support.errors import TraceError

H100 = {"name": "NVIDIA H100 80GB HBM3", "chip": "GH100", "sm_count": 132,
        "memory_bytes": 85017493504}  # fmt: skip
GB200 = {"name": "NVIDIA GB200", "chip": "GB100", "sm_count": 148, "memory_bytes": 199 * 2**30}
B200 = {"name": "NVIDIA B200", "chip": "GB100", "sm_count": 148, "memory_bytes": 180 * 2**30}
MYSTERY = {"name": "Acme Tensor Card 9000", "chip": "ACME1", "sm_count": 64, "memory_bytes": 2**36}
# Synthetic facts describe a deep-learning training loop (framework advice applies) measured
# over ten steady NVTX steps.
TRAINING = {
    "capture": {"training_loop": "training"},
    "steps": {"source": "nvtx", "used": 10, "cv": 0.02},
}


def ids(verdict) -> list[str]:
    return [f["id"] for f in verdict.fixes]


# ---------------------------------------------------------------------------------------------
# Expression language


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("a / b", 0.0625),
        ("a >= 0.1 and b < 5", True),
        ("a > 1 or not (b == 4)", False),
        ("0 < a < 1", True),
        ('family in ["hopper", "blackwell"]', True),
        ('"deepep" in libs', False),
        ('"nccl" not in libs', False),
        ("min(a, b) + max(a, b) - abs(-1)", 3.25),
        ("-a", -0.25),
    ],
)
def test_expressions_evaluate(source, expected):
    env = {"a": 0.25, "b": 4, "family": "hopper", "libs": ["nccl"]}
    assert Expr.parse(source).value(env) == expected


def test_null_or_missing_measure_makes_the_condition_false_not_an_error():
    env = {"x": None, "one": 1, "zero": 0}
    for source in ("x > 0.5", "not (x > 0.5)", "x + 1 > 0", "missing >= 0", "min(x, 1) < 2",
                   "one / zero > 0", "x and one", "x == x"):  # fmt: skip
        assert Expr.parse(source).holds(env) is False, source
    # Three-valued logic: a known operand can still decide.
    assert Expr.parse("x > 1 or one > 0").holds(env) is True
    assert Expr.parse("x > 1 and zero > 0").value(env) is False
    assert Expr.parse("x > 1 and one > 0").value(env) is None
    assert Expr.parse("one / zero").value(env) is None


@pytest.mark.parametrize(
    "source",
    [
        "__import__('os').system('true')",
        "open('/etc/passwd')",
        "().__class__.__bases__",
        "x.real",
        "x[0]",
        "lambda: 1",
        "a if b else c",
        "x ** 2",
        "[i for i in range(3)]",
        "eval('1')",
        "x := 1",
        "None",
        "f'{x}'",
        "max(x, key=abs)",
    ],
)
def test_unsafe_or_unsupported_code_is_rejected_at_parse_time(source):
    with pytest.raises(ExprError):
        Expr.parse(source)


def test_arithmetic_is_numbers_only():
    # No way to build huge strings or lists from a rule file.
    assert Expr.parse('"a" * 1000000000').value({}) is None
    assert Expr.parse("[1] * 1000000000").value({}) is None


def test_templates_render_numbers_and_say_n_a_for_nulls():
    t = Template.parse("{a:.0%} of {n} rank(s), {a / b:.1f}x, {missing:.0%}, {{literal}}")
    assert t.names == {"a", "b", "n", "missing"}
    assert t.render({"a": 0.5, "b": 0.25, "n": 2}) == "50% of 2 rank(s), 2.0x, n/a, {literal}"
    for bad in ("{a:.0q}", "oops {", "{a.b}"):
        with pytest.raises(ExprError):
            Template.parse(bad)


def test_a_clause_whose_number_the_trace_lacks_is_left_out():
    """[[...]] holds a clause shown only when every field in it has a value: a public export
    without the GPU's model read "at 27.7 GB/s, against n/a GB/s per direction for n/a"."""
    t = Template.parse("at {rate:.1f} GB/s[[, against {peak:.0f} GB/s for {link}]]; {{x}}")
    assert t.names == {"rate", "peak", "link"}
    assert t.render({"rate": 27.7}) == "at 27.7 GB/s; {x}"
    assert t.render({"rate": 27.7, "peak": 64, "link": "PCIe"}) == (
        "at 27.7 GB/s, against 64 GB/s for PCIe; {x}"
    )
    assert t.render({"peak": 64, "link": "PCIe"}).startswith("at n/a GB/s, against 64")
    spaced = Template.parse("a [[ {b} ]] c")
    assert spaced.render({}) == "a c" and spaced.render({"b": 1}) == "a 1 c"
    # nonzero(): a clause about a share only where the share is not zero (a graph-level
    # trace's compute share is at most what it says; other traces' is what it says)
    share = Template.parse("{c:.0%}[[, at most: {nonzero(g):.0%} in replays]]")
    assert share.render({"c": 0.96, "g": 0.0}) == "96%"
    assert share.render({"c": 1.0, "g": 1.0}) == "100%, at most: 100% in replays"
    # a share above zero never prints as none: "<1%" (and "<0.1%" at one decimal)
    assert share.render({"c": 0.004, "g": 0.005}) == "<1%, at most: <1% in replays"
    assert Template.parse("{a:.1%} {b:.0%}").render({"a": 0.0004, "b": 0.006}) == "<0.1% 1%"
    assert Template.parse("{a:.0%}").render({"a": 0.0}) == "0%"
    # when(): words a clause shows only where a condition holds (false or null: left out)
    said = Template.parse('{n:.0f} times[[ ({when(est, "estimated")})]]')
    assert said.render({"n": 1019.4, "est": True}) == "1019 times (estimated)"
    assert said.render({"n": 240, "est": False}) == said.render({"n": 240}) == "240 times"
    for bad in ("a [[ b", "a ]] b", "[[ [[ b ]] ]]", "[[ {a:.0q} ]]"):
        with pytest.raises(ExprError):
            Template.parse(bad)
    rule = load_rules().rules["memory-one-way-copies"]
    facts = {"h2d_frac": 0.94, "d2h_frac": 0.0, "exposed_offload_frac": 0.94, "one_way_gbps": 27.7}
    sentence = rule.evidence.render(facts)
    assert sentence.endswith("at 27.7 GB/s") and "n/a" not in sentence
    with_link = rule.evidence.render(facts | {"link_gbps": 64.0, "link_name": "PCIe Gen5 x16"})
    assert with_link.endswith("against 64 GB/s per direction for PCIe Gen5 x16")


def test_allocations_never_freed_are_not_said_to_be_freed():
    """A public OpenACC loop allocated once a period and never freed: its evidence said
    "allocated and freed inside the step" (its facts here; the export is not committed)."""
    rule = load_rules().rules["memory-allocator-churn"]
    facts = {"alloc_calls_per_step": 1.0, "alloc_idle_frac": 0.132}
    never = rule.evidence.render(facts | {"free_calls_per_step": 0.0})
    assert "1 cudaMalloc/cudaFree call per step (0 frees)" in never
    assert "allocated inside the step, and no call frees it: the memory in use grows" in never
    assert "and freed" not in never
    both = rule.evidence.render(facts | {"alloc_calls_per_step": 23, "free_calls_per_step": 11.4})
    assert "(11 frees)" in both and "allocated and freed inside the step (" in both
    # a free every third step is a free: no "no call frees it"
    rare = rule.evidence.render(facts | {"free_calls_per_step": 1 / 3})
    assert "(0.3 frees)" in rare and "allocated and freed inside" in rare
    assert "no call frees it" not in rare


# ---------------------------------------------------------------------------------------------
# Rule files


def test_bundled_rules_define_the_contract_vocabulary_and_the_pitfalls():
    rs = load_rules()
    assert set(CONTRACT_FIX_IDS) <= set(rs.fixes)
    assert all(f.title and f.why.source and f.config for f in rs.fixes.values())
    assert 'moe_token_dispatcher_type = "flex"' in rs.fixes["deepep"].config
    assert 'moe_token_dispatcher_type = "flex"' in rs.fixes["hybridep"].config
    assert "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN" in rs.fixes["hybridep"].config
    overlap = rs.fixes["ep-overlap"]
    assert "overlap_moe_expert_parallel_comm = True" in overlap.config
    assert "moe_shared_expert_overlap = False" in overlap.config
    text = " ".join(p.text for p in overlap.premises + overlap.pitfalls)
    assert "virtual_pipeline_model_parallel_size" in text and "full" in text
    assert any("silently skipped" in p.text.lower() for p in rs.fixes["deepep"].pitfalls)
    assert "reduce-overhead" in rs.fixes["cuda-graphs"].pytorch
    assert "num_workers" in rs.fixes["input-pipeline"].pytorch
    assert "fused=True" in rs.fixes["fused-optimizer"].pytorch


def test_every_measured_key_is_a_known_name():
    (_, m), *_ = measured("h100_comm_ep2.sqlite")
    from traceclf.judge.vocabulary import known_names

    assert set(m.metrics) <= known_names()


def write_rules(folder: Path, text: str, name: str = "extra.yaml") -> Path:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)
    return folder


def rule(when: str = "gpu_idle_frac > 0.5", fix: str = "cuda-graphs") -> str:
    return f"""
rules:
  - id: my-rule
    wall: host
    when: {when}
    score: 0.9
    evidence: "idle {{gpu_idle_frac:.0%}}"
    fixes: [{fix}]
"""


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("rules: [oops", "not valid YAML at line"),
        ("- just a list", "top level must be a mapping"),
        ("rulez: []", "unknown top-level key 'rulez'"),
        (rule(when="gpu_idel_frac > 0.5"),
         "rule 'my-rule': 'when': unknown measure 'gpu_idel_frac' (did you mean 'gpu_idle_frac'?)"),
        (rule(fix="cuda-graph"),
         "rule 'my-rule': unknown fix id 'cuda-graph' (did you mean 'cuda-graphs'?)"),
        (rule(when="__import__('os')"), "rule 'my-rule': 'when': call of '__import__'"),
        (rule(when="gpu_idle_frac >"), "not a valid expression"),
        (rule().replace("    wall: host\n", ""), "rule 'my-rule': missing 'wall'"),
        (rule().replace("wall: host", "wall: disk"), "rule 'my-rule': wall 'disk' is not one of"),
        (rule().replace("score: 0.9", "score: 0.9\n    weight: 2"), "unknown field 'weight'"),
        ("rules:\n  - wall: host\n", "rule #1: missing 'id'"),
        ("fixes:\n  - id: f\n    wall: host\n    title: t\n    why: w\n",
         "fix 'f': missing 'config'"),
        ("fixes:\n  - {id: f, wall: host, title: t, why: w, config: c, applied: yes sir}\n",
         "fix 'f': 'applied' needs 'applied_when'"),
        ("definitions:\n  busy: gpu_busy_fraction > 0.5\n", "definition 'busy': uses"),
        ("definitions:\n  gpu_busy_frac: 1\n", "a measure or context name"),
        ("gpu_families:\n  - {family: x, match: '('}\n", "gpu family 'x': 'match' is not a valid"),
        ("scoring:\n  dominant: 2\n", "scoring: 'dominant' must be a number in [0, 1]"),
        ("rules:\n  - {id: nope, enabled: false}\n", "rule 'nope': disabled, but no such rule"),
    ],
)  # fmt: skip
def test_malformed_rule_files_raise_one_line_trace_errors(tmp_path, text, problem):
    folder = write_rules(tmp_path / "rules", text)
    with pytest.raises(TraceError) as err:
        load_rules(folder)
    message = str(err.value)
    assert "\n" not in message
    assert str(folder / "extra.yaml") in message
    assert problem in message


def test_missing_or_empty_rules_folder_is_an_error(tmp_path):
    with pytest.raises(TraceError, match="rules folder not found"):
        load_rules(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match=r"no rule files \(\*\.yaml\)"):
        load_rules(tmp_path / "empty")


def test_user_rules_are_merged_over_the_bundled_ones(tmp_path):
    folder = write_rules(
        tmp_path / "mine",
        """
definitions:
  very_idle: gpu_idle_frac >= 0.9
rules:
  - id: compute-busy            # same id: replaces the bundled rule
    wall: compute
    when: compute_frac >= 0.25
    score: 0.05
    evidence: "overridden"
  - {id: host-launch-bound, enabled: false}   # turns a bundled rule off
  - id: very-idle
    wall: host
    when: very_idle
    score: gpu_idle_frac
    evidence: "GPU idle {gpu_idle_frac:.0%}"
    fixes: [nap]
fixes:
  - id: nap
    wall: host
    title: Take a nap
    why: The GPU does.
    config: "cfg.train.nap = True"
""",
    )
    rs = load_rules(folder)
    assert rs.rules["compute-busy"].score.source == "0.05"
    assert not rs.rules["host-launch-bound"].enabled
    assert "nap" in rs.fixes and "cuda-graphs" in rs.fixes
    idle = {"metrics": {"gpu_idle_frac": 0.95, "gpu_busy_frac": 0.05, "idle_launch_frac": 0.9}}
    idle |= TRAINING
    verdict = evaluate(idle, folder)
    assert verdict.classification["bound"] == "host"
    assert "nap" in ids(verdict) and "cuda-graphs" not in ids(verdict)
    assert "GPU idle 95%" in verdict.classification["evidence"]


# ---------------------------------------------------------------------------------------------
# Verdicts on synthetic facts


def comm_facts(gpu: dict | None, libraries=("nccl",), **extra) -> dict:
    """An EP run whose all-to-all is half of the step and not overlapped."""
    metrics = {
        "gpu_busy_frac": 0.98, "gpu_idle_frac": 0.02, "compute_frac": 0.45, "comm_frac": 0.55,
        "exposed_comm_frac": 0.5, "comm_overlap_frac": 0.09, "a2a_frac": 0.55,
        "a2a_exposed_frac": 0.5, "gemm_time_frac": 0.3, "graph_frac": 0.0,
    } | extra  # fmt: skip
    return {
        "metrics": metrics,
        "gpu": gpu,
        "rank_count": 8,
        "comm_by_kind": {"all_to_all": {"frac": metrics["a2a_frac"], "libraries": list(libraries),
                                        "exposed_frac": metrics["a2a_exposed_frac"]}},
    } | TRAINING | {"capture": {"training_loop": "training", "moe_evidence": True}}  # fmt: skip


def test_straggler_rank_is_named_when_others_wait_for_it():
    skewed = comm_facts(H100) | {
        "cross_rank": {"straggler_rank": 3, "step_time_skew_frac": 0.02, "compute_skew_frac": 0.3}
    }
    verdict = evaluate(skewed)
    assert "balance-expert-load" in ids(verdict)
    assert any("rank 3 is the straggler" in e for e in verdict.classification["evidence"])
    # the same spread over a step that is 2% compute costs ~nothing: not worth a fix
    tiny = comm_facts(H100, compute_frac=0.02) | {
        "cross_rank": {"straggler_rank": 3, "step_time_skew_frac": 0.0, "compute_skew_frac": 0.3}
    }
    assert "balance-expert-load" not in ids(evaluate(tiny))


def test_dispatcher_follows_the_hardware():
    h100 = evaluate(comm_facts(H100))
    assert h100.classification["bound"] == "communication"
    assert "deepep" in ids(h100) and "hybridep" not in ids(h100)
    assert "deepep" in ids(evaluate(comm_facts(B200)))
    gb200 = evaluate(comm_facts(GB200))
    assert "hybridep" in ids(gb200) and "deepep" not in ids(gb200)
    for gpu in (MYSTERY, None):
        unknown = evaluate(comm_facts(gpu))
        assert "deepep" not in ids(unknown) and "hybridep" not in ids(unknown)
        assert {"ep-overlap", "ep-in-nvlink-domain"} <= set(ids(unknown))
        assert any('"alltoall"' in e for e in unknown.classification["evidence"])


def test_fixes_already_applied_are_reported_not_proposed():
    # DeepEP kernels in the trace: no DeepEP proposal, SM tuning instead, where overlap is
    # measured to cost compute (issue 23: SM tuning needs the overlap tax measured) ...
    deepep = evaluate(comm_facts(H100, libraries=("deepep",), overlap_tax_frac=0.03))
    assert "deepep" not in ids(deepep)
    assert "dispatcher-sm-tuning" in ids(deepep)
    assert any("DeepEP" in a for a in deepep.applied)
    # ... and not where nothing measured it
    unmeasured = evaluate(comm_facts(H100, libraries=("deepep",)))
    assert "dispatcher-sm-tuning" not in ids(unmeasured)
    # A third of the compute runs under all-to-all: EP overlap is in place.
    overlapped = evaluate(comm_facts(H100, a2a_exposed_frac=0.4, exposed_comm_frac=0.4))
    assert "ep-overlap" not in ids(overlapped)
    assert any("overlap alone is not enough" in a for a in overlapped.applied)
    # CUDA graphs replayed: never proposed, even on a launch-bound GPU.
    graphs = {"metrics": {"gpu_idle_frac": 0.5, "idle_launch_frac": 0.5, "graph_frac": 0.8,
                          "uses_cuda_graphs": True}} | TRAINING  # fmt: skip
    verdict = evaluate(graphs)
    assert "cuda-graphs" not in ids(verdict)
    assert any("CUDA graphs in use" in a for a in verdict.applied)


def test_fixes_follow_the_workflow_order_and_name_the_next_wall():
    facts = comm_facts(
        H100,
        offload_copy_frac=0.3, exposed_copy_frac=0.25, h2d_bytes_per_step=1e9,
        d2h_bytes_per_step=1e9, gpu_idle_frac=0.3, idle_launch_frac=0.3,
        sync_calls_per_step=50, small_d2h_per_step=50,
    )  # fmt: skip
    verdict = evaluate(facts)
    walls = [f["wall"] for f in verdict.fixes]
    order = ["memory", "communication", "host", "compute"]
    assert walls == sorted(walls, key=order.index)
    assert walls[0] == "memory" and "host" in walls
    assert verdict.classification["bound"] == "communication"
    assert verdict.next_wall in {"memory", "host"}
    # A prerequisite goes first: host syncs break CUDA-graph capture.
    assert ids(verdict).index("remove-host-syncs") < ids(verdict).index("cuda-graphs")
    assert all(f["rule_ids"] for f in verdict.fixes)
    for wall in order:  # within a wall by rule score, prerequisites aside
        scores = [f["score"] for f in verdict.fixes
                  if f["wall"] == wall and f["id"] != "remove-host-syncs"]  # fmt: skip
        assert scores == sorted(scores, reverse=True)


def test_textbook_compute_bound_run_reads_as_clear():
    """Issue 10: 100% busy computing over ten steady steps is a clear compute-bound run, not
    "no wall dominates" at confidence 0.45: confidence is the bound's share of the step (0.99)
    times the window's reliability (NVTX steps, 10 of them, 2% spread: 1 / 1.02)."""
    healthy = {
        "metrics": {"gpu_busy_frac": 0.99, "gpu_idle_frac": 0.01, "compute_frac": 0.99,
                    "gemm_time_frac": 0.3, "graph_frac": 0.0, "small_grid_kernel_frac": 0.05},
        "gpu": H100,
    } | TRAINING  # fmt: skip
    verdict = evaluate(healthy)
    c = verdict.classification
    assert c["bound"] == "compute"
    assert c["confidence"] == pytest.approx(0.99 / 1.02, abs=1e-3)
    assert not any("no wall dominates" in e for e in c["evidence"])
    assert verdict.fixes == [] and verdict.next_wall is None


def test_unsure_window_lowers_confidence_and_a_weak_bound_says_so():
    weak = {
        "metrics": {"gpu_busy_frac": 0.4, "gpu_idle_frac": 0.6, "compute_frac": 0.4,
                    "idle_other_frac": 0.1, "graph_frac": 0.0},
        "capture": {"training_loop": "training"},
        "steps": {"source": "pattern", "used": 2, "cv": 0.25},
    }  # fmt: skip
    c = evaluate(weak).classification
    # compute 40% of the step x (pattern 0.8 x 2/4 steps / 1.25 spread)
    assert c["confidence"] == pytest.approx(0.4 * 0.8 * 0.5 / 1.25, abs=1e-3)
    assert c["evidence"][0].endswith("no wall dominates")


def test_no_facts_at_all_gives_the_default_bound():
    verdict = evaluate({"metrics": {}})
    assert verdict.classification["bound"] == "compute"
    assert verdict.classification["confidence"] == 0
    assert verdict.fixes == []


def test_the_contract_lists_every_bundled_fix_id() -> None:
    """docs/report-contract.md's stable vocabulary of fix ids is the bundled fixes' (it had
    left out prefetch-managed-memory, which a report may hold)."""
    contract = (Path(__file__).resolve().parents[1] / "docs" / "report-contract.md").read_text()
    listed = contract.split("Fix ids (stable vocabulary", 1)[1].split("Order:", 1)[0]
    assert set(re.findall(r"`([a-z0-9-]+)`", listed)) == set(load_rules().fixes)


def test_the_rules_guide_names_every_context_name() -> None:
    """docs/rules.md's "Names" paragraph lists every fact about the run a rule may use (it had
    left out training_loop and idle_top_activity, on which bundled fixes depend)."""
    from traceclf.judge.vocabulary import CONTEXT_NAMES

    guide = (Path(__file__).resolve().parents[1] / "docs" / "rules.md").read_text()
    names = guide.split("**Names.**", 1)[1].split("**Templates.**", 1)[0]
    assert {n for n in CONTEXT_NAMES if f"`{n}`" not in names} == set()


def test_rules_and_explain_print(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # (no cell wrapped: each rule's text on one line)
    list_rules()
    out = capsys.readouterr().out
    assert "comm-exposed-all-to-all" in out and "selective-recompute" in out
    # each rule's id over what it finds (its description, read from the rule file)
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "│ host-launch-bound " in line)
    assert "│ GPU idle while the host is still issuing launches." in lines[at + 1]
    explain_fix("deepep")
    out = capsys.readouterr().out
    assert 'moe_token_dispatcher_type = "flex"' in out and "Pitfalls" in out
    with pytest.raises(TraceError, match=r"unknown fix 'deep-ep'; did you mean deepep\?"):
        explain_fix("deep-ep")
    with pytest.raises(
        TraceError, match=r"unknown fix 'zzz'; valid fix ids: .*balance-expert-load, compile"
    ):
        explain_fix("zzz")


# ---------------------------------------------------------------------------------------------
# The real traces


def first_available(*names: str) -> str:
    for name in names:
        with contextlib.suppress(pytest.skip.Exception):
            trace_path(name)  # full or trimmed copy, fixtures/ first
            return name
    pytest.skip(f"none of {names} available")


def facts_of(name: str) -> dict:
    """What the pipeline hands to evaluate: measures averaged over ranks, the capture's
    training-loop verdict, the steps of rank 0 and the NVTX range the host idles in."""
    steps = measured(name)[0][0]
    ranks = [m for _, m in measured(name)]
    keys = dict.fromkeys(k for m in ranks for k in m.metrics)
    metrics = {}
    for k in keys:
        values = [m.metrics[k] for m in ranks if m.metrics.get(k) is not None]
        bools = values and all(isinstance(v, bool) for v in values)
        metrics[k] = any(values) if bools else (sum(values) / len(values) if values else None)
    kinds: dict[str, dict] = {}
    for m in ranks:
        for kind, row in m.comm_by_kind.items():
            kinds.setdefault(kind, {"libraries": []})["libraries"] += row["libraries"]
    return {
        "metrics": metrics,
        "ranks": [{"rank": i, "metrics": m.metrics} for i, m in enumerate(ranks)],
        "gpu": H100,
        "rank_count": len(ranks),
        "comm_by_kind": kinds,
        "cross_rank": {},
        "capture": {
            # the judge decides it from the measured evidence (judge/abstention.py)
            "training_loop": training_loop(ranks[0].capture, load_rules().thresholds),
            "moe_evidence": any(
                r.capture["training_evidence"]["moe_kernels"]
                or r.capture["training_evidence"]["moe_ranges"]
                for r in ranks
            ),
        },
        "steps": {
            "source": steps.source,
            "used": steps.used,
            "cv": ranks[0].metrics["step_time_cv"],
        },
        "idle_nvtx": max(
            (r.idle_nvtx[0] for r in ranks if r.idle_nvtx), key=lambda x: x["frac"], default=None
        ),
    }


# (trace names, fixtures first) -> bound, fixes a user needs, fixes that must not appear,
# and what must be reported as already applied.
REAL = {
    "host_launch": (
        ("h100_host_launch_gpumetrics_trimmed.sqlite", "h100_host_launch_gpumetrics.sqlite"),
        "host", ["remove-host-syncs", "cuda-graphs", "grouped-gemm", "fused-optimizer"], [],
        None),
    # The expert GEMMs are already batched (one per layer): the optimizer is what is left, 64%
    # of kernel time with the per-tensor div_ kernels between its foreach kernels (issue 22:
    # by name alone 39%, and those kernels counted as fusable elementwise work, which made
    # kernel-fusion a fix here); both tracing modes agree.
    "host_cudagraph": (
        ("h100_host_cudagraph.sqlite",),
        "compute", ["fused-optimizer"], ["cuda-graphs", "grouped-gemm"],
        "CUDA graphs in use"),
    "host_cudagraph_nodetrace": (
        ("h100_host_cudagraph_nodetrace.sqlite",),
        "compute", ["fused-optimizer"], ["cuda-graphs", "grouped-gemm"],
        "CUDA graphs in use"),
    "host_input_stall": (
        ("h100_host_input_stall.sqlite",),
        "host", ["input-pipeline", "pinned-memory"], ["cuda-graphs"], None),
    "compute_dense": (
        ("h100_compute_dense_gpumetrics_trimmed.sqlite", "h100_compute_dense_gpumetrics.sqlite"),
        "compute", ["fp8"], ["grouped-gemm", "cuda-graphs", "selective-recompute"], None),
    "comm_ep2": (
        ("h100_comm_ep2.sqlite",),
        "communication", ["deepep", "ep-overlap", "ep-in-nvlink-domain"], ["hybridep"], None),
    "comm_ep2_overlap": (
        ("h100_comm_ep2_overlap.sqlite",),
        "communication", ["deepep", "ep-in-nvlink-domain"], ["ep-overlap", "hybridep"],
        "overlap alone is not enough"),
    "memory_offload": (
        ("h100_memory_offload.sqlite",),
        "memory", ["selective-recompute", "fine-grained-offload", "keep-allocator-cache"], [],
        None),
    "compute_low_occupancy": (
        ("h100_compute_low_occupancy.sqlite",),
        # 32-token expert GEMMs, all with fewer blocks than SMs: FP8 would not speed them
        "compute", ["grouped-gemm"], ["cuda-graphs", "fp8"], "CUDA graphs in use"),
    "comm_a2a_gpumetrics": (
        ("h100_comm_a2a_gpumetrics.sqlite",),
        "compute", [], ["deepep", "ep-overlap"], None),
}  # fmt: skip


@pytest.mark.parametrize("case", REAL)
def test_real_trace_verdict(case):
    names, bound, needed, absent, applied = REAL[case]
    verdict = evaluate(facts_of(first_available(*names)))
    got = ids(verdict)
    assert verdict.classification["bound"] == bound, verdict.classification
    assert set(needed) <= set(got), got
    assert not set(absent) & set(got), got
    if applied:
        assert any(applied in a for a in verdict.applied), verdict.applied
    assert verdict.classification["evidence"]


def test_real_trace_fix_order_and_confidence():
    def verdict(case):
        return evaluate(facts_of(first_available(*REAL[case][0])))

    memory = verdict("memory_offload")
    # the memory workflow first (selective recompute, then offload: fixes.yaml `after`), then
    # by gain ceiling
    assert ids(memory)[:2] == ["selective-recompute", "fine-grained-offload"]
    assert "keep-allocator-cache" in ids(memory)
    assert memory.classification["confidence"] >= 0.5
    comm = verdict("comm_ep2")
    assert ids(comm)[0] == "deepep" and comm.classification["confidence"] >= 0.9
    assert any("averaged over 2 ranks," in e for e in comm.classification["evidence"])
    host = verdict("host_launch")
    assert ids(host).index("remove-host-syncs") < ids(host).index("cuda-graphs")
    dense = verdict("compute_dense")  # the textbook compute-bound run reads as clear (issue 10)
    assert dense.classification["confidence"] >= 0.9
    assert not any("no wall dominates" in e for e in dense.classification["evidence"])
    assert [f["wall"] for f in dense.fixes] == ["compute"]


def test_real_trace_next_wall():
    """Fixing one wall exposes the next: what is left of the step once the bound is gone."""

    def next_wall(case):
        return evaluate(facts_of(first_available(*REAL[case][0]))).next_wall

    # 97% all-to-all, and EP overlap (its one fix with a measured ceiling: DeepEP's "up to the
    # exposed all-to-all" bounds nothing) hides 2% of the step: communication stays the wall
    assert next_wall("comm_ep2") == "communication"
    assert next_wall("host_launch") == "compute"
    assert next_wall("memory_offload") == "compute"
    assert next_wall("compute_dense") is None  # compute is the last wall: retune
    # A bound its fixes, at their ceilings, leave larger than every other wall is its own next
    # wall ("host still"): input workers as the ceiling assumes them (8) still leave the host
    # feeding the GPU slower than it computes (idle 96% less the ceiling's 88% of the step,
    # against 4% compute). It was "compute", as though the idle time went whole.
    facts = facts_of(first_available(*REAL["host_input_stall"][0]))
    verdict, m = evaluate(facts), facts["metrics"]
    (fix,) = [f for f in verdict.fixes if f["id"] == "input-pipeline"]
    left = m["gpu_idle_frac"] - fix["ceiling"]["recoverable_ms"] / m["step_time_ms"]
    assert left > m["compute_frac"] and verdict.next_wall == "host"


def test_the_bound_stays_only_as_far_as_its_fixes_are_known():
    """Constructed: a host-bound step (idle 60%, compute 40%). Without a fix whose per-step
    ceiling is measured (a number, and a throughput gain stated) nothing says how far the host
    can be fixed, so the next wall is still named from the shares; with one, the bound stays
    where its fixes leave it the largest wall (the fixes' combined ceiling, not each alone)."""
    from traceclf.judge.nextwall import _bound_stays

    shares = {"memory": 0.0, "communication": 0.0, "host": 0.6, "compute": 0.4}
    env = {"step_time_ms": 100.0}

    def host_fix(ms, source="compute-absent/launch-starved", gain=0.1):
        ceiling = {"unit": "step", "recoverable_ms": ms, "from": source, "throughput_gain": gain}
        return {"id": source, "wall": "host", "ceiling": ceiling}

    assert not _bound_stays("host", shares, [], env)
    assert not _bound_stays("host", shares, [host_fix(None)], env)
    assert not _bound_stays("host", shares, [{"id": "x", "wall": "host", "ceiling": None}], env)
    assert _bound_stays("host", shares, [host_fix(10.0)], env)  # 50% left > 40%
    assert not _bound_stays("host", shares, [host_fix(10.0, gain=None)], env)  # bounds nothing
    assert not _bound_stays("host", shares, [host_fix(30.0)], env)  # 30% left < 40%
    # two disjoint fixes together recover 25 ms: 35% left
    two = [host_fix(15.0), host_fix(10.0, "compute-absent/blocking/host-sync")]
    assert not _bound_stays("host", shares, two, env)


def test_collectives_waiting_for_a_late_rank_point_at_the_rank_not_the_fabric():
    """Issue 11: when matched collectives mostly wait for the last rank, the fix is that
    rank's load; when ranks time-slice one GPU, no such claim (synthetic facts)."""
    waiting = comm_facts(H100, blocking_comm_frac=0.5) | {
        "cross_rank": {"comm_wait_frac": 0.7, "comm_transfer_frac": 0.3, "last_arriver_rank": 5}
    }
    verdict = evaluate(waiting)
    assert "balance-expert-load" in ids(verdict)
    assert any("rank 5 arrives last" in e for e in verdict.classification["evidence"])
    shared = waiting | {"capture": {"training_loop": "training", "ranks_share_gpu": True}}
    assert "balance-expert-load" not in ids(evaluate(shared))
    transfer = comm_facts(H100, blocking_comm_frac=0.5) | {
        "cross_rank": {"comm_wait_frac": 0.1, "comm_transfer_frac": 0.9, "last_arriver_rank": 0}
    }
    verdict = evaluate(transfer)
    assert "balance-expert-load" not in ids(verdict)
    assert any("exchange itself is slow" in e for e in verdict.classification["evidence"])


def test_disagreeing_step_anchors_halve_the_window_reliability():
    agree = {"metrics": {"compute_frac": 0.9, "gpu_busy_frac": 0.9, "gpu_idle_frac": 0.1}}
    agree |= TRAINING
    doubt = agree | {"steps": TRAINING["steps"] | {"anchors_agree": False}}
    a, d = evaluate(agree).classification, evaluate(doubt).classification
    assert d["confidence_basis"]["reliability"] == pytest.approx(
        a["confidence_basis"]["reliability"] * 0.5
    )


def test_copies_to_the_host_and_back_outside_training_are_memory_not_offload():
    """A public OpenMP-offload heat solver (SC23 tutorial, a T4) maps 1 GB to the GPU and
    back every iteration from pageable memory: 96% of the step is copies. It read as
    HOST-bound with "the GPU waits for the host 0% of the step" (the pageable-copies rule
    scored the copies' time on the host wall, whose share counts launch starvation), and
    the copies as "activation offload". Here: the memory_offload trace's own measures, its
    loop told apart as training or not (CONSTRUCTED: the capture's loop verdict and, for the
    pageable case, its copies made pageable in the facts)."""
    facts = facts_of("h100_memory_offload")
    fired = [r["id"] for r in evaluate(facts).classification["rules"]]
    assert "memory-activation-offload" in fired and "memory-round-trip-copies" not in fired
    other = dict(facts, capture=dict(facts["capture"], training_loop="unknown"))
    m = other["metrics"] = dict(facts["metrics"])
    m |= {"pageable_copies_per_step": 4.0, "pageable_bytes_per_step": m["h2d_bytes_per_step"]}
    m["pageable_copy_frac"] = m["offload_copy_frac"]
    verdict = evaluate(other)
    rules = [r["id"] for r in verdict.classification["rules"]]
    assert "memory-round-trip-copies" in rules and "memory-activation-offload" not in rules
    assert "memory-pageable-copies" in rules
    assert verdict.classification["bound"] == "memory"
    said = " ".join(verdict.classification["evidence"])
    # (no training vocabulary for a loop that is no training step: a public HPC report read
    # "no backward pass to keep activations for")
    (trip,) = [e for e in verdict.classification["evidence"] if "the loop's own data" in e]
    assert "activation" not in trip and "backward" not in trip
    assert "activation offload" not in said
    assert {"reduce-host-traffic", "pinned-memory"} <= set(ids(verdict))


def test_pinned_copies_still_cross_the_link():
    """Pinning makes copies run at the link's rate; it does not make the bytes vanish. The
    SC23 solver's 1.02 GB each way per 549 ms step over a T4's PCIe Gen3 x16 (16 GB/s per
    direction, rules/hardware.yaml): where the two directions copy at once (duplex 100%) the
    step is at least 64 ms, ×8.6 at most, where the ceiling said ×25.6; its copies in fact run
    one after the other on one stream (duplex 0%, as the trace shows), so both directions'
    bytes cross one after the other: 128 ms, ×4.3 at most. CONSTRUCTED numbers, the real
    rule."""
    from traceclf.judge import ceiling as ceil

    pinned = load_rules().fixes["pinned-memory"]
    env = {
        "step_time_ms": 549.4,
        "blocking_copy_bound": 0.469,
        "blocking_copy_frac": 0.469,
        "blocking_host_sync_frac": 0.492,
        "pageable_copies_per_step": 4,
        "h2d_bytes_per_step": 1.024e9,
        "d2h_bytes_per_step": 1.024e9,
        "link_gbps": 16,
        "host_copy_duplex_frac": 1.0,
    }
    c = ceil.ceiling(pinned, env)
    assert c["floor_ms"] == pytest.approx(64.0) and c["step_after_ms"] == pytest.approx(64.0)
    assert 1 + c["throughput_gain"] == pytest.approx(549.4 / 64.0, rel=1e-3)
    assert c["bound_by"]["link_gbps"] == 16
    serial = ceil.ceiling(pinned, env | {"host_copy_duplex_frac": 0.0})
    assert serial["floor_ms"] == pytest.approx(128.0)
    assert 1 + serial["throughput_gain"] == pytest.approx(549.4 / 128.0, rel=1e-3)
    assert "as much as they are now (of the shorter's copy time: 0%)" in serial["assumes"]
    half = ceil.ceiling(pinned, env | {"host_copy_duplex_frac": 0.5})["floor_ms"]
    assert half == pytest.approx(96.0)
    # copies one way only (no duplex figure): one direction's bytes
    one_way = env | {"d2h_bytes_per_step": 0.0, "host_copy_duplex_frac": None}
    alone = ceil.ceiling(pinned, one_way)
    assert alone["floor_ms"] == pytest.approx(64.0)
    assert "copy time: none, the copies go one way" in alone["assumes"]
    # a GPU whose host link is unknown: no floor, the ceiling as before
    assert ceil.ceiling(pinned, env | {"link_gbps": None})["floor_ms"] is None
    from traceclf.judge.engine import host_link

    links = {
        gpu: tuple(host_link({"name": gpu}, load_rules()).values())
        for gpu in ("Tesla T4", "Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-80GB", "RTX 4090")
    }
    assert links == {
        "Tesla T4": ("PCIe Gen3 x16", 16),
        "Tesla V100-SXM2-16GB": ("PCIe Gen3 x16", 16),
        "NVIDIA A100-SXM4-80GB": ("PCIe Gen4 x16", 32),
        "RTX 4090": (None, None),  # (no "T4" inside "RTX 4090")
    }


def test_framework_and_moe_premises_are_said_only_where_the_trace_shows_them(capsys):
    """A public kNN benchmark (framework fixes off) was told to remove syncs with "Drop-and-pad
    changes which tokens are processed" to check first and clip_grad_norm as the pitfall. A
    premise or pitfall with `when` is said only where it holds: the MoE run keeps its MoE and
    framework ones; the host-launch MoE loop's facts without their MoE evidence keep the
    framework one; made a loop of no framework ("not_a_loop"), none (both CONSTRUCTED from
    the run's own facts). `traceclf rules --explain` shows each with its condition."""

    def sync_fix(facts: dict) -> dict:
        return next(f for f in evaluate(facts).fixes if f["id"] == "remove-host-syncs")

    moe = sync_fix(facts_of("h100_moe_megatron_ep2"))
    assert moe["advice"] == "framework"
    assert any("Drop-and-pad" in p for p in moe["preconditions"])
    assert any("clip_grad_norm" in p for p in moe["pitfalls"])
    launch = facts_of(first_available("h100_host_launch_gpumetrics_trimmed"))
    assert any("Drop-and-pad" in p for p in sync_fix(launch)["preconditions"])
    dense = dict(launch, capture=dict(launch["capture"], moe_evidence=False))
    assert not any("Drop-and-pad" in p for p in sync_fix(dense)["preconditions"])
    assert any("clip_grad_norm" in p for p in sync_fix(dense)["pitfalls"])
    plain = dict(dense, capture=dict(dense["capture"], training_loop="not_a_loop"))
    generic = sync_fix(plain)
    assert generic["advice"] == "generic"
    # (the one premise of any loop: a sync whose results the host reads stays)
    assert [p[:40] for p in generic["preconditions"]] == [
        "The host does not read the results right"
    ]
    assert generic["pitfalls"] == []
    assert ".item()" not in generic["config"]
    explain_fix("remove-host-syncs")
    out = " ".join(capsys.readouterr().out.split())
    assert "(said when framework_loop and moe_seen)" in out


def test_a_fix_the_trace_measures_as_winning_nothing_is_not_proposed():
    """A public kNN code idles in gaps that its cudaMalloc/cudaFree calls end, not a call that
    only waits: remove-host-syncs' ceiling is 0 ms per step, and it was proposed first. Here
    the host-launch run's facts with no wait-only sync gap (CONSTRUCTED): its sync rule still
    fires and says so, the fix is not proposed."""
    facts = facts_of(first_available("h100_host_launch_gpumetrics_trimmed"))
    assert "remove-host-syncs" in ids(evaluate(facts))
    none = dict(facts, metrics=dict(facts["metrics"], idle_after_wait_frac=0.0))
    verdict = evaluate(none)
    assert "remove-host-syncs" not in ids(verdict)
    assert "host-syncs" in [r["id"] for r in verdict.classification["rules"]]
    # next to nothing is nothing either: a public code whose gaps follow no wait read "+0.0%"
    # (0.000146 ms of a 7.3 ms step) as its only fix; under negligible_gain_frac (0.1%) of the
    # step a fix is left out, at it it stays
    step = facts["metrics"]["step_time_ms"]
    wait = facts["metrics"]["wait_call_frac"]
    for share, kept in ((0.0009, False), (0.0011, True)):
        tiny = dict(facts["metrics"], idle_after_wait_frac=share, wait_call_frac=max(wait, share))
        fix = [
            f for f in evaluate(dict(facts, metrics=tiny)).fixes if f["id"] == "remove-host-syncs"
        ]
        assert bool(fix) is kept, share
        if kept:
            assert fix[0]["ceiling"]["recoverable_ms"] >= 0.001 * step


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"pitfalls": [{"text": "x", "whenever": "a"}]}, "mapping of text and when"),
        ({"pitfalls": [{"when": "a"}]}, "mapping of text and when"),
        ({"preconditions": [{"text": "x", "if": "a"}]}, "mapping of text, when and contradicted"),
        ({"pitfalls": [{"text": "x", "when": "no_such_name"}]}, "no_such_name"),
    ],
)
def test_a_conditional_premise_or_pitfall_is_checked_when_the_rules_load(entry, problem):
    from traceclf.rulebook.entries import parse_fix

    raw = {"id": "x", "wall": "host", "title": "t", "why": "w", "config": "c"} | entry
    with pytest.raises(TraceError, match=problem):
        parse_fix(raw, Path("rules/fixes.yaml"), 0, frozenset({"a"}))


def test_allocator_churn_outside_a_framework_gets_plain_cuda_advice():
    """cudaMalloc/cudaFree inside the loop of a plain CUDA code (a public kNN benchmark frees
    2,136 buffers in its loop) left the allocator fix out: it had only framework advice. The
    memory_offload run's facts as a loop of no framework (CONSTRUCTED): the fix is proposed
    with the CUDA-level advice, its framework pitfall left out."""
    facts = facts_of("h100_memory_offload")
    plain = dict(facts, capture=dict(facts["capture"], training_loop="not_a_loop"))
    fix = next(f for f in evaluate(plain).fixes if f["id"] == "keep-allocator-cache")
    assert fix["advice"] == "generic" and "cudaMallocAsync" in fix["config"]
    assert "empty_cache" not in fix["config"] and fix["pitfalls"] == []
    framework = next(f for f in evaluate(facts).fixes if f["id"] == "keep-allocator-cache")
    assert "empty_unused_memory_level = 0" in framework["config"] and framework["pitfalls"]


def test_one_launch_per_step_leaves_graphs_and_fusion_nothing():
    """A public OpenACC loop launches one kernel per step, after an allocation and before a
    copy and a sync: CUDA graphs were proposed at ×6.1 and kernel fusion at +4.6%, from a
    "chain" of the same kernel in consecutive steps. A graph needs launches to batch and a
    fusion two kernels in a step. The host-launch run's facts with one launch and one kernel
    per step (CONSTRUCTED): neither is proposed; with its own counts, both are."""
    facts = facts_of(first_available("h100_host_launch_gpumetrics_trimmed"))
    assert {"cuda-graphs", "kernel-fusion"} <= set(ids(evaluate(facts)))
    one = dict(
        facts, metrics=dict(facts["metrics"], launch_calls_per_step=1.0, kernels_per_step=1.0)
    )
    assert not {"cuda-graphs", "kernel-fusion"} & set(ids(evaluate(one)))


def test_a_floor_that_leaves_nothing_keeps_the_fix():
    """A ceiling cut to 0 by a floor from rule data (a host link slower than the copies the
    trace measured: a V100 on POWER9 reaches its host over NVLink, not the PCIe Gen3 its name
    matches) says the data is off, not that the fix wins nothing: the fix stays, its ceiling
    says 0. A ceiling the trace itself measures as 0 drops the fix. CONSTRUCTED ceilings."""
    from traceclf.judge.engine import _wins_nothing

    rs, env = load_rules(), {"step_time_ms": 100.0}
    measured = {"ceiling": {"unit": "step", "recoverable_ms": 0.0, "floor_ms": None}}
    floored = {"ceiling": {"unit": "step", "recoverable_ms": 0.0, "floor_ms": 70.0}}
    assert _wins_nothing(measured, env, rs) and not _wins_nothing(floored, env, rs)
    assert not _wins_nothing({"ceiling": None}, env, rs) and not _wins_nothing({}, env, rs)


def test_capture_options_sharing_a_command_are_one():
    """A capture without NVTX and OS runtime calls was told `nsys profile -t cuda,nvtx,osrt`
    twice, once per source; one command adding both is one option, naming what each would
    attribute (CONSTRUCTED environment: the export's host sources and unattributed idle)."""
    from traceclf.judge.hostverdict import capture_options

    env = {"host_sources": ["cuda_api"], "idle_unattributed_frac": 0.5, "python_process": False}
    env |= load_rules().thresholds
    options = capture_options(load_rules(), env)
    commands = [o["option"] for o in options]
    assert len(commands) == len(set(commands))
    (both,) = [o for o in options if o["option"] == "nsys profile -t cuda,nvtx,osrt"]
    assert both["sources"] == ["nvtx", "osrt"] and both["source"] == "nvtx"
    assert "NVTX ranges" in both["attributes"] and "blocking I/O" in both["attributes"]


def test_the_distributed_optimizer_is_configured_only_with_data_parallel_ranks():
    """The fused-optimizer fix set `use_distributed_optimizer = True` on one-rank traces, where
    it shards nothing: the host-launch trace (one rank) gets the fused optimizer alone; its
    facts made two ranks (CONSTRUCTED), the distributed optimizer too."""
    facts = facts_of("h100_host_launch_gpumetrics")
    assert facts["rank_count"] == 1

    def config(f: dict) -> str:
        return next(x for x in evaluate(f).fixes if x["id"] == "fused-optimizer")["config"]

    assert "use_distributed_optimizer" not in config(facts)
    assert "use_distributed_optimizer = True" in config(dict(facts, rank_count=2))


def test_removing_syncs_gives_back_the_hosts_wait_and_leaves_its_other_work():
    """A public OpenACC loop's 52.4 µs step idles the GPU 73% after its syncs, but its host
    sits in them 5.35 µs a step (10%); the rest of each gap is the host's own work between
    calls and its launches, copies and allocations (26.6 µs in CUDA calls), which stay: +11%
    at most, where "+97%" counted only the host's other CUDA calls as staying and ×3.7 assumed
    they vanish. Where the wait is long (CloverLeaf's host waits through each kernel), the
    other calls bound the step. CONSTRUCTED numbers (that run's), the real rule."""
    from traceclf.judge import ceiling as ceil

    fix = load_rules().fixes["remove-host-syncs"]
    env = {
        "step_time_ms": 0.052426,
        "idle_after_wait_frac": 0.73,
        "wait_call_frac": 0.00535 / 0.052426,
        "launch_starved_frac": 0.73,
        "attribution_residual_frac": 0.0,
        "launch_starved_bound": 0.73,  # (rules/definitions.yaml: the two above added)
        "blocking_host_sync_frac": 0.0,
        "sync_calls_per_step": 1.0,
        "host_call_ms_per_step": 0.026637,
    }
    c = ceil.ceiling(fix, env)
    assert c["recoverable_ms"] == pytest.approx(0.00535, rel=1e-3)
    assert c["throughput_gain"] == pytest.approx(0.052426 / (0.052426 - 0.00535) - 1, abs=2e-3)
    assert "gains no more than the host waited in them (10.2% of it)" in c["assumes"]
    assert "still spends 0.0266 ms per step in its other CUDA calls" in c["assumes"]
    long_wait = ceil.ceiling(fix, env | {"wait_call_frac": 0.9})
    assert long_wait["step_after_ms"] == pytest.approx(0.02664, rel=1e-3)  # the floor binds
    unbounded = ceil.ceiling(fix, env | {"wait_call_frac": 0.9, "host_call_ms_per_step": 0.001})
    assert unbounded["recoverable_ms"] == pytest.approx(0.73 * 0.052426, rel=1e-3)


def test_counts_in_rule_sentences_take_their_nouns_number():
    """count(n, noun) in a template: a count per step that rounds to one reads "1 synchronising
    call ... for 1 launch" (a public OpenACC loop read "1 synchronising calls ... for 1
    launches"); its plural goes on the phrase's noun ("cudaMalloc/cudaFree calls per step",
    "copies"); anything but a number and a noun is unknown, as other functions' misuse is."""
    from traceclf.rulebook.expr import Expr, Template

    def render(source: str) -> str:
        return Template.parse(source).render(env)

    env = {"one": 1.2, "many": 129, "none": 0}
    said = render('{count(one, "synchronising call")} for {count(many, "launch")}')
    assert said == "1 synchronising call for 129 launches"
    assert render('{count(none, "small device→host copy")}') == "0 small device→host copies"
    assert render('{count(many, "cudaMalloc/cudaFree call per step")}') == (
        "129 cudaMalloc/cudaFree calls per step"
    )
    # a fraction per step is said as one, and halves round up as counts read
    assert render('{count(0.4, "small device→host copy")}') == "0.4 small device→host copies"
    assert render('{count(2.5, "call")}') == "3 calls"
    assert Expr.parse('count("x", "call")').value(env) is None
    assert Expr.parse('count(missing, "call")').value(env) is None


def test_host_traffic_fix_names_optimizer_offload_only_for_a_training_loop():
    """The fix's rule data (no shared trace streams weights one way): a forward-only window
    that streams weights in (a public FastVideo layer-offload export) was told to keep
    optimizer state on the GPU. The optimizer lines are config_when a training loop runs."""
    fix = load_rules().fixes["reduce-host-traffic"]
    assert "optimizer" not in fix.config
    ((when, lines),) = fix.config_when
    assert "optimizer_cpu_offload" in lines
    assert when.holds({"training_loop": "training"})
    assert not when.holds({"training_loop": "forward_only"})


def test_per_operator_nvtx_ranges_lower_a_host_verdict_only():
    """ulysses_2gpu_forward_window: PyTorch's emit_nvtx opens ~4.8 ranges per kernel launch
    (recomputed from its rows: tests/helpers/independent.py); its GPU idles only 6.6% of the
    step while the host launches, so nothing warns. The same facts with the launch gaps the
    host-launch rules need (CONSTRUCTED: 20%) warn, and lower the confidence of a host
    verdict, not of a compute one: a host slowed by its ranges never reads as compute-bound."""
    from helpers import independent as ind

    import traceclf
    from traceclf.judge.engine import build_env, capture_quality
    from traceclf.judge.hostverdict import distorts

    name = first_available("ulysses_2gpu_forward_window")
    facts = facts_of(name)
    m = facts["metrics"]
    for rank in traceclf.analyze(trace_path(name), use_cache=False).ranks:
        steps = rank["steps"]
        mine = ind.rank_measures(
            trace_path(name), rank["pid"], tuple(steps["window_ns"]), steps["used"],
            steps["source"], steps["label"],
        )  # fmt: skip
        assert rank["metrics"]["nvtx_ranges_per_launch"] == pytest.approx(
            mine["nvtx_ranges_per_launch"], rel=0.01
        )
    assert m["nvtx_ranges_per_launch"] > 4 and m["idle_launch_frac"] < 0.1
    assert not capture_quality(facts)["warnings"]
    launchy = facts | {"metrics": m | {"idle_launch_frac": 0.2}}
    (warning,) = capture_quality(launchy)["warnings"]
    assert f"{m['nvtx_ranges_per_launch']:.1f} NVTX ranges were opened per kernel launch" in warning
    rs = load_rules()
    env = build_env(launchy, rs)
    assert distorts(rs, env, "host") and not distorts(rs, env, "compute")
    assert evaluate(launchy).classification["bound"] == "compute"
    assert "capture_distortion" not in evaluate(launchy).classification["confidence_basis"]
    idle = {"idle_launch_frac": 0.8, "gpu_idle_frac": 0.85, "gpu_busy_frac": 0.15}
    starved = facts | {"metrics": m | idle | {"compute_frac": 0.12, "short_kernel_frac": 0.9}}
    host = evaluate(starved).classification
    assert host["bound"] == "host" and host["confidence_basis"]["capture_distortion"] == 0.7


def test_a_distortion_names_only_walls(tmp_path):
    """A user's capture distortion may say which verdicts it can produce (``walls``); a wall
    that does not exist is an error naming the file."""
    folder = write_rules(
        tmp_path / "mine",
        """
capture:
  distortions:
    - when: gpu_idle_frac >= 0.5
      walls: [host, gpu]
      warning: "idle"
""",
    )
    with pytest.raises(TraceError, match="walls: 'gpu' is not one of memory"):
        load_rules(folder)
    (folder / "extra.yaml").write_text(
        (folder / "extra.yaml").read_text().replace("[host, gpu]", "[host]")
    )
    (distortion,) = load_rules(folder).capture.distortions
    assert distortion.walls == ("host",)
