"""Issue 27: the kernel taxonomy by example. ~50 real kernel names — from the fixtures' StringIds
and from public sources (Inductor's triton_poi_/triton_red_/triton_per_/triton_tem_, cuBLAS
nvjet and xmma, CUTLASS, flash attention, NCCL, DeepEP, HybridEP, TE) — each with the family a
reviewer expects; every bundled family entry carries examples that the loader checks; and
`traceclf kernels NAME` says which entry decides a name and which others match it too."""

from __future__ import annotations

import polars as pl
import pytest
from helpers.cli import run_cli

from traceclf.model.taxonomy import bundled

# (kernel name, family). Two were misclassified before issue 27: Inductor's GEMM templates
# (triton_tem_fused_addmm_*) were elementwise ("triton", "add"), and indexSelectLargeIndex was
# MoE routing ("index").
KERNELS = [
    (
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<(unsigned long)4096>)",
        "communication",
    ),
    (
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<(unsigned long)4096>)",
        "communication",
    ),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<(unsigned long)4096>)", "communication"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "communication"),
    ("void ncclSymkDevKernel_AllReduce_AGxLL_R_bf16(ncclSymkDevWorkArgs4K)", "communication"),
    (
        "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, float*, int*, int*, int4 const*, float const*, long const*, float const*, bool const*, int const*, int, int, int, int, int, int, int, int, void**, int, int, int)",
        "communication",
    ),
    (
        "void deep_ep::internode_ll::combine<false, 7168>(void*, void*, int*, void*, void const*, long const*, int const*, int const*, int*, int*, int*, int, int, int, int, int, int, int, int, int, bool, bool)",
        "communication",
    ),
    ("void hybrid_ep::dispatch_kernel<bf16, 8>(hybrid_ep::DispatchArgs)", "communication"),
    (
        "void nvshmemi_transfer_rma_put_bulk_kernel(void*, void const*, unsigned long)",
        "communication",
    ),
    (
        "userbuffers_fp16_sum_inplace_gpu_rr_rs(int, int, int, int, int, int, void**, int, unsigned long)",
        "communication",
    ),
    ("flash_fwd_kernel", "attention"),
    (
        "void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t>>, true, false, false, false, false, true, false, false>(Flash_bwd_params)",
        "attention",
    ),
    ("void cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    (
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)",
        "attention",
    ),
    (
        "void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, pytorch_flash::Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t>>, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "attention",
    ),
    ("nvjet_sm90_tst_128x104_64x7_1x2_h_bz_NNT", "gemm"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),
    (
        "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x32x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute_kernel__5x_cublas",
        "gemm",
    ),
    (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
        "gemm",
    ),
    (
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align2>(T1::Params)",
        "gemm",
    ),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_nn_align1>(T1::Params)", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "gemm"),
    ("sm90_gemm_bf16_bf16_bf16_tma_warpspecialized_cooperative", "gemm"),
    (
        "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float>>(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float>, float, float)",
        "gemm",
    ),
    ("splitKreduce_kernel", "gemm"),  # (a split-K GEMM's own second kernel)
    # public TensorRT/cuDNN exports: families by the function, not its parameter types
    (
        "void genericReformat::copyVectorizedKernel<double, __half, __half, (bool)1, (bool)0, (int)1>(unsigned int, const void *, genericReformat::ArrayN<T6>, genericReformat::ArrayNWithReducedDivisors<T6>, genericReformat::ArrayN<T6>, int)",
        "elementwise",
    ),
    (
        "void fft2d_r2c_32x32<float, (bool)0, (unsigned int)1, (bool)0>(float2 *, const T1 *, int, int, int, int, int, int, int, int, int, cudnn::reduced_divisor, bool, int2, int, int)",
        "convolution",
    ),
    ("volta_scudnn_128x32_relu_interior_nn_v1", "convolution"),
    (
        "sm80_xmma_fprop_implicit_gemm_f16f16_f16f16_f16_nhwckrsc_nhwc_tilesize128x128x32_stage4_warpsize2x2x1_g1_tensor16x8x16_execute_kernel_trt",
        "convolution",
    ),
    ("sm50_xmma_pooling_coalescedC_NHWC_kMAX_3_False_execute_kernel_trt", "reduction"),
    ("trt_ampere_h16816gemm_64x64_ldg8_relu_stages_64x5_tn_v1", "gemm"),
    ("triton_tem_fused_addmm_0", "gemm"),
    ("triton_tem_fused_mm_1", "gemm"),
    ("triton_tem_fused__to_copy_addmm_view_3", "gemm"),
    ("triton_tem_fused_bmm_2", "gemm"),
    (
        "void at::native::<unnamed>::multi_tensor_apply_kernel<at::native::<unnamed>::FusedOptimizerTensorListMetadata<(int)4>, at::native::<unnamed>::FusedAdamMathFunctor<c10::BFloat16, (int)4, (at::native::ADAM_MODE)1, false>>(T1)",
        "optimizer",
    ),
    (
        "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float, float, float>, float, float, float, float, float, float, adamMode_t, float>(long, int volatile*, T1, T2, T3...)",
        "optimizer",
    ),
    (
        "void at::native::<unnamed>::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, (int)2, (int)2, (int)-2, true>(at::cuda::detail::TensorInfo<T1, T3>, at::cuda::detail::TensorInfo<const T1, T3>, at::cuda::detail::TensorInfo<const T2, T3>, int, int, T3, T3, long)",
        "elementwise",
    ),
    (
        "void transformer_engine::permutation::moe_permute_row_map(int const*, int*, int, int, int)",
        "permute_moe",
    ),
    (
        "void at::native::sbtopk::gatherTopK<float, unsigned int, (int)2, (bool)0>(at::cuda::detail::TensorInfo<const T1, T2>, T2, T2, bool, T2, T2, at::cuda::detail::TensorInfo<T1, T2>, T2, at::cuda::detail::TensorInfo<long, T2>, T2, T1 *)",
        "permute_moe",
    ),
    (
        "void cub::DeviceRadixSortOnesweepKernel<cub::DeviceRadixSortPolicy<long, long, unsigned int>::Policy800, false, false, long, long, unsigned int, int, cub::detail::identity_decomposer_t>(unsigned int*, unsigned int*, long*, const long*, long*, const long*, int, int, int, cub::detail::identity_decomposer_t)",
        "permute_moe",
    ),
    ("_row_id_map_pass_1_kernel", "permute_moe"),
    # torch's random numbers (normal_and_transform) are no norm: not "reduction"
    (
        "void at::native::<unnamed>::distribution_elementwise_grid_stride_kernel<float, (int)4, void at::native::templates::cuda::normal_and_transform<c10::Half, float, at::CUDAGeneratorImpl *>(const at::TensorBase &, double, double, T1)>(long, at::PhiloxCudaState, T3, T4)",
        "elementwise",
    ),
    ("RMSNormKernel", "reduction"),
    ("l2_normalize_kernel", "reduction"),
    (
        "void at::native::<unnamed>::vectorized_layer_norm_kernel<c10::BFloat16, float, (bool)0>(int, T2, const T1 *, const T1 *, const T1 *, T2 *, T2 *, T1 *)",
        "reduction",
    ),
    (
        "void <unnamed>::softmax_warp_forward<float, float, float, (int)5, (bool)0, (bool)0>(T2 *, const T1 *, int, int, int, const bool *, int, bool)",
        "reduction",
    ),
    (
        "void at::native::reduce_kernel<(int)512, (int)1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, (int)4>>(T3)",
        "reduction",
    ),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "reduction"),
    ("triton_per_fused_native_layer_norm_1", "reduction"),
    (
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
        "reduction",
    ),
    (
        "void at::native::vectorized_elementwise_kernel<(int)4, at::native::FillFunctor<float>, at::detail::Array<char *, (int)1>>(int, T2, T3)",
        "elementwise",
    ),
    (
        "void at::native::elementwise_kernel<(int)128, (int)2, void at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase &)::[lambda() (instance 1)]::operator ()() const::[lambda() (instance 3)]::operator ()() const::[lambda(float) (instance 1)]>(at::TensorIteratorBase &, const T1 &)::[lambda(int) (instance 1)]>(int, T3)",
        "elementwise",
    ),
    ("triton_poi_fused_add_gelu_0", "elementwise"),
    ("triton_poi_fused__to_copy_mul_silu_1", "elementwise"),
    (
        "void transformer_engine::cast_transpose_fused_kernel<bf16, float8e4m3>(transformer_engine::CastTransposeParam)",
        "elementwise",
    ),
    (
        "void at::native::<unnamed>::CatArrayBatchedCopy_contig<at::native::<unnamed>::OpaqueType<(int)2>, unsigned int, (int)2, (int)128, (int)1>(T1 *, at::native::<unnamed>::CatArrInputTensorMetadata<T1, T2, (int)128, T3>, at::native::<unnamed>::TensorSizeStride<T2, (unsigned int)4>, int, T2)",
        "elementwise",
    ),
    ("nvfuser_none_f0_c0_r0_g0", "other"),
    ("par_ranged1d_kernel", "other"),
]


