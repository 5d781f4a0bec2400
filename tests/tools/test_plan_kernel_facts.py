"""The documented kernel facts the run model prices: the 500 W H100's measured GEMM rate, float8
rowwise scaling's casts and rescale, torchao's tensorwise casts and float8 tensor parallelism,
FSDP2's gradient copy-in and torchtitan's foreach AdamW, and PyTorch's ring attention (repeated
K/V heads, fp32 merges and gradient ring), Transformer Engine's MXFP8 and current scaling."""

from __future__ import annotations

from dataclasses import replace

import pytest

from overlap.step_model.fp8 import CURRENT_AMAX_BYTES, MXFP8_EXTRA_BYTES, ROWWISE_KERNEL_SHARE, te_quantize_seconds
from overlap.step_model.hardware import ACCELERATORS, BLACKWELL_GEMM_SHAPE_MIX, GEMM_SHAPE_MIX, HBM_SHARE
from overlap.step_model.kernels import (
    STACKS,
    BlockShape,
    block_seconds,
    fp8_cast_seconds,
    gemm_backward_seconds,
    gemm_seconds,
    narrow_head_factor,
)
from overlap.step_model.moe import MoeShape, expert_gemm_seconds, expert_rows, moe_seconds
from overlap.step_model.stacks import DECOUPLED_ADAMW_CLIP_BYTES, FOREACH_ADAMW_CLIP_BYTES
from overlap.tools.plan import ring_attention
from overlap.tools.plan.run_spec import ModelShape, RunSpec
from overlap.tools.plan.run_step import _layer_numel, _tp_exposed, _weight_pass_s, predict_run

LLAMA_8B = ModelShape(num_layers=32, hidden=4096, ffn_hidden=14336, num_heads=32, num_kv_heads=8, vocab_size=128256)
LLAMA_405B = ModelShape(num_layers=126, hidden=16384, ffn_hidden=53248, num_heads=128, num_kv_heads=8,
                        vocab_size=128256)  # fmt: skip


def test_the_500w_h100_runs_bf16_gemms_at_the_rate_measured_on_it() -> None:
    # FBGEMM's "H100 500W" benchmark: cuBLAS bf16 8192^3 at 585 TFLOPS, taken with the shape mix
    # every other card's best-shape rate takes (the SXM's MAMF share would give ~627)
    gpu = ACCELERATORS["h100-96gb-500w"]
    tflops = 2 * 8192**3 / gemm_seconds(8192, 8192, 8192, gpu, fp8=False) / 1e12
    assert tflops == pytest.approx(585.2 * GEMM_SHAPE_MIX, rel=1e-3)
    assert gpu.gemm_share < ACCELERATORS["h100-sxm"].gemm_share
    # the same benchmark's rowwise fp8 kernel (1125.5 TFLOPS) over its bf16 GEMM: 1.92x
    rowwise = gemm_seconds(8192, 8192, 8192, gpu, fp8=True, recipe="rowwise", cast_bytes=0.0)
    bf16 = gemm_seconds(8192, 8192, 8192, gpu, fp8=False)
    assert bf16 / rowwise == pytest.approx(1125.5 / 585.2, rel=0.03)
    # its attention runs at the clock that GEMM shows against an H100 SXM's 797.5 TFLOPS at 8192^3
    shape, sxm = BlockShape(hidden=4096, ffn_hidden=14336, num_heads=32, num_kv_heads=8), ACCELERATORS["h100-sxm"]
    capped = block_seconds(shape, 16384, 8192, gpu, STACKS["torch-compile"]).attention_forward_s
    full = block_seconds(shape, 16384, 8192, sxm, STACKS["torch-compile"]).attention_forward_s
    assert full / capped == pytest.approx(585.2 / 797.5, rel=1e-3)


