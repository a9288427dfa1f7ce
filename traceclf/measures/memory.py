"""The memory wall: host<->device traffic (activation offload), pageable copies, full
recompute and device memory at capacity."""

from __future__ import annotations

import numpy as np
import polars as pl

from traceclf.measures import intervals
from traceclf.measures.intervals import Busy
from traceclf.measures.window import RankWindow
from traceclf.model.trace import (
    DEVICE_TO_DEVICE,
    DEVICE_TO_HOST,
    HOST_MEMORY_KINDS,
    HOST_TO_DEVICE,
    PINNED_MEMORY_KIND,
)

MEASURES: dict[str, str] = {
    "offload_copy_frac": "union of host<->device copy time",
    "h2d_d2h_bytes_per_step": "bytes copied host<->device per step",
    "h2d_bytes_per_step": "bytes copied host->device per step",
    "d2h_bytes_per_step": "bytes copied device->host per step",
    "device_copy_bytes_per_step": "bytes copied device->device per step (on one GPU, between "
    "GPUs, CUDA arrays and unified memory: copy kinds DtoD, PtoP, AtoA, AtoD, DtoA, UVM_DtoD): "
    "copies that use no host link",
    "memset_bytes_per_step": "bytes set by memsets per step",
    "d2d_frac": "union of the time of copies within one GPU's memory (copy kind DtoD)",
    "d2d_bytes_per_step": "bytes of those copies per step",
    "exposed_d2d_frac": "time of those copies with no kernel (compute or communication) running",
    "d2d_in_collective_frac": "share of those copies' time (a union) whose CUDA call started "
    "inside a collective's NVTX range on its thread (taxonomy nvtx_collectives: NCCL's or "
    "PyTorch's), as NCCL's copy of a one-rank communicator's buffer is (null without copies, "
    "NVTX ranges or the CUDA calls that made them)",
    "pageable_copies_per_step": "memcpys from/to pageable host memory per step",
    "pageable_bytes_per_step": "bytes of those copies per step",
    "small_d2h_per_step": "device->host copies of <= 1 KiB per step (.item(), nonzero results)",
    "pageable_copy_frac": "union of the time of copies from/to pageable host memory",
    "uvm_bytes_per_step": "bytes of unified-memory page migrations per step (host<->device, "
    "copy kinds UVM_HtoD/UVM_DtoH: cudaMallocManaged memory moved as the GPU or the host "
    "touches it); part of h2d_d2h_bytes_per_step",
    "uvm_copy_frac": "union of the time of those migrations (part of offload_copy_frac)",
    "h2d_frac": "union of host->device copy time",
    "d2h_frac": "union of device->host copy time",
    "exposed_offload_frac": "host<->device copy time with no kernel (compute or communication) "
    "running",
    "host_copy_duplex_frac": "share of the shorter copy direction's time (host->device or "
    "device->host, as unions) during which the other direction copies too: how much the two "
    "directions share the host link's duplex (null: copies one way or none)",
    "h2d_gbps": "achieved host->device bandwidth (GB/s) of copies >= 1 MiB (null: none)",
    "d2h_gbps": "achieved device->host bandwidth (GB/s) of copies >= 1 MiB (null: none)",
    "recompute_frac": "share of forward GEMM/attention kernels re-run in backward (needs "
    "forward/backward NVTX ranges; null otherwise)",
    "recompute_ms_per_step": "ms per step of the forward GEMM/attention work re-run in "
    "backward: per kernel shape re-run, the forward's mean time times the launches re-run "
    "(null where recompute_frac is)",
    "peak_memory_bytes": "peak device memory allocated over the whole capture, not only the "
    "window (CUDA_GPU_MEMORY_USAGE_EVENTS of the device's own memory kinds: pinned and "
    "pageable host buffers left out)",
    "peak_memory_frac": "peak_memory_bytes over the GPU's capacity",
    "pinned_host_peak_bytes": "peak of pinned host memory the memory events record (cudaHostAlloc, "
    "pin_memory buffers): host memory, not counted in peak_memory_bytes (null without memory "
    "events)",
}
SMALL_D2H_BYTES = 1024
BANDWIDTH_MIN_BYTES = 1 << 20  # smaller copies are latency-bound: their rate says nothing