def test_the_table_is_about_fifty_real_names():
    assert len(KERNELS) >= 50 and len({name for name, _ in KERNELS}) == len(KERNELS)


@pytest.mark.parametrize(("name", "family"), KERNELS, ids=lambda v: str(v)[:40])
def test_kernel_family(name: str, family: str):
    taxonomy = bundled()
    got = taxonomy.classify(pl.DataFrame({"name": [name]}))["family"].cast(pl.String)[0]
    assert got == family
    matches = taxonomy.family_patterns(name)
    assert (matches[0].family if matches else "other") == family


def test_every_bundled_family_entry_has_a_name_and_examples():
    entries = bundled().families
    assert all(e.name and e.examples for e in entries)
    assert len({e.name for e in entries}) == len(entries)


def test_every_example_is_classified_by_its_own_entry():
    taxonomy = bundled()
    for entry in taxonomy.families:
        for example in entry.examples:
            assert taxonomy.family_patterns(example)[0] == entry


def folder_with(tmp_path, families: str):
    folder = tmp_path / "rules"
    folder.mkdir()
    (folder / "mine.yaml").write_text("taxonomy:\n  families:\n" + families, encoding="utf-8")
    return folder


@pytest.mark.parametrize(
    ("families", "problem"),
    [
        (
            "    - {name: mine, family: gemm, match: '^my_gemm', examples: [other_gemm_kernel]}\n",
            "example 'other_gemm_kernel' is not matched by its 'match'",
        ),
        (
            "    - {name: wide, family: gemm, match: 'my_'}\n"
            "    - {name: narrow, family: elementwise, match: '^my_add', examples: [my_add_kernel]}\n",
            "example 'my_add_kernel' is taken by the earlier entry 'wide' (gemm)",
        ),
        ("    - {name: mine, family: gemm, match: 'x', examples: [1]}\n", "'examples' must be"),
        ("    - {name: 'no good', family: gemm, match: 'x'}\n", "'name' must be an identifier"),
    ],
)
def test_examples_are_checked_on_load(tmp_path, families: str, problem: str):
    code, _out, err = run_cli("rules", "--rules", folder_with(tmp_path, families))
    assert code == 2 and problem in err and len(err.strip().splitlines()) == 1, err