@pytest.mark.parametrize(("mkn", "speedup"), [((4096, 8192, 16384), 1.39), ((1024, 2048, 1024), 0.80)])
def test_torchao_tensorwise_casts_reproduce_its_float8_linear_microbenchmark(mkn: tuple[int, int, int],
                                                                             speedup: float) -> None:  # fmt: skip
    # torchao/float8/README.md "Performance": a compiled Float8Linear forward + backward on H100
    # against bf16 at (M, K, N); the benchmark's weight is cast each step too (amax and cast
    # forward, the transposed cast backward: 5 + 3 bytes per element)
    m, k, n = mkn
    gpu, casts = ACCELERATORS["h100-sxm"], STACKS["torch-compile"].fp8_casts
    assert casts is not None
    hbm = gpu.hbm_tbps * 1e12 * 0.85
    bf16 = gemm_seconds(m, k, n, gpu, fp8=False) + gemm_backward_seconds(m, k, n, gpu, False)
    fp8 = 3 * gemm_seconds(m, k, n, gpu, fp8=True, cast_bytes=0.0)
    fp8 += (m * k * (casts.forward_input + casts.backward_input) + m * n * casts.backward_grad + k * n * 8) / hbm
    assert bf16 / fp8 == pytest.approx(speedup, rel=0.04)
    # the single input cast per GEMM that other stacks are priced with misses it by more
    generic = 3 * gemm_seconds(m, k, n, gpu, fp8=True) + k * n * 8 / hbm
    assert abs(bf16 / generic / speedup - 1) > abs(bf16 / fp8 / speedup - 1) + 0.02


def test_float8_tensor_parallelism_gathers_in_fp8_and_casts_on_the_shard() -> None:
    spec = RunSpec(model=LLAMA_8B, gpu="h100-96gb-500w", node="grand-teton", num_gpus=64, tp=8, seq_len=8192,
                   global_batch=96, micro_batch=12, ac="selective", stack="torch-compile", precision="fp8")  # fmt: skip
    bf16, rowwise = replace(spec, precision="bf16"), replace(spec, fp8_recipe="rowwise")
    # the all-gathers (half the collectives) move 1 byte per element, the reduce-scatters 2
    share = spec.rank_shares()[0]  # the same layers in every variant
    assert _tp_exposed(spec, share) == pytest.approx(0.75 * _tp_exposed(bf16, share), rel=0.02)
    assert _tp_exposed(rowwise, share) == _tp_exposed(bf16, share)  # torchtitan keeps rowwise TP in bf16
    assert _tp_exposed(replace(spec, stack="megatron-te"), share) == _tp_exposed(
        replace(bf16, stack="megatron-te"), share
    )
    # torchtitan's per-op checkpointing keeps reduce-scatter outputs, not all-gathers: the backward
    # gathers each block's two inputs again
    layers = LLAMA_8B.num_layers
    assert _tp_exposed(bf16, share) == pytest.approx(
        _tp_exposed(replace(bf16, ac="none"), share) * (10 * layers + 4) / (8 * layers + 4)
    )
    shape, gpu, casts = LLAMA_8B.block(), ACCELERATORS["h100-96gb-500w"], STACKS["torch-compile"].fp8_casts
    assert casts is not None
    sharded = fp8_cast_seconds(shape, 12 * 8192, gpu, casts, 8, float8_tp=True)
    unsharded = fp8_cast_seconds(shape, 12 * 8192, gpu, casts, 8, float8_tp=False)
    assert sharded[0] < unsharded[0] and sharded[1] < unsharded[1]


def test_fsdp2_copies_gradients_into_the_reduce_scatter_and_torchtitan_steps_foreach_adamw() -> None:
    spec = RunSpec(model=LLAMA_8B, gpu="h100-96gb-500w", node="grand-teton", num_gpus=8, seq_len=8192,
                   global_batch=16, micro_batch=2, ac="selective", stack="torch-compile")  # fmt: skip
    numel = sum(_layer_numel(spec, 0))
    hbm = ACCELERATORS["h100-96gb-500w"].hbm_tbps * 1e12 * 0.85
    forward, backward = _weight_pass_s(spec, 0)
    # copy-out of the gathered bf16 weights forward and backward; the bf16 gradients cast into
    # the fp32 reduce-scatter input
    assert backward == pytest.approx(numel * (2 * 2 + 2 + 4) / hbm)
    assert forward == pytest.approx(numel * 2 * 2 / hbm)
    fused = replace(spec, stack="megatron-te", dp_mode="zero1")
    owned = predict_run(replace(spec, dp_mode="zero1")).optimizer_s
    assert owned == pytest.approx(predict_run(fused).optimizer_s * FOREACH_ADAMW_CLIP_BYTES / 28)


