"""The report contract (docs/report-contract.md): every report of every fixture trace validates
against docs/report-schema.json, and the contract document names every top-level and capture
key a report carries."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES
from helpers.cli import run_cli

DOCS = Path(__file__).resolve().parents[1] / "docs"
EXPORTS = sorted(FIXTURES.glob("*.sqlite")) + sorted((FIXTURES / "external").glob("*.sqlite"))


@cache
def schema() -> dict:
    return json.loads((DOCS / "report-schema.json").read_text(encoding="utf-8"))


@cache
def report(path: Path) -> dict:
    code, out, err = run_cli("analyze", path, "--format", "json", "--no-cache", "-q")
    assert code == 0, err
    return json.loads(out)


def test_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(schema())


@pytest.mark.parametrize("export", EXPORTS, ids=lambda p: p.stem)
def test_report_validates_against_the_schema(export: Path):
    jsonschema.Draft202012Validator(schema()).validate(report(export))


def test_contract_names_every_key_a_report_carries():
    doc = (DOCS / "report-contract.md").read_text(encoding="utf-8")
    keys: set[str] = set()
    for export in EXPORTS:
        r = report(export)
        keys |= set(r) | set(r["capture"]) | set(r["classification"]) | set(r["cross_rank"])
        for fix in r["fixes"]:
            keys |= set(fix)
    missing = sorted(k for k in keys if f'"{k}"' not in doc and f"`{k}`" not in doc)
    assert not missing, f"docs/report-contract.md does not name: {missing}"


def test_an_abstained_report_validates_and_has_no_fixes():
    r = report(FIXTURES / "external" / "nvfuser_matmul_test_h100.sqlite")
    assert r["classification"]["bound"] is None and r["fixes"] == []
    broken = json.loads(json.dumps(r))
    broken["classification"].pop("abstain_reason")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema()).validate(broken)


def test_the_several_runs_shape_validates_against_the_schema():
    """The multi-run JSON documented in report-contract.md ("Several runs at once") is what the
    schema's root accepts besides one report ($defs/run_set); neither shape passes as the other."""
    paths = [FIXTURES / "h100_comm_ep2.sqlite", FIXTURES / "h100_host_input_stall.sqlite"]
    code, out, err = run_cli("analyze", *paths, "--runs", "--format", "json", "-q")
    assert code == 0, err
    runs = json.loads(out)
    assert set(runs) == {"report_version", "runs", "summary", "grouping"}
    validator = jsonschema.Draft202012Validator(schema())
    validator.validate(runs)
    assert [row["run"] for row in runs["summary"]] == [p.name for p in paths]
    for broken in (
        {k: v for k, v in runs.items() if k != "summary"},
        {**runs, "grouping": {**runs["grouping"], "mode": "job"}},
        {**runs, "summary": [{**runs["summary"][0], "bound": "disk"}, runs["summary"][1]]},
        runs["runs"][0] | {"runs": runs["runs"]},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(broken)
    validator.validate(runs["runs"][0])  # a run alone is a report
