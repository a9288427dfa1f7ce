"""The host's own time in CUDA calls per step: what a step cannot be shorter than once the host
stops waiting for the GPU (the floor of a fix that removes the waits)."""

from __future__ import annotations

import polars as pl

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
    if not w.host_traced:
        return dict.fromkeys(MEASURES)
    calls = w.step_calls(every=True).filter(~pl.col("is_wait").fill_null(False))
    busiest = max((Busy.of(thread).total for thread in calls.partition_by("global_tid")), default=0)
    return {"host_call_ms_per_step": busiest / w.n_steps / 1e6}
