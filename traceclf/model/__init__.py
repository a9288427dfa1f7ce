"""The trace model: one polars frame per event kind (:mod:`.trace`), the CUDA call behind each
GPU operation (:mod:`.correlation`) and what a kernel, CUDA call or NVTX range is
(:mod:`.taxonomy`)."""
