"""Guarantees about the code's layout (issues 9 and 27): imports run one way, down the declared
layer order, with no cycle; the top level stays a handful of stage packages; the map in
docs/architecture.md names every module; no module grows past ~500 lines; and the report JSON
of every fixture trace is exactly the reviewed snapshot in tests/snapshots/ (so a refactor
cannot change a verdict unnoticed).

A fixture without a snapshot fails. When a change *means* to alter reports, or a fixture is
added, write the snapshots (only with this variable set) and review their diff:

    TRACECLF_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest -q tests/test_layout.py -k snapshot
"""

from __future__ import annotations

import ast
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


# The layers of traceclf, bottom to top (docs/architecture.md, "Layers"): a module may import
# from its own layer and the layers below it, never from one above. A layer is a package of
# traceclf, or a loose module (api, cli); the package's own __init__.py and __main__.py are
# the top, with cli.
LAYERS = (
    "support",  # errors, atomic writes, JSON text, progress, units: nothing else of traceclf
    "rulebook",  # rule files as data (no taxonomy expressions, no measure names)
    "model",  # Trace, correlation, the taxonomy as polars expressions
    "ingest",  # exports -> Trace, and the caches
    "steps",  # steps and the steady-state window
    "measures",  # numbers of one rank, and what it hands to the cross-rank stage
    "judge",  # rules fired on the numbers: verdict, fixes, straggler, abstention
    "report",  # the report, run set and comparison as data
    "figures",
    "export",
    "render",
    "pipeline",  # orchestration: map step, step sampling's two passes, grouping, reduce
    "compare",
    "api",
    "cli",
)
TOP_LEVEL = {"__init__": "cli", "__main__": "cli"}  # the package itself runs the CLI or the API
# Loose modules beside the stage packages, besides cli, api, __init__ and __main__.
MAX_LOOSE = 6


def module_names() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package by its name)."""
    names = {}
    for path in modules():
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def layer_of(module: str) -> int:
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    return LAYERS.index(TOP_LEVEL.get(first, first))


def imports() -> dict[str, set[str]]:
    """Module -> the traceclf modules it imports. Every import statement counts: at the top,
    inside functions (lazy imports) and under ``if TYPE_CHECKING:`` (this package keeps even
    those acyclic and downward, so no exclusion is needed)."""
    names = module_names()
    graph: dict[str, set[str]] = {}
    for module, path in names.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                wanted = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names
                ]
            else:
                continue
            for name in wanted:
                while name not in names and "." in name:
                    name = name.rpartition(".")[0]
                if name in names and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def test_every_package_has_a_layer():
    tops = {name.split(".")[1] for name in module_names() if "." in name}
    assert not {TOP_LEVEL.get(t, t) for t in tops} - set(LAYERS), "add new packages to LAYERS"


def test_imports_go_down_the_layers():
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in imports().items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )
    assert not upward, f"imports against the layer order {LAYERS}: {upward}"


def test_no_import_cycle():
    graph = imports()
    cycles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert not cycles, f"import cycles (lazy imports included): {cycles}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively (no recursion limit on a long chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component)
    return out


def test_module_names_are_unique():
    """One name, one module: no two modules, nor a module and a package, share a name across
    packages, so that a name in a traceback, a log or a doc says which file it is."""
    names = [p.stem for p in modules() if p.name != "__init__.py"]
    names += [p.parent.name for p in modules() if p.name == "__init__.py" and p.parent != PACKAGE]
    assert not sorted({n for n in names if names.count(n) > 1})


def test_the_top_level_is_stage_packages():
    loose = sorted(
        p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__", "api", "cli")
    )
    assert len(loose) <= MAX_LOOSE, f"loose modules beside the stage packages: {loose}"


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
    if UPDATE:
        snapshot.write_text(got, encoding="utf-8")
        pytest.skip(f"snapshot written: {snapshot.name}")
    # A missing snapshot is a failure, not a snapshot quietly taken of whatever the code says.
    assert snapshot.exists(), (
        f"no snapshot of {export.name}: review its report, then write it (see this module's "
        "docstring)"
    )
    assert got == snapshot.read_text(encoding="utf-8"), (
        f"the report of {export.name} changed; if that is intended, regenerate the snapshots "
        "(see this module's docstring) and review the diff"
    )