def test_llm_foundry_steps_composers_decoupled_adamw_and_fsdp1_clipping() -> None:
    # Composer's DecoupledAdamW loops over parameters with eight eager kernels each (84 bytes per
    # parameter) and FSDP1's clip_grad_norm_ reads and rescales every gradient (12): more traffic
    # per owned parameter than a fused AdamW's 28, and than torchtitan's foreach step
    mpt_13b = ModelShape(num_layers=40, hidden=5120, ffn_hidden=20480, num_heads=40, num_kv_heads=40, vocab_size=50368)
    for name in ("llm-foundry", "llm-foundry-flash2"):
        spec = RunSpec(model=mpt_13b, gpu="h100-sxm", node="dgx-h100", num_gpus=8, seq_len=2048, global_batch=16,
                       micro_batch=2, stack=name)  # fmt: skip
        fused = predict_run(replace(spec, stack="megatron-te")).optimizer_s
        assert predict_run(spec).optimizer_s == pytest.approx(fused * DECOUPLED_ADAMW_CLIP_BYTES / 28)
    assert DECOUPLED_ADAMW_CLIP_BYTES > FOREACH_ADAMW_CLIP_BYTES


def test_rowwise_fp8_async_tp_leaves_its_all_gathers_exposed() -> None:
    # torch's micro-pipeline TP fuses rowwise matmul + reduce-scatters, not all-gather + matmuls:
    # under selective checkpointing the forward's two all-gathers a block and the backward's two
    # re-gathers stay exposed beside the backward's four, in bf16
    spec = RunSpec(model=LLAMA_8B, gpu="h100-96gb-500w", node="grand-teton", num_gpus=64, tp=8, seq_len=8192,
                   global_batch=96, micro_batch=12, ac="selective", stack="torch-compile", precision="fp8",
                   fp8_recipe="rowwise", async_tp=True)  # fmt: skip
    share = spec.rank_shares()[0]
    layers = LLAMA_8B.num_layers
    per_collective = _tp_exposed(replace(spec, async_tp=False), share) / (layers * 10 + 4)
    assert _tp_exposed(spec, share) == pytest.approx(per_collective * (layers * (4 + 2 + 2) + 2))
    tensorwise = replace(spec, fp8_recipe="tensorwise")
    assert _tp_exposed(tensorwise, share) < _tp_exposed(replace(spec, precision="bf16"), share)  # fused
    assert _tp_exposed(spec, share) > 1.9 * _tp_exposed(replace(spec, precision="bf16"), share)


def test_rowwise_fp8_pays_its_slower_kernel_second_casts_and_rescale() -> None:
    gpu = ACCELERATORS["h100-sxm"]
    t, k, n = 16384, 4096, 14336
    tensorwise = gemm_seconds(t, k, n, gpu, fp8=True)
    rowwise = gemm_seconds(t, k, n, gpu, fp8=True, recipe="rowwise")
    cast = t * k * 3 / (gpu.hbm_tbps * 1e12 * 0.85)
    assert rowwise - cast == pytest.approx((tensorwise - cast) / ROWWISE_KERNEL_SHARE)
    extra = gemm_backward_seconds(t, k, n, gpu, True, "rowwise") - gemm_backward_seconds(t, k, n, gpu, True)
    assert extra == pytest.approx(t * ((n + k) * 5 + k * 4) / (gpu.hbm_tbps * 1e12 * 0.85))
    # bf16 has no recipe
    assert gemm_backward_seconds(t, k, n, gpu, False, "rowwise") == 2 * gemm_seconds(t, k, n, gpu, fp8=False)
    shape = BlockShape(hidden=4096, ffn_hidden=14336, num_heads=32, num_kv_heads=8)
    args = (shape, 16384, 8192, gpu, STACKS["torch-compile"])
    assert block_seconds(*args, fp8=True, fp8_recipe="rowwise").backward_s > block_seconds(*args, fp8=True).backward_s


