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
