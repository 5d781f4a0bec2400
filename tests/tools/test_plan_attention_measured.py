"""Attention priced from cudnn-frontend's SDPA training benchmark: GPT-OSS's sliding-window layers
at head dim 64 ([Note: cuDNN sliding-window attention] in overlap/step_model/stacks.py), the
benchmark's FLOP count against ours, and the stacks the measurement does not reach."""

from __future__ import annotations

import pytest

from overlap.step_model.hardware import ACCELERATORS
from overlap.step_model.kernels import STACKS, BlockShape, block_seconds, narrow_head_factor
from overlap.step_model.stacks import ATTENTION_BACKWARD

# GPT-OSS 120B's attention: 64 query / 8 key-value heads of 64
GPT_OSS = BlockShape(hidden=2880, ffn_hidden=0, num_heads=64, num_kv_heads=8, head_dim=64)
SEQ = 4096


def _fwd_bwd_share(forward: float, backward: float, peak: float) -> float:
    return 3.5 / (1 / forward + ATTENTION_BACKWARD / backward) / peak


def _priced_share(gpu_name: str, stack_name: str, window: int, context: int = SEQ) -> float:
    """The share of the peak the model prices one layer's attention at (forward)."""
    gpu = ACCELERATORS[gpu_name]
    seconds = block_seconds(GPT_OSS, context, context, gpu, STACKS[stack_name], window=window).attention_forward_s
    span = min(window, context) if window else context
    attended = context / 2 if span == context else span - span * span / (2 * context)
    return 4.0 * context * attended * GPT_OSS.attention_width / seconds / (gpu.attention_peak_tflops * 1e12)


def _benchmark_attended(window: int, seq: int) -> float:
    # benchmark_single_sdpa.py `flops`: W(W+1)/2 + (S - W)W unmasked scores, per query token
    return (window * (window + 1) // 2 + (seq - window) * window) / seq


@pytest.mark.parametrize("window", [128, 1024])
def test_the_benchmark_counts_windowed_flops_as_the_model_does(window: int) -> None:
    assert _benchmark_attended(window, SEQ) == pytest.approx(window - window**2 / (2 * SEQ), rel=1e-3)
    # forward 2 x (64 + 64), backward 2 x (3 x 64 + 2 x 64) per score and head: backward 2.5 forwards
    assert ATTENTION_BACKWARD == 2 * (3 * 64 + 2 * 64) / (2 * (64 + 64))


@pytest.mark.parametrize(
    ("gpu", "window", "forward", "backward"),
    [
        ("gb200", 128, 161, 182),  # cuDNN 9.22.0, results/gpt_oss/gb200/gpt_oss_20260424_100011.csv
        ("gb200", 1024, 574, 617),  # cuDNN 9.19.1, gb200_919_only_cudnn/gpt_oss_20260226_175022.csv
        ("h200", 1024, 336, 289),  # cuDNN 9.19.1, h200_919_only_cudnn/gpt_oss_20260227_034819.csv
    ],
)
def test_cudnn_9_20_prices_gpt_oss_windows_at_the_measured_rate(gpu: str, window: int, forward: float,
                                                                backward: float) -> None:  # fmt: skip
    measured = _fwd_bwd_share(forward, backward, ACCELERATORS[gpu].attention_peak_tflops)
    assert _priced_share(gpu, "megatron-te-cudnn9.20", window) == pytest.approx(measured, rel=1e-3)


def test_hopper_prices_a_128_window_through_the_blackwell_window_curve() -> None:
    # 0.304 at W 1024 on the H200, the window half 549 tokens the two GB200 windows measure
    share = _priced_share("h100-sxm", "megatron-te-cudnn9.20", 128)
    assert share == pytest.approx(0.088, abs=0.001)
    # twice the causal curve's price at span 128 with the head-dim-64 ratio
    stack = STACKS["megatron-te-cudnn9.20"]
    causal = stack.attention_share["hopper"] * 128 / (128 + stack.attention_seq_half["hopper"])
    assert share > 1.9 * causal * narrow_head_factor(64, stack)


def test_the_window_rate_does_not_depend_on_the_context() -> None:
    rates = [_priced_share("gb200", "megatron-te-cudnn9.20", 128, context) for context in (4096, 8192, 32768)]
    assert rates == pytest.approx([rates[0]] * 3)


@pytest.mark.parametrize("stack_name", ["megatron-te-cudnn9.13", "megatron-te"])
@pytest.mark.parametrize("gpu", ["b200", "h100-sxm"])
def test_other_cudnn_releases_keep_the_causal_curve_in_a_window(stack_name: str, gpu: str) -> None:
    stack = STACKS[stack_name]
    generation = ACCELERATORS[gpu].generation
    half = stack.attention_seq_half.get(generation, 512)
    curve = stack.attention_share[generation] * 128 / (128 + half) * narrow_head_factor(64, stack)
    assert _priced_share(gpu, stack_name, 128) == pytest.approx(curve, rel=1e-9)


@pytest.mark.parametrize("gpu", ["gb200", "h100-sxm"])
def test_full_layers_keep_the_causal_curve(gpu: str) -> None:
    stack = STACKS["megatron-te-cudnn9.20"]
    generation = ACCELERATORS[gpu].generation
    curve = stack.attention_share[generation] * SEQ / (SEQ + stack.attention_seq_half[generation])
    assert _priced_share(gpu, "megatron-te-cudnn9.20", 0) == pytest.approx(curve * narrow_head_factor(64, stack))