def test_a_run_spec_names_its_fp8_recipe() -> None:
    spec = RunSpec(model=LLAMA_8B, gpu="h100-96gb-500w", node="grand-teton", num_gpus=64, tp=8, seq_len=8192,
                   global_batch=96, micro_batch=12, ac="selective", stack="torch-compile", precision="fp8")  # fmt: skip
    rowwise = replace(spec, fp8_recipe="rowwise")
    assert predict_run(rowwise).step_s > 1.1 * predict_run(spec).step_s
    with pytest.raises(ValueError, match="fp8_recipe"):
        replace(spec, fp8_recipe="blockwise")


def _cp_run(cp: int, stack: str = "torch-compile", model: ModelShape = LLAMA_8B, **kw) -> RunSpec:
    fields = dict(gpu="h100-96gb-500w", node="grand-teton", num_gpus=8, cp=cp, seq_len=32768 * cp,
                  global_batch=8 // cp, micro_batch=1, ac="full", stack=stack, precision="fp8")  # fmt: skip
    fields.update(kw)
    return RunSpec(model=model, **fields)


def test_torch_ring_attention_merges_every_step_on_the_compute_stream() -> None:
    # the rank's tokens stay 32k: each step's merge and copies cost the same, and there are C steps
    two, eight = ring_attention.compute_s(_cp_run(2)), ring_attention.compute_s(_cp_run(8))
    assert eight[0] == pytest.approx(4 * two[0]) and eight[1] == pytest.approx(4 * two[1])
    assert two[0] > 0
    assert ring_attention.compute_s(_cp_run(8, "megatron-te")) == (0.0, 0.0)  # fused into TE's kernels
    assert ring_attention.compute_s(_cp_run(1)) == (0.0, 0.0)
    assert predict_run(_cp_run(8)).compute_s > predict_run(_cp_run(8, "megatron-te", precision="bf16")).compute_s / 2


def test_torch_ring_attention_carries_repeated_kv_heads_and_fp32_gradients_across_nodes() -> None:
    # 405B with TP 8 inside the node: the CP ring spans nodes on one rail per rank
    big = dict(model=LLAMA_405B, num_gpus=512, tp=8, pp=8, dp_mode="zero3-keep", global_batch=8)
    torch_ring = _cp_run(8, **big)
    te_ring = replace(torch_ring, stack="megatron-te")
    one_block = 2 * 32768 * 262144 * 2048 / 300e12  # the rank's causal attention forward, ~0.12 s
    (share,) = torch_ring.rank_shares()
    torch_s = ring_attention.exposed_s(torch_ring, share, one_block)
    te_s = ring_attention.exposed_s(te_ring, share, one_block)
    assert te_s == 0.0  # K/V of 1 head per rank hide behind each step
    assert torch_s > 0.05 * torch_ring.layers_per_rank * one_block  # 16 repeated heads gathered behind 1/C
    assert ring_attention.exposed_s(replace(torch_ring, ac="none"), share, one_block) < torch_s  # no recomputed ring


def test_fsdp1_concatenates_casts_and_predivides_each_unsharded_gradient_before_its_reduce_scatter() -> None:
    # torch/distributed/fsdp/flat_param.py (v2.1.0): the modules compute with split views of the
    # flat parameter, whose backward concatenates their gradients into the flat one;
    # _runtime_utils.py: the bf16 gradient cast to the reduce dtype where it differs, then divided
    # in place by the pre-divide factor
    mpt = ModelShape(num_layers=24, hidden=2048, ffn_hidden=8192, num_heads=16, num_kv_heads=16, vocab_size=50368,
                     mlp="gelu", tied_embeddings=True)  # fmt: skip
    spec = RunSpec(model=mpt, gpu="h100-sxm", node="dgx-h100", num_gpus=8, seq_len=2048, global_batch=112,
                   micro_batch=14, stack="llm-foundry", param_bytes=2, reduce_bytes=2)  # fmt: skip
    numel = sum(_layer_numel(spec, 0))
    hbm = ACCELERATORS["h100-sxm"].hbm_tbps * 1e12 * 0.85
    assert _weight_pass_s(spec, 0) == pytest.approx((0.0, numel * (2 * 2 + 2 * 2) / hbm))
    assert _weight_pass_s(replace(spec, reduce_bytes=4), 0)[1] == pytest.approx(numel * (2 * 2 + 2 + 4 + 2 * 4) / hbm)
    assert _weight_pass_s(replace(spec, num_gpus=1, global_batch=14), 0) == (0.0, 0.0)


def test_mpt_benchmarks_run_flash_attention_in_triton_at_fa2s_documented_distance() -> None:
    # FA2 paper 4.1: FA2 1.3-1.5x the Triton kernel forward, 2x backward
    shape, gpu = (
        BlockShape(hidden=2048, ffn_hidden=8192, num_heads=16, num_kv_heads=16, mlp="gelu"),
        ACCELERATORS["a100-80gb"],
    )
    mpt = block_seconds(shape, 2048, 2048, gpu, STACKS["llm-foundry"])
    fa2 = block_seconds(
        shape, 2048, 2048, gpu, replace(STACKS["llm-foundry"], attention_share=STACKS["torch-compile"].attention_share)
    )
    assert mpt.attention_forward_s / fa2.attention_forward_s == pytest.approx((1.4 + 2.5 * 2) / 3.5)


def test_mpt_large_scale_sweep_runs_flash_attention_2_where_it_says_attn_impl_flash() -> None:
    # llm-foundry's sweep.py: 1b, 3b, 7b and 70b with --attn_impl flash (flash-attn 2.4.2); the
    # rest of the MPT block is the same eager code, plus flash_attn_fn's unpadding around the kernel
    # (tests/tools/test_plan_foundry.py)
    flash2, triton = STACKS["llm-foundry-flash2"], STACKS["llm-foundry"]
    assert flash2.attention_share == STACKS["torch-compile"].attention_share
    assert (flash2.norm_passes, flash2.act_passes, flash2.residual_passes - (9 + 11) / 3, flash2.rope_passes) == (
        triton.norm_passes, triton.act_passes, triton.residual_passes, triton.rope_passes)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "bf16_mamf", "fp8_mamf"),
    [("b200", 1745.0, 3432.5), ("gb200", 1822.0, 3615.6), ("h100-sxm", 792.1, 1402.6)],
)
def test_gemm_shares_follow_each_cards_measured_mamf(name: str, bf16_mamf: float, fp8_mamf: float) -> None:
    # ml-engineering's MAMF table (bf16 and float8_e4m3fn): a large GEMM runs at the shape-mix share
    # of the card's own measured maximum, not Hopper's share of a Blackwell peak
    gpu = ACCELERATORS[name]
    tile = 8192 / (8192 + 128)
    mix = BLACKWELL_GEMM_SHAPE_MIX if gpu.generation == "blackwell" else (0.9, 0.9)
    bf16 = 2 * 8192**3 / gemm_seconds(8192, 8192, 8192, gpu, fp8=False) / 1e12
    assert bf16 == pytest.approx(mix[0] * bf16_mamf * tile, rel=2e-3)
    fp8_gemm_s = gemm_seconds(8192, 8192, 8192, gpu, fp8=True) - 8192 * 8192 * 3 / (gpu.hbm_tbps * 1e12 * 0.85)
    assert 2 * 8192**3 / fp8_gemm_s / 1e12 == pytest.approx(mix[1] * fp8_mamf * tile, rel=2e-3)
    if gpu.generation == "blackwell":  # Blackwell reaches a smaller share of its peak than Hopper
        assert gpu.gemm_share < ACCELERATORS["h100-sxm"].gemm_share