def test_a_users_entry_may_take_a_bundled_example(tmp_path):
    """A --rules folder's entries are tried first and may reclassify what the bundled examples
    show (that is what they are for); the bundled examples are checked among the bundled
    entries only."""
    folder = folder_with(tmp_path, "    - {name: mine, family: other, match: '^nvjet_'}\n")
    code, out, err = run_cli(
        "kernels", "nvjet_sm90_tst_128x104_64x7_1x2_h_bz_NNT", "--rules", folder
    )
    assert code == 0, err
    assert "family other, by entry 'mine'" in out
    assert "would also match 'cublas_nvjet' (gemm), tried later" in out


def test_kernels_command_says_which_entry_and_why():
    code, out, err = run_cli(
        "kernels",
        "triton_tem_fused_addmm_0",
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<(unsigned long)4096>)",
        "par_ranged1d_kernel",
    )
    assert code == 0, err
    assert "family gemm, by entry 'inductor_gemm_template'" in out
    assert "would also match 'triton_fusion' (elementwise), tried later" in out
    assert "kernels.yaml" in out
    assert "library nccl, collective kind send_recv_or_all_to_all" in out
    assert "family other: no entry of the taxonomy matches it" in out


def test_the_rules_pages_example_taxonomy_loads_and_classifies(tmp_path):
    """docs/rules.md's `--rules` taxonomy example, as printed: it loads (each example matched
    by its own pattern) and names its kernel's family and kind (its patterns once missed the
    `void ` of a demangled name and were refused)."""
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "rules.md").read_text(encoding="utf-8")
    start = page.index("taxonomy:\n  families:\n    - name: my_fabric")
    (tmp_path / "kernels.yaml").write_text(page[start : page.index("```", start)])
    name = "void my_fabric::dispatch<bf16>(my_fabric::Args)"
    code, out, err = run_cli("kernels", "--rules", tmp_path, name)
    assert code == 0, err
    assert "family communication, by entry 'my_fabric'" in out
    assert "collective kind all_to_all" in out


