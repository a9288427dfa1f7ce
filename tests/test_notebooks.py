"""Every notebook in notebooks/ runs top to bottom, offline, from the repository root and from
notebooks/, and is committed without outputs."""

from __future__ import annotations

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