def test_narrow_heads_run_at_the_rate_flashattention3_measures_for_cudnn() -> None:
    # FA3 paper, Figure 5 (H100, BF16 forward, 16k): cuDNN 413 TFLOPS at head dim 64, 595 at 128
    gpu, te = ACCELERATORS["h100-sxm"], STACKS["megatron-te"]
    wide = BlockShape(hidden=4096, ffn_hidden=0, num_heads=32, num_kv_heads=8, head_dim=128)
    narrow = replace(wide, num_heads=64, head_dim=64)  # the same FLOPs per token in half-wide heads
    ratio = (block_seconds(wide, 8192, 8192, gpu, te).attention_forward_s
             / block_seconds(narrow, 8192, 8192, gpu, te).attention_forward_s)  # fmt: skip
    assert ratio == pytest.approx(413 / 595, rel=1e-9)
    # between 64 and 128 the ratio is interpolated; wider heads keep the measured share
    assert narrow_head_factor(96, te) == pytest.approx((1 + 413 / 595) / 2)
    assert narrow_head_factor(192, te) == narrow_head_factor(128, te) == 1.0


def test_yarn_runs_megatron_cores_unfused_rotary_embedding() -> None:
    # Megatron-Bridge fuses RoPE only for position_embedding_type "rope"; the unfused path makes
    # 12 passes over q and k where TE's fused kernel makes 2
    gpu, te = ACCELERATORS["h100-sxm"], STACKS["megatron-te"]
    rope = BlockShape(hidden=2880, ffn_hidden=0, num_heads=64, num_kv_heads=8, head_dim=64)
    yarn = replace(rope, position_embedding="yarn")
    tokens = 4096
    extra = block_seconds(yarn, tokens, 4096, gpu, te).elementwise_forward_s - block_seconds(
        rope, tokens, 4096, gpu, te).elementwise_forward_s  # fmt: skip
    width = 64 * 64 + 8 * 64  # q heads and k heads, not the hidden size
    assert extra == pytest.approx(tokens * (12 - 2) * width * 2 / (gpu.hbm_tbps * 1e12 * 0.85), rel=1e-9)
    # a stack without a measured unfused path (torch.compile fuses whatever the embedding) pays the same
    compiled = STACKS["torch-compile"]
    assert block_seconds(yarn, tokens, 4096, gpu, compiled).elementwise_forward_s == pytest.approx(
        block_seconds(rope, tokens, 4096, gpu, compiled).elementwise_forward_s)  # fmt: skip


