"""``python -m benchmarks forwards``' arithmetic (issue 37): the TFLOP/s it reports rest on
its count of a Paris expert's floating-point operations."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.forwards import ForwardSettings, bench_forwards, expert_flop_per_row
from ddm.models.paris import ParisExpert, ParisExpertConfig


def test_a_full_size_expert_row_is_the_issue_s_289_gflop():
    """DiT-XL/2's 118.6 GMACs at 256 px (its paper) plus the cross-attention to CLIP's 77
    tokens: the figure issue 37's ceiling is computed from."""
    assert round(expert_flop_per_row(ParisExpertConfig(), 77, 768) / 1e9) == 289


def test_the_count_agrees_with_pytorch_s_counter_on_what_it_sees():
    """PyTorch's counter, on a small expert through nn.MultiheadAttention's composite path,
    sees every matrix product but the attention's own (scaled_dot_product_attention on the
    CPU), and counts the time embedding the count leaves out: those written here by hand."""
    config = ParisExpertConfig(input_size=8, hidden_size=32, depth=2, num_heads=4,
                               text_embed_dim=24)
    rows, tokens, patches, width = 3, 77, 16, 32
    network = ParisExpert(**config.to_dict()).eval()
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            network(torch.randn(rows, 4, 8, 8), torch.rand(rows) * 1000,
                    torch.randn(rows, tokens, 24))
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    counted = counter.get_flop_counts()
    # Scores and values, self-attention over the patches and cross-attention to the tokens.
    attention = config.depth * 2 * 2 * (patches * patches + patches * tokens) * width
    time_embedding = sum(sum(counted[module].values())
                         for module in ("ParisExpert.time_embed", "ParisExpert.t_block"))
    seen = counter.get_total_flops() - time_embedding
    assert seen / rows + attention == expert_flop_per_row(config, tokens, 24)


@pytest.mark.parametrize("field,value,message", [
    ("size", "huge", "size must be one of micro, small, full"),
    ("precision", "int8", "precision must be one of float32, bfloat16, float16"),
    ("compile", "fast", "compile must be one of none, default"),
    ("rows", (), "needs rows >= 1"), ("repeats", 0, "needs rows >= 1 and repeats >= 1"),
    ("kernel_rows", (0,), "needs rows >= 1"),
    ("parts", ("levels", "speed"), "parts must be some of levels, kernels, grouped, served, "
                                   "got levels, speed"),
    ("parts", (), "parts must be some of .*got none")])
def test_bad_settings_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ForwardSettings(**{field: value})


@pytest.mark.parametrize("name,kind", [
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<96, 128>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float, false>", "normalisation"),
    ("void cudnn::engines_precompiled::nhwcToNchwKernel<__nv_bfloat16>", "other"),
    ("aten::mkldnn_convolution", "convolution"), ("aten::addmm", "matmul"),
    ("void at::native::elementwise_kernel<128, 4, addcmul_cuda_kernel>", "other")])
def test_kernels_are_sorted_by_the_names_the_h200_run_gave(name, kind):
    from benchmarks.forwards import kernel_kind

    assert kernel_kind(name) == kind


def test_only_the_parts_asked_for_are_measured():
    figures = bench_forwards(ForwardSettings(rows=(1,), kernel_rows=(1,), repeats=1,
                                             parts=("kernels",)), io.StringIO())
    assert "levels" not in figures and "grouped" not in figures and "served" not in figures
    assert [level["rows"] for level in figures["kernels"]] == [1]


def test_the_figures_so_far_are_handed_out_after_each_part():
    """What the GPU check writes before the pool's path compiles (the least certain part of a
    device session's time): the levels, then the grouped comparisons."""
    parts: list[list[str]] = []
    figures = bench_forwards(ForwardSettings(rows=(1,), grouped_rows=(1,), repeats=1),
                             io.StringIO(), lambda so_far: parts.append(sorted(
                                 key for key in ("levels", "grouped", "served") if key in so_far)))
    assert parts == [["levels"], ["grouped", "levels"]]
    assert [level["rows"] for level in figures["served"]] == [1]
