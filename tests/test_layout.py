"""Issue 9's guarantees about the code's layout: the map in docs/architecture.md names every
module, no module grows past ~500 lines, and the report JSON of every fixture trace is exactly
the reviewed snapshot in tests/snapshots/ (so a refactor cannot change a verdict unnoticed).

When a change *means* to alter reports, regenerate the snapshots and review their diff:

    TRACECLF_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest -q tests/test_layout.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import FIXTURES
from helpers.cli import run_cli

PACKAGE = Path(__file__).resolve().parents[1] / "traceclf"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
MAX_LINES = 520  # "no module over ~500 lines"
UPDATE = os.environ.get("TRACECLF_UPDATE_SNAPSHOTS") == "1"


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_architecture_names_every_module():
    doc = ARCHITECTURE.read_text(encoding="utf-8")
    missing = []
    for path in modules():
        rel = path.relative_to(PACKAGE.parent)
        name = f"{rel.parent}/" if path.name == "__init__.py" else str(rel)
        if f"`{name}`" not in doc and f"`{name}` (" not in doc:
            missing.append(name)
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_no_module_is_huge():
    sizes = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in modules()}
    assert not {m: n for m, n in sizes.items() if n > MAX_LINES}


def _normalised(report_json: str) -> str:
    """The report with what differs between machines (paths, version) made neutral."""
    data = json.loads(report_json)
    data["traceclf_version"] = "<version>"
    for entry in data.get("inputs", []):
        entry["path"] = Path(entry["path"]).name
    for rank in data.get("ranks", []):
        rank["file"] = Path(rank["file"]).name
    worst = (data.get("steps") or {}).get("worst") or {}
    if worst.get("file"):
        worst["file"] = Path(worst["file"]).name
    return json.dumps(data, indent=1, sort_keys=False) + "\n"


EXPORTS = sorted(FIXTURES.glob("*.sqlite")) + sorted((FIXTURES / "external").glob("*.sqlite"))


@pytest.mark.parametrize("export", EXPORTS, ids=lambda p: p.stem)
def test_report_matches_snapshot(export: Path, tmp_path: Path):
    code, out, err = run_cli("analyze", export, "--format", "json", "--no-cache", "-q")
    assert code == 0, err
    got = _normalised(out)
    snapshot = SNAPSHOTS / f"{export.stem}.json"
    if UPDATE or not snapshot.exists():
        snapshot.write_text(got, encoding="utf-8")
        pytest.skip(f"snapshot written: {snapshot.name}")
    assert got == snapshot.read_text(encoding="utf-8"), (
        f"the report of {export.name} changed; if that is intended, regenerate the snapshots "
        "(see this module's docstring) and review the diff"
    )
