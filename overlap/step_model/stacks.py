"""The kernel stacks a published run can use (`KernelStack`, `STACKS`): each one's attention
kernel and its rate by GPU generation, and how many passes its fused or eager element-wise kernels
make. kernels.py prices a block's compute with them ([Note: attention at narrow heads] and
[Note: unfused rotary embedding] there)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from overlap.step_model.fp8 import TORCHAO_TENSORWISE_CASTS, Fp8Casts

ATTENTION_SEQ_HALF = 512
"""Context length at which a flash kernel reaches half its long-sequence rate (FlashAttention-2
paper, Figures 4-7: throughput rises from 512 to 8K and flattens after)."""
ATTENTION_BACKWARD = 2.5
"""Flash attention backward / forward FLOPs (the benchmark convention of flash-attn)."""
CUDNN_HD64_SHARE = 413.0 / 595.0
"""cuDNN's BF16 attention rate at head dim 64 over head dim 128 ([Note: attention at narrow heads])."""
FA2_HD64_SHARE = 324.0 / 370.0
"""FlashAttention-2's, on the same figure."""
UNFUSED_ROPE_PASSES = 12
"""Passes over q and k of Megatron-Core's unfused rotary embedding ([Note: unfused rotary embedding])."""


@dataclass(frozen=True, kw_only=True)
class KernelStack:
    """The software a published run used, as its kernels' rates and fusion."""

    name: str
    attention_share: dict[str, float]
    """Flash attention forward+backward share of the bf16 peak at long sequences, head dim 128,
    causal, by GPU generation."""
    norm_passes: float
    """Activation-sized HBM passes (reads + writes, in units of h elements) of one norm."""
    rope_passes: float
    """Passes over q and k for the rotary embedding (0 for ALiBi/learned positions)."""
    act_passes: float
    """Passes over the MLP's hidden activations (in units of the FFN width) of the activation."""
    residual_passes: float
    """Passes over h of the two residual adds and the layout copies around attention."""
    score_passes: float = 0.0
    """Attention that materializes its scores (no flash kernel): HBM passes over the score
    matrix (heads x context per token, 2 bytes) of the softmax, mask and dropout, forward and
    backward together; its two batched GEMMs run unmasked (full, not causal, FLOPs) at the
    GEMM rate of a head_dim-wide K. 0: a flash kernel at `attention_share`."""
    gather_copy_out: bool = False
    """The data-parallel wrapper copies each all-gather's output into the parameters on the
    compute stream (FSDP2's copy-out: one read and one write of the gathered bytes); FSDP1's flat
    parameters and Megatron's buffers gather in place."""
    flat_param_reduce: bool = False
    """The data-parallel wrapper is FSDP1 (FlatParameter): before each reduce-scatter it casts
    the unsharded gradient to the reduce dtype where that differs from the compute dtype and
    divides it in place by the pre-divide factor (`_post_backward_hook` and `_reduce_grad`,
    https://github.com/pytorch/pytorch/blob/v2.1.0/torch/distributed/fsdp/_runtime_utils.py):
    passes over every gathered parameter's gradient, each micro-batch; before them autograd
    concatenates the parameters' gradients into the flat gradient (the backward of the split
    views its modules compute with: [Note: FSDP1's schedule] in overlap/tools/plan/run_step.py).
    FSDP2 averages inside the reduce-scatter instead."""
    tp_overlap_backward: bool = False
    """Overlapped tensor parallelism hides the backward's collectives too (Transformer Engine's
    userbuffers overlap dgrad and wgrad); PyTorch's async TP fuses the forward's all-gather +
    matmul and matmul + reduce-scatter only (its announcement measured ~29% on the forward and
    ~8% end to end on Llama 3 8B/70B)."""
    fp8_casts: Fp8Casts | None = None
    """The casts its tensorwise fp8 linears run ([Note: float8 recipes]); None: the input's,
    `INPUT_CAST_BYTES`, once forward and twice backward."""
    optimizer_bytes_per_param: float | None = None
    """HBM bytes per owned parameter of the optimizer step and gradient clipping; None: a fused
    AdamW step (overlap/tools/plan/fsdp.py's OPTIMIZER_BYTES_PER_PARAM)."""
    attention_seq_half: dict[str, float] = field(default_factory=dict)
    """By GPU generation: the sequence at which the attention kernel reaches half its long-sequence
    share, where measured ([Note: cuDNN attention on Blackwell]); elsewhere ATTENTION_SEQ_HALF."""
    window_curve: dict[str, tuple[float, float]] = field(default_factory=dict)
    """(share, half-rate window) of the stack's sliding-window kernel at head dim 64 by GPU
    generation, measured: a window of w runs at share x w / (w + half) of the peak whatever the
    context ([Note: cuDNN sliding-window attention]); absent: the causal curve at span w."""
    narrow_head_share: float = 1.0
    """The attention kernel's rate at head dim 64 over its rate at head dim 128 ([Note: attention
    at narrow heads]); 1: no measurement at other head dims, taken as equal."""
    unfused_rope_passes: float | None = None
    """`rope_passes` where the stack's fused rotary kernel does not apply to the model's position
    embedding ([Note: unfused rotary embedding]); None: the fused passes for every embedding."""
    fused_linears: bool = False
    """q, k and v run as one linear and a gated MLP's gate and up projections as one (Megatron-Core's
    linear_qkv and linear_fc1): each fused linear quantizes its input once ([Note: Transformer
    Engine's casts]); False: one linear per weight."""
    float8_tp_all_gather: bool = False
    """Tensor parallelism under tensorwise float8 gathers in fp8: torchtitan applies torchao's
    PrepareFloat8ModuleInput / Float8ColwiseParallel / Float8RowwiseParallel, which cast a block
    input before its all-gather and the output gradient before the backward's all-gather
    (https://github.com/pytorch/ao/blob/main/torchao/float8/float8_tensor_parallel.py: "the
    float8 cast happens before the all-gather";
    torchtitan's llama parallelize applies them only for the tensorwise recipe); the
    reduce-scatters stay bf16."""
    torch_ring: bool = False
    """Context parallelism runs PyTorch's ring attention as torchtitan calls it (K/V heads
    repeated, fp32 merges and gradient ring: [Note: ring attention] in
    overlap/tools/plan/ring_attention.py); False: Transformer Engine's."""
    source: str = ""