def test_kernels_command_needs_a_name():
    code, _out, err = run_cli("kernels")
    assert code == 2 and "NAME" in err


def test_classify_keeps_each_names_labels_and_gives_what_the_patterns_give(monkeypatch):
    """A rank's measures classify the same names several times: the labels a Taxonomy keeps
    per name give the frame the patterns give, on a second call, with names it has not seen
    yet, and past MEMO_NAMES (where it runs the patterns again and keeps nothing more)."""
    from traceclf.model import taxonomy

    tax = bundled()
    first = pl.DataFrame({"name": [n for n, _ in KERNELS[:20]] * 3}).with_columns(
        pl.col("name").cast(pl.Categorical), start=pl.int_range(60)
    )
    more = pl.DataFrame({"name": [n for n, _ in KERNELS]}).with_columns(
        pl.col("name").cast(pl.Categorical)
    )

    def by_patterns(frame: pl.DataFrame) -> pl.DataFrame:
        return taxonomy.by_name(frame, tax._labelled(frame.select("name").unique()))

    for frame in (first, first, more):
        assert tax.classify(frame).equals(by_patterns(frame))
    assert len(tax.__dict__["_labels_of_name"]) == len(KERNELS)
    assert tax.classify(more)["family"].cast(pl.String).to_list() == [f for _, f in KERNELS]
    monkeypatch.setattr(taxonomy, "MEMO_NAMES", len(KERNELS))
    fresh = pl.DataFrame({"name": ["a new kernel name"]}).with_columns(
        pl.col("name").cast(pl.Categorical)
    )
    assert tax.classify(fresh).equals(by_patterns(fresh))
    assert "a new kernel name" not in tax.__dict__["_labels_of_name"]


def _nvtx_texts() -> list[str | None]:
    """Every NVTX text of the shared fixtures (in the row or in StringIds), PyTorch-numbered
    op texts as emit_nvtx writes them (constructed), and a missing one."""
    import sqlite3

    from conftest import FIXTURES

    texts: set[str] = set()
    for path in sorted(FIXTURES.glob("*.sqlite")):
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
            if not con.execute("SELECT 1 FROM sqlite_master WHERE name = 'NVTX_EVENTS'").fetchone():
                continue
            texts |= {
                t
                for (t,) in con.execute(
                    "SELECT DISTINCT coalesce(n.text, s.value) FROM NVTX_EVENTS n "
                    "LEFT JOIN StringIds s ON s.id = n.textId"
                )
                if isinstance(t, str)
            }
    numbered = [f"aten::{op}, seq = {i}" for i in range(200) for op in ("mm", "copy_", "to")]
    return [*sorted(texts), *numbered, "DataLoader next batch", "torch.compile", None]


@pytest.mark.parametrize("default", [None, "other"])
@pytest.mark.parametrize("repeated", [False, True], ids=["each-differs", "repeated"])
def test_first_match_of_labels_as_first_match_does(default, repeated) -> None:
    """The alternation that picks which texts the table's regexes run on (each in a group of
    its own) labels every text as the chain of regexes does: the bundled host activities and
    a constructed table whose patterns carry their own flags and alternations, over every
    NVTX text of the fixtures and numbered op texts, each once (labelled row by row) or each
    three times in a row (labelled once per distinct text)."""
    from traceclf.model.taxonomy import MATCH_PROBE, first_match, first_match_of

    texts = pl.Series("text", _nvtx_texts(), dtype=pl.String)
    if repeated:
        texts = texts.gather([i for i in range(len(texts)) for _ in range(3)])
    distinct = texts.head(MATCH_PROBE).n_unique()
    assert (distinct * 2 > MATCH_PROBE) == (not repeated)  # (which way first_match_of goes)
    tables = [
        bundled().host_activities,
        (
            ("ops", r"(?i)ATEN::(mm|to)\b"),
            ("copy", r"copy_|^cudaMemcpy"),
            ("step", r"(?i)^\s*step\s*\d+$"),
            ("late", r"seq = 1\d$"),
        ),
        (),
    ]
    for table in tables:
        want = pl.DataFrame({"text": texts}).with_columns(label=first_match("text", table, default))
        got = first_match_of(texts.cast(pl.Categorical), table, default)
        assert got.to_list() == want["label"].to_list()
        assert got.name == "text"


