"""`traceclf compare` as a user meets it (issue 24): a comparison that cannot be made exits 3
with one line saying why and prints no per-step figure for a side without steps; every
format shows what changed inside the step (terminal at 80 and 200 columns, Markdown, HTML with
a waterfall, JSON per the contract and schema); names from traces stay inert in each; the API's
``Comparison`` gives polars frames (issue 28, item 9)."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path

import jsonschema
import polars as pl
import pytest
from helpers.cli import run_cli
from realtraces import trace_path
from rich.cells import cell_len

import traceclf
from traceclf.compare.kernel_diff import kernel_diff
from traceclf.compare.regression import compare_reports, comparison_settings
from traceclf.compare.side import Side
from traceclf.render.compared import comparison_markdown
from traceclf.render.compared_inside import signed_ms
from traceclf.report.contract import Report
from traceclf.support.errors import TraceError

REPO = Path(__file__).resolve().parents[1]
EP, EP_OVERLAP = "h100_comm_ep2", "h100_comm_ep2_overlap"
SLOW, FAST = "h100_host_launch_gpumetrics", "h100_host_cudagraph"
NO_STEPS = "nvfuser_matmul_test_h100"  # 19 kernels, no step: traceclf abstains


@cache
def report(name: str) -> Report:
    return traceclf.analyze(trace_path(name))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("reports")
    paths = {}
    for name in (EP, EP_OVERLAP, SLOW, FAST, NO_STEPS):
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(report(name).to_json(), encoding="utf-8")
    return paths


def validator(definition: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((REPO / "docs" / "report-schema.json").read_text(encoding="utf-8"))
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/$defs/{definition}", "$defs": schema["$defs"]}
    )


# A comparison that cannot be made ----------------------------------------------------------


def test_a_side_without_steps_exits_3_with_one_line(saved: dict[str, Path]) -> None:
    code, out, err = run_cli("compare", saved[EP], saved[NO_STEPS], "-f", "json")
    assert code == 3
    assert len(err.splitlines()) == 1 and "no step time" in err and NO_STEPS in err
    data = json.loads(out)
    assert data["verdict"] == "inconclusive" and data["conclusive"] is False
    # no per-step figure for the side without steps
    assert data["kernels"] == [] and data["phases"] == [] and data["reconciliation"] is None
    assert NO_STEPS in data["detail_missing"]
    per_step = [m for m in data["measures"] if m["key"].endswith("_per_step")]
    assert per_step and all(m["after"] is None and not m["material"] for m in per_step)
    validator("comparison").validate(data)
    code, out, _ = run_cli("compare", saved[EP], saved[NO_STEPS])
    assert code == 3 and "kernels/step" not in out and "No per-step detail" in out
    code, out, err = run_cli("compare", saved[EP], saved[NO_STEPS], "--allow-inconclusive")
    assert (code, err) == (0, "") and "Inconclusive" in out  # the output says why


def test_a_side_traceclf_abstained_on_is_inconclusive(saved: dict[str, Path]) -> None:
    result = compare_reports(report(EP), report(NO_STEPS))
    assert not result.conclusive and not result.regression
    assert "did not name a bound" in " ".join(result.notes)


def test_a_regression_still_exits_1_beside_an_inconclusive_candidate(
    saved: dict[str, Path],
) -> None:
    code, out, err = run_cli("compare", saved[FAST], saved[SLOW], saved[NO_STEPS], "-f", "json")
    assert code == 1 and len(err.splitlines()) == 1 and NO_STEPS in err
    data = json.loads(out)
    assert data["regression"] is True and data["conclusive"] is False
    validator("comparisons").validate(data)


def test_exit_3_and_the_option_are_documented() -> None:
    code, out, _ = run_cli("compare", "--help")
    assert code == 0 and "--allow-inconclusive" in out and "3" in out
    _, top, _ = run_cli("--help")
    assert "3 `compare`" in " ".join(top.split())
    for doc in ("README.md", "docs/api.md", "docs/report-contract.md"):
        text = (REPO / doc).read_text(encoding="utf-8")
        assert "--allow-inconclusive" in text and "exit" in text.lower(), doc


# Every format -------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [80, 200])
def test_terminal_fits_the_width_and_keeps_every_number(
    width: int, saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, err = run_cli("compare", saved[EP], saved[EP_OVERLAP])
    assert code == 0, err
    assert max(cell_len(line) for line in out.splitlines()) <= width
    for section in ("Kernels that changed", "Launch shape changed", "Phases", "Idle by cause"):
        assert section in out
    assert not re.search(r"\d…|…\d", out), "a number was cut"
    flat = " ".join(out.split())
    r = compare_reports(report(EP), report(EP_OVERLAP)).breakdown.reconciliation
    assert "Step change" in flat and "unexplained" in flat
    assert f"Step change {signed_ms(r.step_change_ms)} =" in flat  # -2.76 ms
    # what "material" means, with the numbers used: 1% of the baseline's 116 ms step
    step = report(EP).steps["mean_ms"]
    assert f"a change of at least {step / 100:.3g} ms per step (1.0% of the baseline step)" in flat


def test_markdown_for_the_ticket(saved: dict[str, Path]) -> None:
    code, out, err = run_cli("compare", saved[SLOW], saved[FAST], "-f", "md")
    assert code == 0, err
    for heading in ("## What changed inside the step", "**Kernels that changed", "**Phases**"):
        assert heading in out
    assert "| CUDA graph 1 | 0 ms | 4.51 ms | +4.51 ms | 0 → 1 | new\\* |" in out
    assert "Step change -194 ms = kernels -19.9 ms + idle -173 ms" in out


def test_html_has_a_waterfall_of_the_step_change(saved: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "cmp.html"
    code, stdout, err = run_cli("compare", saved[SLOW], saved[FAST], "-f", "html", "-o", out)
    assert (code, stdout) == (0, ""), err
    html = out.read_text(encoding="utf-8")
    assert '<figure id="fig-step-waterfall-0"><img' in html and "data:image/png;base64," in html
    assert "<script" not in html and "Kernels that changed" in html
    code, _, err = run_cli("compare", saved[SLOW], saved[FAST], "-f", "html")
    assert code == 2 and "needs -o" in err
    # a baseline and several candidates: the table, then each comparison with its waterfall
    many = tmp_path / "many.html"
    code, _, err = run_cli(
        "compare", saved[SLOW], saved[FAST], saved[SLOW], "-f", "html", "-o", many
    )
    assert code == 0, err
    html = many.read_text(encoding="utf-8")
    # (the baseline against itself: nothing moved, so no waterfall of zeros)
    assert "<th>candidate</th>" in html and html.count('id="fig-step-waterfall-') == 1


def test_json_follows_the_contract(saved: dict[str, Path]) -> None:
    code, out, err = run_cli("compare", saved[EP], saved[EP_OVERLAP], "-f", "json")
    assert code == 0, err
    data = json.loads(out)
    validator("comparison").validate(data)
    for k in data["kernels"]:
        assert {"name", "before_ms_per_step", "after_ms_per_step", "delta_ms_per_step"} <= set(k)
        assert k["status"] in ("same", "slower", "faster", "new", "removed")
        assert isinstance(k["material"], bool)
    idle = data["idle"]
    assert {"before_ms_per_step", "after_ms_per_step", "delta_ms_per_step", "by_cause"} <= set(idle)
    assert isinstance(data["phases"], list) and data["launch_changes"]
    r = data["reconciliation"]
    assert r["explained_ms"] == pytest.approx(r["kernels_ms"] + r["idle_ms"])
    assert r["step_change_ms"] == pytest.approx(r["explained_ms"] + r["unexplained_ms"])


# Names from traces stay inert -------------------------------------------------------------


HOSTILE = "evil\u202e[bold]kernel[/]\x1b]0;pwned\x07<script>x</script>|`*$x$"


def test_hostile_kernel_names_are_escaped_in_every_format(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    data = json.loads(saved[EP].read_text(encoding="utf-8"))
    for rank in data["ranks"]:
        row = rank["step_kernels"]["kernels"][0]
        row["name"] = row["short_name"] = HOSTILE
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(data), encoding="utf-8")
    code, out, err = run_cli("compare", saved[EP], odd)
    assert code == 0, err
    assert "\x1b" not in out and "\\x1b]0;pwned\\x07" in out and "evil\\u202e[bold]kernel[/]" in out
    assert "\u202e" not in out
    code, md, _ = run_cli("compare", saved[EP], odd, "-f", "md")
    assert not re.search(r"(?<!\\)<script>", md) and "\\<script>" in md and "\x1b" not in md
    html_out = tmp_path / "odd.html"
    run_cli("compare", saved[EP], odd, "-f", "html", "-o", html_out)
    html = html_out.read_text(encoding="utf-8")
    assert "<script>" not in html and "&lt;script&gt;" in html
    # control characters and a right-to-left override are written out, as analyze's HTML does
    # (escaped as HTML they still reach a terminal and reorder the page)
    assert not re.search("[\x1b\x07\u202e]", html) and "evil\\u202e[bold]" in html


def test_a_damaged_step_kernels_block_leaves_out_the_detail(saved: dict[str, Path]) -> None:
    data = json.loads(saved[EP].read_text(encoding="utf-8"))
    damaged = copy.deepcopy(data)
    damaged["ranks"][0]["step_kernels"] = {"steps": "nine", "kernels": "many"}
    old = copy.deepcopy(data)
    for rank in old["ranks"]:
        del rank["step_kernels"]  # a report saved before issue 24
    for variant in (damaged, old):
        result = compare_reports(report(EP), Report.from_dict(variant))
        assert result.verdict == "no significant change" and result.breakdown.kernels == []
        assert "no per-kernel detail" in result.breakdown.detail_missing
        assert "No per-step detail" in comparison_markdown(result)


# The API's frames (issue 28, item 9) ----------------------------------------------------------


def test_comparison_gives_polars_frames() -> None:
    c = traceclf.api.compare(trace_path(EP), trace_path(EP_OVERLAP))
    tables = c.tables()
    assert set(tables) == {
        "measures",
        "kernels",
        "phases",
        "idle",
        "communication",
        "reconciliation",
    }
    kernels = tables["kernels"]
    assert isinstance(kernels, pl.DataFrame) and kernels.height == len(c.breakdown.kernels)
    assert kernels.schema["name"] == pl.String  # string operations work as they are
    assert kernels.filter(pl.col("name").str.contains("nvjet")).height >= 1
    recon = dict(tables["reconciliation"].iter_rows())
    assert recon["step_change"] == pytest.approx(c.step_change_ms)
    assert tables["measures"].filter(pl.col("key") == "gpu_busy_frac").height == 1
    assert c.to_pandas("phases").shape[0] == tables["phases"].height
    assert repr(c).startswith("<Comparison h100_comm_ep2.sqlite → ") and "\n" not in repr(c)


# Kernel lists cut short, and the thresholds as data -------------------------------------------


def _side(kernels: dict[str, float], truncated: bool, other: float = 0.0) -> Side:
    return Side(
        steps=10,
        account=dict.fromkeys(
            ("step_ms", "kernel_ms", "overlap_ms", "copy_ms", "idle_ms", "graph_ms"), 0.0
        ),
        idle_sd_ms=0.0,
        idle_by_cause={},
        kernels={
            name: {
                "short_name": name,
                "family": None,
                "ms": ms,
                "sd_ms": 0.01,
                "instances": 1.0,
                "shapes": [],
            }
            for name, ms in kernels.items()
        },
        other_ms=other,
        truncated=truncated,
    )


def test_a_kernel_missing_from_a_list_cut_short_is_not_called_removed() -> None:
    settings = comparison_settings()
    before = _side({"a": 5.0, "b": 0.2}, truncated=False)
    after = _side({"a": 5.0}, truncated=True, other=0.3)  # b may be among the unlisted
    changes, other = kernel_diff(before, after, settings, 100.0)
    assert [k.name for k in changes] == ["a"] and changes[0].status == "same"
    assert (other.before_ms_per_step, other.after_ms_per_step) == (0.2, 0.3)
    complete = _side({"a": 5.0}, truncated=False)
    changes, _ = kernel_diff(before, complete, settings, 100.0)
    assert {k.name: k.status for k in changes} == {"a": "same", "b": "removed"}
    assert not next(k for k in changes if k.name == "b").material  # 0.2 ms < 1% of 100 ms


def test_comparison_thresholds_come_from_the_rules(tmp_path: Path) -> None:
    settings = comparison_settings()
    assert (settings.noise_standard_errors, settings.part_share) == (2.0, 0.01)
    (tmp_path / "strict.yaml").write_text(
        "scoring:\n  comparison: {noise_standard_errors: 2, material_points: 0.03,\n"
        "    material_relative: 0.2, part_share: 0.5, memory_share: 0.05}\n",
        encoding="utf-8",
    )
    from traceclf.pipeline.analysis import AnalysisOptions

    strict = comparison_settings(AnalysisOptions(rules_dir=tmp_path, use_cache=False))
    assert strict.part_share == 0.5
    loose = compare_reports(report(SLOW), report(FAST))
    tight = compare_reports(report(SLOW), report(FAST), settings=strict)
    assert sum(k.material for k in tight.breakdown.kernels) < sum(
        k.material for k in loose.breakdown.kernels
    )
    (tmp_path / "strict.yaml").write_text("scoring:\n  comparison: {part_share: 2}\n")
    with pytest.raises(TraceError, match="comparison"):
        comparison_settings(AnalysisOptions(rules_dir=tmp_path, use_cache=False))


def test_what_makes_runs_not_comparable_comes_right_under_the_verdict(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """Two unrelated public programs on two GPUs read "Regression: step 33 ms → 549 ms" with
    "Not directly comparable: different GPUs" at the very end. The notes qualify the verdict:
    they come right under it, in every format, and make the comparison inconclusive (exit 3:
    nothing to gate on). Real traces: host-launch (H100) against CloverLeaf (A100, pattern
    steps)."""
    other = tmp_path / "cloverleaf.json"
    other.write_text(report("cloverleaf_a100").to_json(), encoding="utf-8")
    for fmt, note, steps in (
        ("terminal", "Not directly comparable: different GPUs", "Step time"),
        ("md", "## Not directly comparable", "## Step time"),
    ):
        code, out, err = run_cli("compare", saved[SLOW], other, "-f", fmt)
        assert code == 3, err
        assert "not comparable (different GPUs; steps found differently)" in out
        assert -1 < out.index(note) < out.index(steps), fmt
    html = tmp_path / "cmp.html"
    code, _, err = run_cli("compare", saved[SLOW], other, "-f", "html", "-o", html)
    text = html.read_text(encoding="utf-8")
    assert code == 3 and text.index("Not directly comparable") < text.index("Step time")