# Attention shares: FlashAttention-2 (Dao 2023, arXiv:2307.08691) reaches 50-73% of the A100
# peak forward and ~225 TFLOPs/s (72%) forward+backward; on H100 it runs Ampere-style MMAs and
# reaches ~335 TFLOPs/s (34%). FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) reaches 75%
# of H100 forward and 1.5-1.75x FA2's backward: ~50% forward+backward, taken for cuDNN's fused
# attention (Transformer Engine) as well. The causal kernels are given the same shares (an
# assumption: the papers' causal curves sit close to the non-causal ones at long sequences).
_FA2 = {"ampere": 0.60, "hopper": 0.34, "blackwell": 0.34}
_FA3 = {"ampere": 0.60, "hopper": 0.50, "blackwell": 0.50}
# [Note: cuDNN attention on Blackwell]
# cuDNN's fused attention on Blackwell is measured by NVIDIA's cudnn-frontend SDPA training
# benchmark (causal, BF16, key-value heads of 128, batch 1; backward counted as 2.5 forwards, our
# convention: forward+backward 3.5 / (1 / forward + 2.5 / backward)) at two sequences each, and
# each release's container ran its own cuDNN:
#   cuDNN 9.18.1 on a GB200 (results/gb200_918_only_cudnn/llama3.1_20260126_110503.csv,
#   https://github.com/NVIDIA/cudnn-frontend/blob/9072c4e78eaba9e5af685c4d5de69d18d94a1a29/benchmark/
#   sdpa_benchmark_training/results/gb200_918_only_cudnn/llama3.1_20260126_110503.csv; 64 query
#   heads): sequence 4096 forward 1,297 / backward 1,105 TFLOPS (1,154 together, 0.462 of 2,500),
#   8192 1,563 / 1,279 (1,349, 0.540). DeepSeek-V3's 192/128 MLA heads measure the same at 4096
#   (dsv3_20260126_110621.csv: 1,324 / 1,083). Megatron-Bridge 26.04 ships cuDNN 9.20, the
#   nearest measured is this one.
#   cuDNN 9.13.1 on a B200 (artifacts/sdpa_bf16_benchmark_results_NVIDIA_B200.csv and its README,
#   "nvcr.io/nvidia/pytorch:25.09-py3, where cuDNN 9.13.1 was used",
#   https://github.com/NVIDIA/cudnn-frontend/blob/be6c079be8aaffa0fc079fcf039887e637c289c7/benchmark/
#   sdpa_benchmark_training/artifacts/sdpa_bf16_benchmark_results_NVIDIA_B200.csv; 128 query heads):
#   4096 855.7 / 701.3 (739, 0.329 of 2,250), 8192 1,171.3 / 942.5 (998, 0.444). Megatron-Bridge's
#   25.11 container ships cuDNN 9.13.1.26 (docs/releases/software-versions.md,
#   https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/2075a5b8aa562e45c441b55f079434b2e7baa027/docs/releases/software-versions.md).
#   cuDNN 9.19.1 on an H200 (results/h200_919_only_cudnn/llama3.1_20260227_034703.csv,
#   https://github.com/NVIDIA/cudnn-frontend/blob/df73764adb98b7445b77662ce07b1ea434c8f3ee/benchmark/
#   sdpa_benchmark_training/results/h200_919_only_cudnn/llama3.1_20260227_034703.csv; 64 query heads;
#   an H200's tensor cores are an H100 SXM's): 4096 591 / 474 (502, 0.508 of 989.4), 8192 644 / 541
#   (567, 0.573). Megatron-Bridge 26.04 ships cuDNN 9.20.0.48 (the same software-versions.md), so its
#   rows run the measured 9.19.1 on Hopper and 9.18.1 on Blackwell (`megatron-te-cudnn9.20`); rows
#   of other releases keep FlashAttention-3's paper share on Hopper.
# cuDNN's rate rises with the sequence faster than FlashAttention-2's (ATTENTION_SEQ_HALF), so each
# is given the curve share x s / (s + half) through its own two points (`two_point_curve`): 9.18.1
# a long-sequence share 0.65 and half 1,668 tokens, 9.13.1 0.68 and 4,412, 9.19.1 on Hopper 0.66
# and 1,206. Taken for every
# Blackwell card as a share of its own peak. (Through the FlashAttention-2 curve, one point at 4096
# gave 9.18.1 a share of 0.52 and priced 8192-token runs 8% slow.)


