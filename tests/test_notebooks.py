"""Every notebook in notebooks/ runs top to bottom, offline, from the repository root and from
notebooks/, and is committed without outputs."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip(
    "nbformat", reason="nbformat not installed (pip install -e '.[dev]')"
)
nbclient = pytest.importorskip(
    "nbclient", reason="nbclient not installed (pip install -e '.[dev]')"
)
pytest.importorskip("ipykernel", reason="ipykernel not installed (pip install -e '.[dev]')")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(notebook: Path) -> None:
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.parametrize("cwd", ["notebooks", "."], ids=["from-notebooks", "from-root"])
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(
    notebook: Path, cwd: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel inherits the environment: keep any cache it writes out of the user's home.
    monkeypatch.setenv("TRACECLF_CACHE_DIR", str(tmp_path / "cache"))
    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",  # jupyter_client runs "python" specs with this interpreter
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(REPO / cwd)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error


def run_cells(
    cells: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[list[dict]]:
    """The outputs of each of ``cells`` run as a fresh notebook from the repository root, as a
    user's notebook would run them (no ``%matplotlib`` magic unless a cell says so)."""
    monkeypatch.setenv("TRACECLF_CACHE_DIR", str(tmp_path / "cache"))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(REPO)}},
    )
    client.execute()
    return [cell.outputs for cell in nb.cells]


def test_figures_display_as_images_without_matplotlib_magic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/api.md: ``display(fig)`` or a figure as a cell's value shows the picture, with no
    ``%matplotlib inline`` first (a Figure made without pyplot has no formatter otherwise)."""
    outputs = run_cells(
        [
            "import traceclf\nfrom traceclf import api\nfrom IPython.display import display\n"
            "figures = api.figures(traceclf.analyze('fixtures/h100_comm_ep2.sqlite'))",
            "figures['step_timeline']",
            "for fig in figures.values():\n    display(fig)",
        ],
        tmp_path,
        monkeypatch,
    )
    shown = [out for cell in outputs[1:] for out in cell]
    assert len(shown) == 1 + 3  # the cell's value, then step_timeline, step_lanes, comm_overlap
    for out in shown:
        png = base64.b64decode(out["data"]["image/png"])
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_runs_display_in_the_order_named_without_demangled_signatures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run set as a cell's value: its summary and each run in the order the files were named,
    a recurring kernel that marks the steps named by its function, not its whole signature."""
    import traceclf

    first = "fixtures/external/ulysses_2gpu_forward_window.sqlite"
    second = "fixtures/external/cloverleaf_a100.sqlite"
    outputs = run_cells(
        [
            f"import traceclf\nruns = traceclf.analyze({first!r}, {second!r})\nruns",
            "runs.summary['run'].to_list()",
        ],
        tmp_path,
        monkeypatch,
    )
    shown = html.unescape(re.sub(r"<[^>]+>", " ", outputs[0][0]["data"]["text/html"]))
    labels = [r.steps["label"] for r in traceclf.analyze(REPO / first, REPO / second).runs]
    assert all(label.startswith("void ") and "(" in label for label in labels), labels
    for label in labels:
        assert label not in shown  # the whole demangled signature
    assert "void " not in shown and '"par_ranged2d_kernel"' in shown
    raw = outputs[0][0]["data"]["text/html"]
    summary = raw[raw.index("<tbody>") : raw.index("</tbody>")]  # the summary table, then each run
    assert summary.index("ulysses_2gpu") < summary.index("cloverleaf_a100.sqlite")
    run_2 = raw.index('<section id="run-2"')
    assert "ulysses_2gpu" in raw[raw.index('<section id="run-1"') : run_2]
    assert "cloverleaf_a100.sqlite" in raw[run_2:]
    assert outputs[1][0]["data"]["text/plain"] == str(
        ["ulysses_2gpu_forward_window.sqlite", "cloverleaf_a100.sqlite"]
    )