def test_mxfp8_writes_each_quantized_activation_row_and_columnwise_with_its_scales() -> None:
    gpu, t, k, n = ACCELERATORS["b200"], 4096, 7168, 2048
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    assert MXFP8_EXTRA_BYTES == 1 + 2 / 32  # a second fp8 copy, one E8M0 byte per 32 elements per copy
    # forward: the input's columnwise copy; backward: the output gradient's
    mx_fwd, tw_fwd = gemm_seconds(t, k, n, gpu, True, "mxfp8"), gemm_seconds(t, k, n, gpu, True)
    assert mx_fwd - tw_fwd == pytest.approx(t * k * MXFP8_EXTRA_BYTES / hbm)
    # backward: the GEMMs and the output gradient quantized row- and columnwise; the input is not cast again
    gemm = gemm_seconds(t, k, n, gpu, True, cast_bytes=0.0)
    mx_bwd = gemm_backward_seconds(t, k, n, gpu, True, "mxfp8")
    assert mx_bwd - 2 * gemm == pytest.approx(t * n * (3 + MXFP8_EXTRA_BYTES) / hbm)
    assert gemm_seconds(t, k, n, gpu, False, "mxfp8") == gemm_seconds(t, k, n, gpu, False)  # bf16 untouched
    # the experts' grouped GEMMs: fc1 (h -> 2f) and fc2 (f -> h) of each local expert
    moe = MoeShape(num_experts=128, top_k=8, expert_ffn_hidden=768)
    mx = moe_seconds(moe, 2048, t, gpu, ep=8, fp8=True, fp8_recipe="mxfp8")
    tw = moe_seconds(moe, 2048, t, gpu, ep=8, fp8=True)
    rows, local = expert_rows(t, moe, 8, None), 128 // 8
    assert mx.forward_s - tw.forward_s == pytest.approx(local * rows * (2048 + 768) * MXFP8_EXTRA_BYTES / hbm)
    # backward: each output gradient quantized for both usages in place of the inputs' two casts
    grads, inputs = 2 * 768 + 2048, 2048 + 768
    assert mx.backward_s - tw.backward_s == pytest.approx(
        local * rows * (grads * (3 + MXFP8_EXTRA_BYTES) - inputs * 2 * 3) / hbm)  # fmt: skip
    with pytest.raises(ValueError, match="mxfp8"):
        RunSpec(model=LLAMA_8B, gpu="h100-sxm", node="dgx-h100", num_gpus=8, seq_len=8192, global_batch=8,
                micro_batch=1, precision="fp8", fp8_recipe="mxfp8")  # fmt: skip