def copies(w: RankWindow) -> dict[str, float]:
    n_steps = w.n_steps
    memcpy = w.copies.filter(pl.col("op") == "memcpy")
    h2d = memcpy.filter(pl.col("direction").is_in(HOST_TO_DEVICE))
    d2h = memcpy.filter(pl.col("direction").is_in(DEVICE_TO_HOST))
    offload = pl.concat([h2d, d2h])
    on_device = memcpy.filter(pl.col("direction").is_in(DEVICE_TO_DEVICE))
    local = memcpy.filter(pl.col("direction") == "DtoD")
    memset = w.copies.filter(pl.col("op") == "memset")
    pageable = memcpy.filter(pl.col("pageable"))
    uvm = offload.filter(pl.col("direction").is_in(["UVM_HtoD", "UVM_DtoH"]))
    return {
        "h2d_d2h_bytes_per_step": int(offload["bytes"].sum()) / n_steps,
        "h2d_bytes_per_step": int(h2d["bytes"].sum()) / n_steps,
        "d2h_bytes_per_step": int(d2h["bytes"].sum()) / n_steps,
        "device_copy_bytes_per_step": int(on_device["bytes"].sum()) / n_steps,
        "memset_bytes_per_step": int(memset["bytes"].fill_null(0).sum()) / n_steps,
        "d2d_frac": intervals.total(local) / w.wall,
        "d2d_bytes_per_step": int(local["bytes"].sum()) / n_steps,
        "exposed_d2d_frac": w.uncovered(local, w.layers.compute_comm) / w.wall,
        "d2d_in_collective_frac": _in_collectives(local, w),
        "offload_copy_frac": intervals.total(offload) / w.wall,
        "pageable_copies_per_step": len(pageable) / n_steps,
        "pageable_bytes_per_step": int(pageable["bytes"].sum()) / n_steps,
        "small_d2h_per_step": len(d2h.filter(pl.col("bytes") <= SMALL_D2H_BYTES)) / n_steps,
        "pageable_copy_frac": intervals.total(pageable) / w.wall,
        "uvm_bytes_per_step": int(uvm["bytes"].sum()) / n_steps,
        "uvm_copy_frac": intervals.total(uvm) / w.wall,
        "h2d_frac": intervals.total(h2d) / w.wall,
        "d2h_frac": intervals.total(d2h) / w.wall,
        "host_copy_duplex_frac": _duplex(h2d, d2h),
        "exposed_offload_frac": w.uncovered(offload, w.layers.compute_comm) / w.wall,
        "h2d_gbps": _gbps(h2d),
        "d2h_gbps": _gbps(d2h),
    }


def _in_collectives(copies: pl.DataFrame, w: RankWindow) -> float | None:
    """Share of ``copies``' time (a union) whose CUDA call started inside a collective's NVTX
    range (NCCL's or PyTorch's, taxonomy ``nvtx_collectives``) on the calling thread, ends
    included as for the collectives' kinds; null without copies, without NVTX ranges or
    without the calls that made them."""
    total = intervals.total(copies)
    nvtx = w.trace.nvtx
    if not total or nvtx.is_empty():
        return None
    calls = w.trace.call_index  # the call that issued each copy, by correlationId
    made = calls.column("global_tid", copies["pid"], copies["correlation_id"])
    if made.null_count() == len(made):  # (no CUDA call traced: where they were made is unknown)
        return None
    # (a copy whose call is not in the trace: no thread, never inside)
    at = calls.column("start", copies["pid"], copies["correlation_id"]).fill_null(0).to_numpy()
    tid = made.fill_null(-1).to_numpy()
    inside = np.zeros(len(copies), bool)
    for (thread,), rows in w.collective_ranges.group_by("global_tid"):
        busy = Busy.of(rows)  # (nested ranges: one union per thread)
        mine = tid == thread
        j = np.searchsorted(busy.start, at[mine], side="right") - 1
        inside[mine] = (j >= 0) & (at[mine] <= busy.end[np.maximum(j, 0)])
    return intervals.total(copies.filter(pl.Series(inside))) / total


def _duplex(h2d: pl.DataFrame, d2h: pl.DataFrame) -> float | None:
    """Share of the shorter direction's copy time that overlaps the other direction's."""
    if h2d.is_empty() or d2h.is_empty():
        return None
    to_device, to_host = Busy.of(h2d), Busy.of(d2h)
    shorter = min(to_device.total, to_host.total)
    return to_device.overlap(to_host) / shorter if shorter else None


