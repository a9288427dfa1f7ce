"""Shared test fixtures: the real exports in fixtures/, NVIDIA's oracle CSVs, a CLI runner.

Helpers that tests import directly live in tests/helpers/ (``from helpers.cli import ...``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.cli import CliResult, run_cli
from helpers.files import copy_export

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ORACLE = FIXTURES / "nvidia-oracle"

# Real exports copied whole; NVIDIA's oracle CSVs hold for them as they are.
FULL_TRACES = (
    "h100_comm_ep2",
    "h100_comm_ep2_overlap",
    "h100_compute_low_occupancy",
    "h100_host_cudagraph",
    "h100_host_cudagraph_nodetrace",
    "h100_host_input_stall",
    "h100_memory_offload",
)
# Trimmed copies of large traces (see fixtures/README.md): "<source trace>_trimmed".
TRIMMED_TRACES = (
    "h100_comm_a2a_gpumetrics",
    "h100_compute_dense_gpumetrics",
    "h100_host_launch_gpumetrics",
)
SMALL_TRACE = "h100_comm_ep2"  # two ranks, NVTX, copies, syncs: the default test subject


def fixture_trace(name: str) -> Path:
    """Path of a fixture export by trace name, e.g. ``fixture_trace("h100_comm_ep2")``."""
    path = FIXTURES / f"{name}.sqlite"
    if not path.is_file():
        suffix = "_trimmed" if name in TRIMMED_TRACES else ""
        path = FIXTURES / f"{name}{suffix}.sqlite"
    assert path.is_file(), f"missing fixture {path} (rebuild with fixtures/make_fixtures.py)"
    return path


def oracle_csv(trace: str, report: str) -> Path:
    """NVIDIA's ``nsys stats`` CSV ``report`` (e.g. "cuda_gpu_kern_sum") for ``trace``."""
    return ORACLE / f"{trace}_{report}.csv"


@pytest.fixture
def small_export(tmp_path: Path) -> Path:
    """A private, writable copy of the default real export, alone in its own folder."""
    folder = tmp_path / "run"
    folder.mkdir()
    return copy_export(fixture_trace(SMALL_TRACE), folder / f"{SMALL_TRACE}.sqlite")


@pytest.fixture
def cli() -> Callable[..., CliResult]:
    """``cli("analyze", path)`` runs traceclf in-process and returns code, stdout, stderr."""
    return run_cli


@pytest.fixture
def private_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$TRACECLF_CACHE_DIR pointed into tmp_path, so nothing lands in ~/.cache."""
    cache_dir = tmp_path / "user-cache"
    monkeypatch.setenv("TRACECLF_CACHE_DIR", str(cache_dir))
    return cache_dir


@pytest.fixture(autouse=True, scope="session")
def _session_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """Every test caches into one session folder, never into the user's cache directory
    (tests that check the cache's location point $TRACECLF_CACHE_DIR elsewhere themselves)."""
    import os

    cache_dir = tmp_path_factory.mktemp("session-cache")
    old = os.environ.get("TRACECLF_CACHE_DIR")
    os.environ["TRACECLF_CACHE_DIR"] = str(cache_dir)
    yield cache_dir
    if old is None:
        os.environ.pop("TRACECLF_CACHE_DIR", None)
    else:
        os.environ["TRACECLF_CACHE_DIR"] = old