def test_blackwell_attention_runs_at_cudnns_measured_gb200_rate() -> None:
    gpu, te = ACCELERATORS["gb200"], STACKS["megatron-te"]
    shape = BlockShape(hidden=8192, ffn_hidden=0, num_heads=64, num_kv_heads=8)  # heads of 128
    b = block_seconds(shape, 4096, 4096, gpu, te)
    flops = 4 * 4096 * 2048 * 8192  # causal forward: 2 x heads x s^2 x head_dim
    # cudnn-frontend's GB200 run (cuDNN 9.18.1), forward 1,297 and backward 1,105 TFLOPS at 4096
    measured_s = flops / 1297e12 + 2.5 * flops / 1105e12
    assert b.attention_forward_s * 3.5 == pytest.approx(measured_s, rel=0.01)
    assert te.attention_share["hopper"] == 0.50  # Hopper keeps the FA3-class share


def test_current_scaling_reads_each_quantized_tensor_for_its_amax_unless_a_fused_norm_took_it() -> None:
    gpu, t, k, n = ACCELERATORS["gb200"], 8192, 8192, 28672
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    assert CURRENT_AMAX_BYTES == 2  # one read of the bf16 tensor
    # forward: the input's amax and cast, the amax unless the kernel that wrote it took it;
    # backward: the output gradient's, the input not cast again (Blackwell: one copy serves both usages)
    gemm = gemm_seconds(t, k, n, gpu, True, cast_bytes=0.0)
    assert gemm_seconds(t, k, n, gpu, True, "current") - gemm == pytest.approx(t * k * (2 + 3) / hbm)
    assert gemm_seconds(t, k, n, gpu, True, "current", amax_fused=True) - gemm == pytest.approx(t * k * 3 / hbm)
    assert gemm_backward_seconds(t, k, n, gpu, True, "current") - 2 * gemm == pytest.approx(t * n * (2 + 3) / hbm)
    assert gemm_seconds(t, k, n, gpu, False, "current") == gemm_seconds(t, k, n, gpu, False)  # bf16 untouched
    # MLA's down-projections read a standalone norm's output: their inputs pay the pass too
    mla = BlockShape(hidden=7168, ffn_hidden=0, num_heads=128, num_kv_heads=128, head_dim=128, q_lora_rank=1536,
                     kv_lora_rank=512, rope_head_dim=64, v_head_dim=128)  # fmt: skip
    assert [mla.norm_fused_input(k, row) for k, _, row in mla.attention_gemms()] == [False, True, False, True, False]
    with pytest.raises(ValueError, match="tensorwise"):
        RunSpec(model=LLAMA_8B, gpu="h100-sxm", node="dgx-h100", num_gpus=8, seq_len=8192, global_batch=8,
                micro_batch=1, precision="fp8", fp8_recipe="current", stack="torch-compile")  # fmt: skip


