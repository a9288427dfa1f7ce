"""Where one rank's steady-state step goes: step times, GPU busy and idle, compute,
communication and copies (and how much of each nothing else hides), read off the state
timeline."""

from __future__ import annotations

import polars as pl

from traceclf.measures.window import RankWindow

MEASURES: dict[str, str] = {
    "step_time_ms": "mean duration of steady-state steps (GPU start to next step's GPU start)",
    "step_time_median_ms": "median of the same",
    "step_time_cv": "standard deviation / mean of steady-state step times",
    "gpu_busy_frac": "union of kernels, CUDA-graph executions, memcpy and memset",
    "gpu_idle_frac": "1 - gpu_busy_frac",
    "compute_frac": "time at least one non-communication kernel or graph execution runs",
    "comm_frac": "union of communication kernels (NCCL, DeepEP, HybridEP, NVSHMEM, userbuffers)",
    "exposed_comm_frac": "communication time with no compute kernel running at the same time",
    "comm_overlap_frac": "share of communication time hidden under compute (of comm time)",
    "compute_under_comm_frac": "share of compute time that runs while communication is in "
    "flight (of compute time): > 0 means comm/compute overlap is in place",
    "copy_frac": "union of memcpy/memset time",
    "exposed_copy_frac": "copy time with neither compute nor communication running",
}


def measure(w: RankWindow) -> dict[str, float | None]:
    state = w.state
    wall = w.wall
    durations = w.steps.durations()
    return {
        "step_time_ms": _ms(durations.mean()),
        "step_time_median_ms": _ms(durations.median()),
        "step_time_cv": _cv(durations),
        "gpu_busy_frac": state["busy"] / wall,
        "gpu_idle_frac": 1 - state["busy"] / wall,
        "compute_frac": state["compute"] / wall,
        "comm_frac": state["comm"] / wall,
        "exposed_comm_frac": state["exposed_comm"] / wall,
        "comm_overlap_frac": (1 - state["exposed_comm"] / state["comm"]) if state["comm"] else None,
        "compute_under_comm_frac": (state["compute"] - state["compute_only"]) / state["compute"]
        if state["compute"]
        else None,
        "copy_frac": state["copy"] / wall,
        "exposed_copy_frac": state["exposed_copy"] / wall,
    }


def _ms(ns: float | None) -> float | None:
    return float(ns) / 1e6 if ns is not None else None


def _cv(durations: pl.Series) -> float | None:
    if len(durations) < 2:
        return None
    return float(durations.std()) / float(durations.mean())