@pytest.mark.parametrize("repeated", [False, True], ids=["each-differs", "repeated"])
def test_match_counts_count_as_each_pattern_does(repeated) -> None:
    """The counts of several patterns taken together (their alternation picks the rows where
    texts number them) equal each pattern's own count: the bundled training-evidence and
    phase patterns and constructed ones with their own flags, over every NVTX text of the
    fixtures and numbered op texts, each once or three times in a row, nulls among them."""
    from traceclf.model.taxonomy import match_counts, matches

    texts = pl.Series("text", [*_nvtx_texts(), None], dtype=pl.String)
    if repeated:
        texts = texts.gather([i for i in range(len(texts)) for _ in range(3)])
    tax = bundled()
    patterns = [
        tax.training["backward_nvtx"],
        tax.nvtx["optimizer"],
        tax.moe["nvtx"],
        tax.nvtx["forward"],
        r"(?i)ATEN::(mm|to)\b",
        r"seq = 1\d$",
    ]
    want = [int(matches(texts, p).sum()) for p in patterns]
    assert match_counts(texts.cast(pl.Categorical), patterns) == want
    assert match_counts(texts, patterns) == want
    assert sum(want) > 0


@pytest.mark.parametrize(
    ("call", "alloc"),
    [
        ("cudaMalloc_v3020", True),
        ("cudaFree_v3020", True),
        # a public kNN code allocates pitched and array memory every step: 19.5% of it idle
        ("cudaMallocPitch_v3020", True),
        ("cudaMallocArray_v3020", True),
        ("cudaFreeArray_v3020", True),
        ("cuMemAlloc_v2", True),
        ("cuMemFree_v2", True),
        ("cudaMallocManaged_v6000", True),
        # stream-ordered pools synchronise nothing; host allocations are not the device's
        ("cudaMallocAsync_v11020", False),
        ("cudaFreeAsync_v11020", False),
        ("cudaMallocHost_v3020", False),
        ("cudaHostAlloc_v3020", False),
    ],
)
def test_device_allocations_of_every_kind_are_allocator_calls(call: str, alloc: bool) -> None:
    import polars as pl

    from traceclf.model.taxonomy import bundled

    got = pl.DataFrame({"name": [call]}).select(bundled().is_api("alloc")).item()
    assert got is alloc


@pytest.mark.parametrize(
    ("call", "sync", "wait"),
    [
        ("cudaDeviceSynchronize_v3020", True, True),
        # its old name, which older codes call after every kernel (Rodinia's Gaussian
        # elimination, public exports of it: 8,190 calls that had read "other CUDA call")
        ("cudaThreadSynchronize_v3020", True, True),
        ("cudaMemcpy_v3020", True, False),
        # copies to and from CUDA arrays block the host as cudaMemcpy does (a public kNN code
        # copies its input to an array every step)
        ("cudaMemcpyToArray_v3020", True, False),
        ("cudaMemcpy2DToArray_v3020", True, False),
        ("cudaMemcpy3D_v3020", True, False),
        # asynchronous copies, and device-to-device driver copies, block nothing on the host
        ("cudaMemcpyAsync_v3020", False, False),
        ("cudaMemcpy2DToArrayAsync_v3020", False, False),
        ("cudaMemcpy3DAsync_v3020", False, False),
        ("cuMemcpyDtoD_v2", False, False),
        ("cudaStreamWaitEvent_v3020", False, False),
    ],
)
def test_synchronising_calls_of_every_kind(call: str, sync: bool, wait: bool) -> None:
    import polars as pl

    from traceclf.model.taxonomy import bundled

    got = pl.DataFrame({"name": [call]}).select(
        sync=bundled().is_api("sync"), wait=bundled().is_api("wait")
    )
    assert got.row(0) == (sync, wait)