def _gemm_only(shape: BlockShape, tokens: float, gpu, tp: int) -> float:
    """The block's GEMM kernels alone, fp8, no casts."""
    shards = [(k // tp, n) if row else (k, n // tp) for k, n, row in shape.attention_gemms() + shape.mlp_gemms()]
    return sum(gemm_seconds(tokens, k, n, gpu, True, cast_bytes=0.0) for k, n in shards)


def test_megatron_quantizes_the_input_of_linear_qkv_and_linear_fc1_once() -> None:
    gpu, tokens = ACCELERATORS["gb200"], 8192
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    te, shape, h = STACKS["megatron-te"], LLAMA_8B.block(), 4096
    assert te.fused_linears and not STACKS["torch-compile"].fused_linears
    assert shape.fused_with_previous() == [False, True, True, False, False, True, False]
    fused = block_seconds(shape, tokens, 8192, gpu, te, fp8=True, fp8_recipe="current")
    apart = block_seconds(shape, tokens, 8192, gpu, replace(te, fused_linears=False), fp8=True, fp8_recipe="current")
    # k, v and the up projection read the input linear_qkv / linear_fc1 quantized (cast only: the norm took the amax)
    assert apart.gemm_forward_s - fused.gemm_forward_s == pytest.approx(3 * tokens * h * 3 / hbm)
    assert apart.backward_s == pytest.approx(fused.backward_s)  # each output gradient is still quantized
    mla = BlockShape(hidden=7168, ffn_hidden=0, num_heads=128, num_kv_heads=128, head_dim=128, q_lora_rank=1536,
                     kv_lora_rank=512, rope_head_dim=64, v_head_dim=128)  # fmt: skip
    assert not any(mla.fused_with_previous())  # MLA's q and kv down-projections are separate linears


def test_hopper_writes_the_transposed_fp8_copy_of_each_current_scaled_operand() -> None:
    h100, gb200, rows, width = ACCELERATORS["h100-sxm"], ACCELERATORS["gb200"], 8192, 4096
    hbm = h100.hbm_tbps * 1e12 * HBM_SHARE
    # Hopper: cast_transpose writes the rowwise and the transposed copy; Blackwell reads one copy both ways
    assert te_quantize_seconds(rows, width, h100, "current") == pytest.approx(rows * width * (2 + 3 + 1) / hbm)
    blackwell_hbm = gb200.hbm_tbps * 1e12 * HBM_SHARE
    assert te_quantize_seconds(rows, width, gb200, "current") == pytest.approx(rows * width * (2 + 3) / blackwell_hbm)
    # quantized on the sequence shard, gathered in fp8, then the gathered copy transposed (read and write)
    gathered = te_quantize_seconds(rows / 4, width, h100, "current", gathered_rows=rows)
    assert gathered == pytest.approx((rows / 4 * width * 5 + rows * width * 2) / hbm)
    # a Llama block under TP 4 on an H100: linear_qkv's and linear_fc1's inputs quantized once on
    # the shard (their norms took the amax) and transposed after the gather; linear_proj's and
    # linear_fc2's inputs in one cast_transpose; every output gradient in one, the row-parallel
    # ones on the shard and transposed after their gather
    te, tp, tokens, shape = STACKS["megatron-te"], 4, 8192, LLAMA_8B.block()
    h, kv, f = 4096, 1024, 14336
    b = block_seconds(shape, tokens, 8192, h100, te, tp=tp, fp8=True, fp8_recipe="current")
    gemm = _gemm_only(shape, tokens, h100, tp)
    inputs = 2 * (tokens / tp * h * 3 + tokens * h * 2) + tokens * (h + f) / tp * 6
    assert b.gemm_forward_s - gemm == pytest.approx(inputs / hbm)
    grads = tokens * (h + 2 * kv + 2 * f) / tp * 6 + 2 * (tokens / tp * h * 5 + tokens * h * 2)
    gemm_backward = b.backward_s - 2.5 * b.attention_forward_s - 2 * b.elementwise_forward_s
    assert gemm_backward - 2 * gemm == pytest.approx(grads / hbm)


def test_experts_under_current_scaling_quantize_as_the_dense_linears_do() -> None:
    gpu, t = ACCELERATORS["h100-sxm"], 4096
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    rows, k, n = 2048, 2048, 1536
    gemm = expert_gemm_seconds(rows, k, n, gpu, True, "current", cast=False)
    # each expert's input: amax, cast and Hopper's transposed copy, as te_quantize_seconds prices a dense one
    assert expert_gemm_seconds(rows, k, n, gpu, True, "current") - gemm == pytest.approx(rows * k * 6 / hbm)
    moe = MoeShape(num_experts=128, top_k=8, expert_ffn_hidden=768)
    cs = moe_seconds(moe, 2048, t, gpu, ep=8, fp8=True, fp8_recipe="current")
    tw = moe_seconds(moe, 2048, t, gpu, ep=8, fp8=True)
    rows, local = expert_rows(t, moe, 8, None), 128 // 8
    inputs, grads = 2048 + 768, 2 * 768 + 2048
    assert cs.forward_s - tw.forward_s == pytest.approx(local * rows * inputs * (6 - 3) / hbm)
    assert cs.backward_s - tw.backward_s == pytest.approx(local * rows * (grads * 6 - inputs * 2 * 3) / hbm)
