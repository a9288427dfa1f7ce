"""What a kernel is, from its name and launch configuration: family, communication library and
collective kind, and theoretical occupancy."""

from __future__ import annotations

import polars as pl

# First match wins: communication before GEMM (NCCL kernels mention neither), attention before
# GEMM (flash attention is built on CUTLASS).
FAMILIES: tuple[tuple[str, str], ...] = (
    ("communication", r"(?i)^(void )?(nccl|deep_ep::)|hybrid_?ep|nvshmem|userbuffers"),
    ("attention", r"(?i)flash|fmha|attention|_attn|attn_|sdpa|mha_"),
    ("gemm", r"(?i)gemm|nvjet|cutlass|cublas|xmma|wgmma|gemv|matmul|s16816|h16816|s1688"),
    ("optimizer", r"(?i)adam|sgd|\blamb[_(]|\blion[_(]|optimizer|multi_tensor_apply"),
    (
        "permute_moe",
        r"(?i)permute|row_id_map|moe|topk|router|radix|sort|scatter|gather|index|"
        r"nonzero|histogram|bincount",
    ),
    ("reduction", r"(?i)reduce|norm|softmax|cross_entropy|nll_loss|cumsum|sum_kernel|mean"),
    (
        "elementwise",
        r"(?i)elementwise|vectorized|activation|gelu|silu|relu|fill|copy|cast|"
        r"dropout|triton|mul|add|where|pow|sqrt|exp",
    ),
)

COMM_LIBRARIES: tuple[tuple[str, str], ...] = (
    ("nccl", r"(?i)^(void )?nccl"),
    ("deepep", r"deep_ep::"),
    ("hybridep", r"(?i)hybrid_?ep"),
    ("nvshmem", r"(?i)nvshmem"),
    ("userbuffers", r"(?i)userbuffers"),
)

# Collective kind from the kernel name; grouped send/recv is refined with NCCL's NVTX ranges.
COMM_KINDS: tuple[tuple[str, str], ...] = (
    ("all_to_all", r"(?i)alltoall|all_to_all|deep_ep::.*(dispatch|combine)|hybrid_?ep"),
    ("all_reduce", r"(?i)allreduce|all_reduce"),
    ("all_gather", r"(?i)allgather|all_gather"),
    ("reduce_scatter", r"(?i)reducescatter|reduce_scatter"),
    ("broadcast", r"(?i)broadcast"),
    ("send_recv", r"(?i)sendrecv|send|recv"),
    ("reduce", r"(?i)reduce"),
)

# NCCL's own NVTX range names (domain "NCCL") -> collective kind.
NCCL_NVTX_KINDS: tuple[tuple[str, str], ...] = (
    ("all_to_all", r"(?i)alltoall"),
    ("all_reduce", r"(?i)allreduce"),
    ("all_gather", r"(?i)allgather"),
    ("reduce_scatter", r"(?i)reducescatter"),
    ("broadcast", r"(?i)broadcast"),
    ("send_recv", r"(?i)^nccl(send|recv)"),
)


def _first_match(col: str, table: tuple[tuple[str, str], ...], default: str | None) -> pl.Expr:
    expr = pl.lit(default, dtype=pl.String)
    for label, pattern in reversed(table):
        expr = (
            pl.when(pl.col(col).cast(pl.String).str.contains(pattern))
            .then(pl.lit(label))
            .otherwise(expr)
        )
    return expr


def family(col: str = "name") -> pl.Expr:
    return _first_match(col, FAMILIES, "other")


def comm_library(col: str = "name") -> pl.Expr:
    return _first_match(col, COMM_LIBRARIES, None)


def comm_kind(col: str = "name") -> pl.Expr:
    return _first_match(col, COMM_KINDS, "other")


def nccl_nvtx_kind(col: str = "text") -> pl.Expr:
    return _first_match(col, NCCL_NVTX_KINDS, None)


def classify(kernels: pl.DataFrame) -> pl.DataFrame:
    """Add ``family``, ``is_comm``, ``comm_library`` and ``comm_kind`` columns.

    The regexes run once per distinct name (a few hundred), not once per kernel (millions).
    """
    names = (
        kernels.select("name")
        .unique()
        .with_columns(family=family())
        .with_columns(
            is_comm=pl.col("family") == "communication",
            comm_library=pl.when(pl.col("family") == "communication").then(comm_library()),
            comm_kind=pl.when(pl.col("family") == "communication").then(comm_kind()),
        )
    )
    return kernels.join(names, on="name", how="left", maintain_order="left")


def theoretical_occupancy(gpu: dict | None) -> pl.Expr:
    """Warps resident per SM over the SM's maximum, from the launch config and the GPU limits
    (the CUDA occupancy calculator's block limits: warps, registers, shared memory, blocks)."""
    if not gpu or not gpu.get("max_warps_per_sm"):
        return pl.lit(None, dtype=pl.Float64)
    warp = gpu.get("threads_per_warp") or 32
    max_warps = gpu["max_warps_per_sm"]
    max_blocks = gpu.get("max_blocks_per_sm") or 32
    max_regs = gpu.get("max_registers_per_sm") or 65536
    max_smem = gpu.get("max_shmem_per_sm") or 233472
    warps_per_block = (pl.col("block_threads") + warp - 1) // warp
    # Registers are allocated per warp in units of 256.
    regs_per_warp = ((pl.col("registers").fill_null(0) * warp + 255) // 256) * 256
    by_warps = max_warps // warps_per_block
    by_regs = (
        pl.when(regs_per_warp > 0)
        .then((max_regs // regs_per_warp.clip(lower_bound=1)) // warps_per_block)
        .otherwise(max_blocks)
    )
    # The driver reserves 1 KiB of shared memory per resident block.
    by_smem = (
        pl.when(pl.col("smem_per_block") > 0)
        .then(max_smem // (pl.col("smem_per_block") + 1024))
        .otherwise(max_blocks)
    )
    blocks = pl.min_horizontal(by_warps, by_regs, by_smem, pl.lit(max_blocks))
    return ((blocks * warps_per_block) / max_warps).clip(0.0, 1.0).cast(pl.Float64)
