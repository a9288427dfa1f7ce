"""The host's own time in CUDA calls per step: what a step cannot be shorter than once the host
stops waiting for the GPU (the floor of a fix that removes the waits)."""

from __future__ import annotations

import numpy as np

from traceclf.measures.intervals import Busy
from traceclf.measures.window import RankWindow

MEASURES: dict[str, str] = {
    "host_call_ms_per_step": "ms per step that the busiest host thread spends in the steps' "
    "CUDA calls other than those that only wait (cudaStreamSynchronize, "
    "cudaDeviceSynchronize, cudaEventSynchronize; taxonomy cuda_api wait), each thread's calls "
    "as a union: without the waits, a step still takes that long on the host (null: the CUDA "
    "API was not traced)",
}


def host_call_ms(w: RankWindow) -> dict[str, float | None]:
    """Read from the calls' columns by a mask, a thread at a time: over ``--all-steps`` the
    steps hold millions of calls, and a frame of them all was 0.2 GB more at the peak."""
    if not w.host_traced:
        return dict.fromkeys(MEASURES)
    api = w.trace.api
    keep = w.step_call_mask & ~w.flagged["is_wait"].fill_null(False).to_numpy()
    tids = api["global_tid"].fill_null(-1).to_numpy()
    starts, ends = api["start"].to_numpy(), api["end"].to_numpy()
    busiest = 0
    for tid in np.unique(tids[keep]):
        mine = keep & (tids == tid)
        busiest = max(busiest, Busy.of_arrays(starts[mine], ends[mine]).total)
    return {"host_call_ms_per_step": busiest / w.n_steps / 1e6}