def _gbps(copies: pl.DataFrame) -> float | None:
    big = copies.filter(pl.col("bytes") >= BANDWIDTH_MIN_BYTES)
    ns = int((big["end"] - big["start"]).sum())
    return int(big["bytes"].sum()) / ns if ns else None  # bytes per ns = GB/s


def recompute(w: RankWindow, phase_ranges: pl.DataFrame) -> dict[str, float | None]:
    """Forward GEMM/attention kernels seen again in backward: a full-recompute signature.
    Without recompute, backward runs different GEMMs (dgrad/wgrad shapes and layouts).
    ``phase_ranges``: the rank's NVTX ranges of a phase (measures/phases.py: ``labelled``).
    ``recompute_frac`` counts the launches re-run; ``recompute_ms_per_step`` times them, each
    shape at its forward's mean (the work a selective recompute stops re-running)."""
    unknown = {"recompute_frac": None, "recompute_ms_per_step": None}
    phases = phase_ranges.filter(pl.col("phase").is_in(["forward", "backward"]))
    if (
        phases.filter(pl.col("phase") == "forward").is_empty()
        or phases.filter(pl.col("phase") == "backward").is_empty()
    ):
        return unknown
    heavy = w.kern.filter(pl.col("family").is_in(["gemm", "attention"]))
    heavy = heavy.with_columns(w.trace.launched_in(heavy, phases, "phase")).drop_nulls("phase")
    sig = ["name", "grid_blocks", "block_threads"]
    per = heavy.group_by([*sig, "phase"]).agg(
        n=pl.len(), ns=(pl.col("end") - pl.col("start")).sum()
    )
    forward = per.filter(pl.col("phase") == "forward").drop("phase")
    backward = per.filter(pl.col("phase") == "backward").select(*sig, back=pl.col("n"))
    launches = int(forward["n"].sum())
    if not launches:
        return unknown
    both = forward.join(backward, on=sig, how="left", nulls_equal=True).with_columns(
        again=pl.min_horizontal("n", pl.col("back").fill_null(0))
    )
    rerun_ns = float((both["again"] * both["ns"] / both["n"]).sum())
    return {
        "recompute_frac": int(both["again"].sum()) / launches,
        "recompute_ms_per_step": rerun_ns / 1e6 / w.n_steps,
    }


def peak(w: RankWindow, device: pl.DataFrame) -> dict[str, float | None]:
    """Peak of allocated device memory (allocation events over the whole capture, since memory
    allocated during warm-up is still held in the steady state; ``device``: the rank's
    :func:`device_memory` events), and apart from it the peak of pinned host memory: the
    events record both, and host buffers (activations offloaded to pinned memory) do not fill
    the GPU."""
    mem = w.trace.memory
    capacity = (w.gpu or {}).get("memory_bytes")
    if mem.is_empty():
        return dict.fromkeys(("peak_memory_bytes", "peak_memory_frac", "pinned_host_peak_bytes"))
    top = _peak(device)
    return {
        "peak_memory_bytes": top,
        "peak_memory_frac": top / capacity if capacity else None,
        "pinned_host_peak_bytes": _peak(mem.filter(pl.col("mem_kind") == PINNED_MEMORY_KIND)),
    }


def device_memory(mem: pl.DataFrame) -> pl.DataFrame:
    """The memory events of the GPU's own memory: every kind but host memory (an export
    without memory kinds: all of them)."""
    return mem.filter(~pl.col("mem_kind").is_in(HOST_MEMORY_KINDS).fill_null(False))


def _peak(mem: pl.DataFrame) -> int:
    """The highest level of allocated bytes (allocations minus frees in time order, per
    device), counted from the capture's start; 0 without events, and at least 0: frees of
    memory allocated before the capture take the level below its start, which is no peak
    (every event a free made it negative: -87% of capacity)."""
    level = pl.col("delta").cum_sum()
    devices = mem["device_id"]
    if devices.null_count() or devices.min() != devices.max():  # (one device: no grouping)
        level = level.over("device_id")
    top = mem.sort("start").select(level.max()).item()
    return max(int(top or 0), 0)  # type: ignore[arg-type]
