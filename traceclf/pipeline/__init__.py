"""The pipeline: inputs -> per-export map step (load, steps, measures; cached) -> grouping into
runs -> per-run reduce (judge) -> reports."""