def two_point_curve(s1: int, share1: float, s2: int, share2: float) -> tuple[float, float]:
    """(long-sequence share, half-rate sequence) of share x s / (s + half) through two measured
    (sequence, share of peak) points."""
    q = share2 / share1
    half = (q - 1) * s1 * s2 / (s2 - q * s1)
    return share1 * (s1 + half) / s1, half


def _fwd_bwd_share(forward: float, backward: float, peak: float) -> float:
    return 3.5 / (1 / forward + ATTENTION_BACKWARD / backward) / peak


CUDNN_918_BLACKWELL = two_point_curve(4096, _fwd_bwd_share(1297, 1105, 2500), 8192, _fwd_bwd_share(1563, 1279, 2500))
CUDNN_913_BLACKWELL = two_point_curve(4096, _fwd_bwd_share(855.678, 701.265, 2250),
                                      8192, _fwd_bwd_share(1171.278, 942.509, 2250))  # fmt: skip
CUDNN_919_HOPPER = two_point_curve(4096, _fwd_bwd_share(591, 474, 989.4), 8192, _fwd_bwd_share(644, 541, 989.4))
# [Note: cuDNN sliding-window attention]
# The same benchmark measures GPT-OSS's attention: head dim 64, causal with a sliding window
# (cuDNN's diagonal band, left bound W), BF16, non-deterministic backward, no softmax sinks (the
# benchmark has no sink input: learnable sinks are unmeasured). Its FLOPs
# (benchmark_single_sdpa.py `flops`) count 2 x batch x heads x unmasked scores x (64 + 64) forward and
# x (3 x 64 + 2 x 64) backward, with W(W+1)/2 + (s - W)W unmasked scores: per token
# W - W^2/2s + W/2s positions, our `attended` (to 0.1% at W 128), and backward 2.5 forwards, ours.
# At sequence 4096, forward / backward TFLOPS (forward+backward as above):
#   cuDNN 9.19.1, W 1024, 64 query / 8 key-value heads, batch 2
#   (https://github.com/NVIDIA/cudnn-frontend/blob/df73764adb98b7445b77662ce07b1ea434c8f3ee/benchmark/
#   sdpa_benchmark_training/results/): H200 (h200_919_only_cudnn/gpt_oss_20260227_034819.csv)
#   336 / 289 (301, 0.304 of 989.4), GB200 (gb200_919_only_cudnn/gpt_oss_20260226_175022.csv)
#   574 / 617 (604, 0.242 of 2,500); both within 5% from 8192 to 32768 tokens (H200 349-358 /
#   299-303, GB200 609-632 / 646-660): the windowed kernel's rate is set by W, not the context.
#   cuDNN 9.22.0, W 128 (GPT-OSS's window), 128 / 128 heads, batch 1, GB200
#   (https://github.com/NVIDIA/cudnn-frontend/blob/fb682ce761a2705e40f9b5d528737a3e0eb33cec/benchmark/
#   sdpa_benchmark_training/results/gpt_oss/gb200/gpt_oss_20260424_100011.csv): 161 / 182 (175,
#   0.070), 165 / 187 at 8192, 167 / 188 at 16384.
# The causal curve at span W with the narrow-head ratio priced these at 0.209 (H200, W 1024),
# 0.171 (GB200, W 1024) and 0.032 (GB200, W 128): 0.69x, 0.71x and 0.46x the measured rates. So
# the stack measured gets the window curve share x W / (W + half) through the two GB200 points
# (`two_point_curve`: half 549 tokens, share 0.371) on Blackwell and, with that half (no Hopper
# measurement at a second window), through the H200 point on Hopper (share 0.304 x (1024 + 549)
# / 1024 = 0.467; 0.088 at W 128). Megatron-Bridge 26.04's cuDNN 9.20 lies between the measured
# 9.19.1 and 9.22.0; 25.11's 9.13.1 measured well below 9.18 on full attention, so its stack
# keeps the causal curve.
CUDNN_SWA_BLACKWELL = two_point_curve(128, _fwd_bwd_share(161, 182, 2500), 1024, _fwd_bwd_share(574, 617, 2500))
_SWA_919_HOPPER_1024 = _fwd_bwd_share(336, 289, 989.4)
CUDNN_SWA_HOPPER = (_SWA_919_HOPPER_1024 * (1024 + CUDNN_SWA_BLACKWELL[1]) / 1024, CUDNN_SWA_BLACKWELL[1])
_CUDNN = {**_FA3, "blackwell": CUDNN_918_BLACKWELL[0]}
_CUDNN_913 = {**_FA3, "blackwell": CUDNN_913_BLACKWELL[0]}
# torchtitan builds AdamW with foreach=True (fused=False, its default: torchtitan/optimizer.py,
# https://github.com/pytorch/torchtitan/blob/9dec370ad26b5f8e9a7333a0e36165018262644b/torchtitan/optimizer.py)
# and clips with clip_grad_norm_(foreach=True): torch's _multi_tensor_adam runs weight decay (read and write 4
# bytes), lerp of exp_avg (12), mul and addcmul of exp_avg_sq (8 + 12), sqrt, div and add eps into
# a temporary (8 + 8 + 8) and addcdiv into the parameter (16): 80 bytes per parameter; the
# clipping's _foreach_norm reads the gradient (4) and _foreach_mul_ rescales it (8).
FOREACH_ADAMW_CLIP_BYTES = 80 + 12
# llm-foundry's MPT configs train with Composer's DecoupledAdamW (weight_decay 0.0) and clip the
# gradient norm (Composer's gradient_clipping algorithm: FSDP1's clip_grad_norm_). DecoupledAdamW.adamw
# (https://github.com/mosaicml/composer/blob/02c872e43c708781bba06355a4e673557f3d5056/composer/optim/
# decoupled_weight_decay.py) runs per parameter: exp_avg's mul_ (8 bytes) and add_ (12), exp_avg_sq's
# mul_ (8) and addcmul_ of the gradient twice (16), sqrt, the division and add_(eps) into the
# denominator (8 + 8 + 8) and addcdiv_ into the parameter (16): 84 bytes; the clipping's norm reads
# the gradient (4) and its mul_ rescales it (8), unconditionally.
DECOUPLED_ADAMW_CLIP_BYTES = 84 + 12
# FlashAttention in Triton (the kernel MPT's attn_impl "triton" runs): FlashAttention-2 is "around
# 1.3-1.5x faster than FlashAttention in Triton in the forward pass and around 2x faster in the
# backward pass" (FA2 paper, Section 4.1). With the backward 2.5 forwards of work, forward and
# backward together take (1.4 + 2.5 x 2) / (1 + 2.5) = 1.83 times FA2's time.
TRITON_FA_SLOWDOWN = (1.4 + ATTENTION_BACKWARD * 2.0) / (1 + ATTENTION_BACKWARD)
_FA_TRITON = {generation: share / TRITON_FA_SLOWDOWN for generation, share in _FA2.items()}
# fmt: off
STACKS: dict[str, KernelStack] = {
    # eager PyTorch: RMSNorm as ~6 kernels (cast, pow, mean, rsqrt, mul, mul) each reading and
    # writing h: 12 passes; rotary via complex views: 8 passes over q and k; SwiGLU's silu and
    # mul: 5 passes over f; residual adds (3 passes each) and the q/k/v/output transposes: 10.
    "torch-eager": KernelStack(name="PyTorch eager, SDPA flash (FA2)", attention_share=_FA2, norm_passes=12,
                               rope_passes=8, act_passes=5, residual_passes=10, gather_copy_out=True, torch_ring=True,
                               narrow_head_share=FA2_HD64_SHARE,
                               fp8_casts=TORCHAO_TENSORWISE_CASTS, float8_tp_all_gather=True,
                               optimizer_bytes_per_param=FOREACH_ADAMW_CLIP_BYTES,
                               source="torchtitan's Llama modules run eagerly; SDPA's flash backend is FA2"),
    # torch.compile: Inductor fuses each norm, the rotary embedding and the activation into one
    # read and one write, residual adds into their neighbours.
    "torch-compile": KernelStack(name="PyTorch + torch.compile, SDPA flash (FA2)", attention_share=_FA2,
                                 norm_passes=2, rope_passes=2, act_passes=3, residual_passes=4, gather_copy_out=True,
                                 torch_ring=True, narrow_head_share=FA2_HD64_SHARE, fp8_casts=TORCHAO_TENSORWISE_CASTS, float8_tp_all_gather=True,
                                 optimizer_bytes_per_param=FOREACH_ADAMW_CLIP_BYTES,
                                 source="torch.compile (Inductor) fusion of point-wise chains"),
    # Megatron-Core / NeMo with Transformer Engine: fused LayerNorm+GEMM, fused rotary, fused bias
    # + activation, cuDNN / FA3-class attention.
    "megatron-te": KernelStack(name="Megatron-Core + Transformer Engine", attention_share=_CUDNN, norm_passes=2,
                               rope_passes=2, act_passes=3, residual_passes=4, tp_overlap_backward=True,
                               narrow_head_share=CUDNN_HD64_SHARE, unfused_rope_passes=UNFUSED_ROPE_PASSES,
                               fused_linears=True, attention_seq_half={"blackwell": CUDNN_918_BLACKWELL[1]},
                               source="Transformer Engine fused kernels; cuDNN fused attention (9.18 on Blackwell)"),
    # Megatron-LM 2021 (A100): fused bias-GeLU and fused LayerNorm kernels, softmax fused,
    # attention not flash (scores materialized): modelled as FA2-rate attention on Ampere.
    # attention as Megatron-LM computed it in 2021: QK^T and AV as batched GEMMs over the whole
    # s x s score matrix, its fused scale-mask-softmax (read + write) and dropout (read, write and
    # a byte mask) forward, the same three backward: ~10 passes of 2 bytes.
    "megatron-2021": KernelStack(name="Megatron-LM 2021 fused kernels", attention_share=_FA2, norm_passes=2,
                                 rope_passes=0, act_passes=3, residual_passes=6, score_passes=10,
                                 source="Megatron-LM fused layer norm, bias-GeLU and scaled-masked-softmax kernels"),
    # llm-foundry MPT as its benchmark tables ran: scripts/train/benchmarking/submit_benchmarks.py
    # sets attn_impl "triton" (its default in every version that produced the tables): FlashAttention
    # in Triton, compiled by triton-pre-mlir (llm-foundry's setup.py pins vchiley/triton's
    # triton_pre_mlir_sm90 branch); the H100 and A100 80GB sweep that produced the "H100 80GB BF16"
    # table (sweep.sh at b2a43a1477a45f40f4086a1c72f851b0ab42d0ac) ran llm-foundry v0.3.0 on the
    # mosaicml/pytorch:2.1.0_cu121 image. Torch layer_norm (one kernel: 2 passes), torch GELU (one
    # kernel), eager residual adds and transposes. No rotary and no ALiBi: the pretrain yamls leave
    # attn_config.alibi at its default, False, so MPT adds learned position embeddings once, at the
    # embedding (llmfoundry/models/mpt/configuration_mpt.py at v0.3.0).
    "llm-foundry": KernelStack(name="llm-foundry MPT (eager, Triton flash attention)", attention_share=_FA_TRITON,
                               norm_passes=2, rope_passes=0, act_passes=2, residual_passes=10, flat_param_reduce=True,
                               optimizer_bytes_per_param=DECOUPLED_ADAMW_CLIP_BYTES,
                               source="llm-foundry MPT blocks: low-precision LayerNorm, FlashAttention in Triton, GELU"),
    # llm-foundry's large-scale H100 sweep (scripts/train/benchmarking/sweep.py, added with the
    # "H100 80GB BF16 (Large Scale)" table, https://github.com/mosaicml/llm-foundry/blob/
    # 5e85bd62d4ec9e13353ca95877477602ab538e5b/scripts/train/benchmarking/sweep.py) runs the 1b, 3b,
    # 7b and 70b models with `--attn_impl flash` and installs flash-attn 2.4.2 (`.[gpu-flash2]`),
    # the first to take ALiBi slopes (which these yamls leave off): FlashAttention-2, the rest of
    # the block as above. Its flash_attn_fn (llmfoundry/models/layers/attention.py at that commit)
    # unpads around the kernel in every layer, through flash-attn's bert_padding
    # (https://github.com/Dao-AILab/flash-attention/blob/1a2c3e8c25251fa30ebee074c27ecbf69c2bad2b/
    # flash_attn/bert_padding.py, v2.4.2): unpad_input on q, k and v (IndexFirstAxis: a torch.gather
    # of each, read 2 and write 2 bytes an element; backward torch.zeros and scatter_, 2 + 2 + 2)
    # and pad_input on the output (IndexPutFirstAxis: torch.zeros and the indexed copy, 2 + 2 + 2;
    # backward the indexed read, 2 + 2). Per token and layer that is 3 x 4 + 6 = 18 bytes per
    # element of h forward (9 passes of 2 bytes) and 3 x 6 + 4 = 22 backward (11 passes); the block
    # model charges backward twice the forward's element-wise work, so the 20 passes are 20 / 3 more
    # forward passes beside the residual adds. (Each unpad_input also waits on the GPU twice,
    # torch.nonzero and .item(): two host syncs per tensor, six a layer, not priced.)
    "llm-foundry-flash2": KernelStack(name="llm-foundry MPT (eager, FlashAttention-2)", attention_share=_FA2,
                                      norm_passes=2, rope_passes=0, act_passes=2, residual_passes=10 + (9 + 11) / 3,
                                      narrow_head_share=FA2_HD64_SHARE, flat_param_reduce=True,
                                      optimizer_bytes_per_param=DECOUPLED_ADAMW_CLIP_BYTES,
                                      source="llm-foundry MPT blocks with attn_impl flash (flash-attn 2.4.2, unpadded)"),
}
# fmt: on
# Megatron-Bridge's 25.11 container: the same stack with cuDNN 9.13.1's attention on Blackwell
# ([Note: cuDNN attention on Blackwell]); Hopper keeps the FlashAttention-3-class share.
STACKS["megatron-te-cudnn9.13"] = replace(
    STACKS["megatron-te"],
    name="Megatron-Core + Transformer Engine (cuDNN 9.13)",
    attention_share=_CUDNN_913,
    attention_seq_half={"blackwell": CUDNN_913_BLACKWELL[1]},
    source="Transformer Engine fused kernels; cuDNN 9.13.1 fused attention (NeMo 25.11)",
)

# Megatron-Bridge's 26.04 container (cuDNN 9.20): the measured 9.19.1 on Hopper, 9.18.1 on Blackwell.
STACKS["megatron-te-cudnn9.20"] = replace(
    STACKS["megatron-te"],
    name="Megatron-Core + Transformer Engine (cuDNN 9.20)",
    attention_share={**_CUDNN, "hopper": CUDNN_919_HOPPER[0]},
    attention_seq_half={"hopper": CUDNN_919_HOPPER[1], "blackwell": CUDNN_918_BLACKWELL[1]},
    window_curve={"hopper": CUDNN_SWA_HOPPER, "blackwell": CUDNN_SWA_BLACKWELL},
    source="Transformer Engine fused kernels; cuDNN 9.19/9.18 fused attention as measured (NeMo 26.04 ships 9.20)",
)


def stack(name: str) -> KernelStack:
    try:
        return STACKS[name]
    except KeyError:
        raise ValueError(f"unknown kernel stack {name!r}; use one of {sorted(STACKS)}") from None
