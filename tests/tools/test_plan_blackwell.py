"""Blackwell's GEMM rates at a model's shapes: Transformer Engine's measured layer on a B300."""

import pytest

from overlap.step_model.hardware import ACCELERATORS, BLACKWELL_GEMM_SHAPE_MIX, MAMF_SHARE
from overlap.step_model.kernels import _gemm_only_seconds

# Transformer Engine's GEMM profiling tutorial (docs/examples/gemm_profiling/gemm_profiling.rst):
# hidden 4096, intermediate 16384, M = 15,872 tokens on a B300, pre-quantized, ms per layer
TE_B300_LAYER_MS = {"bf16": 13.102, "fp8": 6.812}
B300_MAMF = {"bf16": 1769.0, "fp8": 3353.3}  # ml-engineering's MAMF table
TE_LAYER_GEMMS = [(4096, 12288), (4096, 4096), (4096, 16384), (16384, 4096)]  # (K, N): qkv, out, up, down
TOKENS = 15872


def _layer_seconds(gpu_name: str, fp8: bool) -> float:
    """Fprop, dgrad and wgrad of TE's layer as the model prices them (backward = 2 x forward)."""
    gpu = ACCELERATORS[gpu_name]
    return 3 * sum(_gemm_only_seconds(TOKENS, k, n, gpu, fp8, "current") for k, n in TE_LAYER_GEMMS)


@pytest.mark.parametrize(("dtype", "fp8"), [("bf16", False), ("fp8", True)])
def test_a_blackwell_layer_runs_at_te_measured_share_of_the_cards_mamf(dtype: str, fp8: bool) -> None:
    # B300 and B200 share the dense peaks (2,250 bf16, 4,500 fp8): a B200 priced at its own MAMF
    # times the Blackwell mix takes TE's B300 time scaled by the two cards' MAMF
    i = 0 if dtype == "bf16" else 1
    b200_mamf = MAMF_SHARE["b200"][i] * (2250.0 if dtype == "bf16" else 4500.0)
    expected_s = TE_B300_LAYER_MS[dtype] / 1e3 * B300_MAMF[dtype] / b200_mamf
    assert _layer_seconds("b200", fp8) == pytest.approx(expected_s, rel=1e-3)


def test_blackwell_reaches_less_of_its_mamf_at_model_shapes_than_the_generic_mix() -> None:
    # TE's measured layer: 0.853 (bf16) and 0.866 (fp8) of the card's MAMF over the tile
    # efficiency, where Ampere and Hopper keep 0.9; the GB200 keeps its own (lower) MAMF share
    assert tuple(round(mix, 3) for mix in BLACKWELL_GEMM_SHAPE_MIX) == (0.853, 0.866)
    for name in ("b200", "gb200"):
        gpu = ACCELERATORS[name]
        assert gpu.gemm_share == pytest.approx(MAMF_SHARE[name][0] * BLACKWELL_GEMM_SHAPE_MIX[0])
        assert gpu.fp8_gemm_share == pytest.approx(MAMF_SHARE[name][1] * BLACKWELL_GEMM_SHAPE_MIX[1])
    h100 = ACCELERATORS["h100-sxm"]
    assert h100.fp8_gemm_share == pytest.approx(MAMF_SHARE["h100"][1] * 0.9)


# cudnn-frontend's SDPA training benchmark, causal BF16, forward / backward TFLOPS: cuDNN 9.18.1 on
# a GB200 (peak 2,500), cuDNN 9.13.1 on a B200 (peak 2,250) and 9.19.1 on an H200, at sequences 4096 and 8192
CUDNN_MEASURED = {
    "megatron-te": ("gb200", 2500.0, {4096: (1297, 1105), 8192: (1563, 1279)}),
    "megatron-te-cudnn9.13": ("b200", 2250.0, {4096: (855.678, 701.265), 8192: (1171.278, 942.509)}),
    "megatron-te-cudnn9.20": ("h200", 989.4, {4096: (591, 474), 8192: (644, 541)}),  # cuDNN 9.19.1 on an H200
}


@pytest.mark.parametrize("name", sorted(CUDNN_MEASURED))
def test_cudnn_attention_on_blackwell_runs_at_its_measured_rate_at_both_sequences(name: str) -> None:
    # the whole causal kernel forward + backward (the block's attention at one head of 128, no
    # other work) takes what cudnn-frontend measured at each sequence, through the stack's own curve
    from overlap.step_model.kernels import STACKS, BlockShape, block_seconds

    gpu_name, peak, points = CUDNN_MEASURED[name]
    gpu = ACCELERATORS[gpu_name]
    shape = BlockShape(hidden=8192, ffn_hidden=28672, num_heads=64, num_kv_heads=8)
    for seq, (fwd, bwd) in points.items():
        share = 3.5 / (1 / fwd + 2.5 / bwd) / peak  # forward + backward, of the measuring card's peak
        causal_flops = 4.0 * seq * (seq / 2) * shape.hidden
        expected_s = causal_flops / (gpu.attention_peak_tflops * 1e12 * share)
        assert block_seconds(shape, seq, seq, gpu, STACKS[name]).attention_forward_s == pytest.approx(expected_s)


def test_the_25_11_container_prices_cudnn_9_13_slower_than_9_18_on_blackwell_only() -> None:
    from overlap.step_model.kernels import STACKS, BlockShape, block_seconds

    shape = BlockShape(hidden=4096, ffn_hidden=14336, num_heads=32, num_kv_heads=8)
    old, new = STACKS["megatron-te-cudnn9.13"], STACKS["megatron-te"]
    for seq in (4096, 8192):
        blackwell = [block_seconds(shape, seq, seq, ACCELERATORS["b200"], s).attention_forward_s for s in (old, new)]
        hopper = [block_seconds(shape, seq, seq, ACCELERATORS["h100-sxm"], s).attention_forward_s for s in (old, new)]
        assert blackwell[0] > blackwell[1]
        assert hopper[0] == hopper[1]
