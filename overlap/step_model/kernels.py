"""Seconds of a transformer block's compute on one GPU, from its shape and the kernels that run it
(the fp8 casts and quantizers around its GEMMs: fp8.py).

[Note: block compute]
A block's forward on one rank (tensor parallel T, context parallel C, t tokens of its micro-batch
on this rank) is three kinds of work, each at its own rate:
    GEMMs        2·t·(wq, wk, wv, wo, MLP matrices)/T FLOPs at bf16 (or fp8) peak x gemm_share x
                 the shape's tile efficiency d / (d + TILE), d the smaller of the GEMM's K and N
                 on this rank (a 128-wide tile's prologue and epilogue are paid per output tile)
    attention    the causal kernel's FLOPs, 2·t·s_ctx·h/T (half of the full 4·t·s·h), at bf16
                 peak x the stack's attention share x s_ctx / (s_ctx + ATTENTION_SEQ_HALF):
                 flash kernels lose at short sequences
    element-wise bytes of the norms, rotary embedding, activation and residual adds at HBM
                 bandwidth x HBM_SHARE; the stack says how many passes over the activations each
                 takes (eager PyTorch runs several kernels per norm; torch.compile and
                 Transformer Engine fuse them)
Backward is twice the forward's GEMMs and element-wise work and 2.5 times its attention (flash
attention's backward recomputes the scores: FlashAttention-2 paper, Section 3.2's FLOP count).
Activation checkpointing re-runs what it dropped: full, the whole forward; selective (torchtitan's
op-level policy), every second matmul and the element-wise work; Megatron's selective, the core
attention only; torchtitan's layer policy "2" (every second block whole), half a forward.

[Note: attention at narrow heads]
A flash kernel does the same softmax work per score whatever the head width, so at head dim 64
each score carries half the matmul FLOPs of head dim 128 and the kernel reaches less of the peak.
FlashAttention-3 measures it for the kernels it compares (Shah et al. 2024, arXiv:2407.08608,
Figure 5, BF16 forward on an H100 SXM5, https://arxiv.org/abs/2407.08608): at sequence 16k cuDNN
runs 413 TFLOPS at head dim 64 against 595 at head dim 128 (0.694; 408 / 609 at 4k), FA3 497
against 648, FlashAttention-2 324 against 370. A stack's `narrow_head_share` is its kernel's
ratio; between 64 and 128 it is interpolated linearly in the head dim, wider heads keep the
long-sequence share (the stacks' shares are measured at 128), narrower ones keep the ratio at 64.
On Blackwell the softmax's exponentials bound the forward already at head dim 128 (the
special-function units did not grow with the tensor cores: "the main performance bottleneck
lies ... in the SFU units for softmax exponential during the FWD computation",
https://www.together.ai/blog/flashattention-4), so the Hopper ratio is a floor there.

[Note: unfused rotary embedding]
Transformer Engine's fused rotary kernel reads q and k once and writes them once (2 passes).
Megatron-Bridge turns it off for any position embedding other than plain RoPE
(`validate_rope_fusion_compatibility` in src/megatron/bridge/utils/fusions.py: "apply_rope_fusion
is only compatible with RoPE position embeddings", so GPT-OSS's YaRN runs unfused), and
Megatron-Core then applies `_apply_rotary_pos_emb_bshd`
(https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/models/common/embeddings/rope_utils.py):
_rotate_half's negation of one half and its cat (1 + 2 passes over q or k), t * cos and
rotated * sin (2 + 2), their sum (3) and the closing cat with the unrotated part (2): 12 passes,
`unfused_rope_passes`; backward, as the other element-wise work, twice the forward's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from overlap.step_model.fp8 import (
    INPUT_CAST_BYTES,
    ROWWISE_KERNEL_SHARE,
    TE_RECIPES,
    TORCHAO_TENSORWISE_CASTS,
    Fp8Casts,
    Fp8Recipe,
    te_quantize_seconds,
)
from overlap.step_model.hardware import HBM_SHARE, Accelerator

TILE = 128
"""Output tile width of the GEMM kernels (CUTLASS/cuBLAS sm80 and sm90 tiles are 128 wide)."""
ATTENTION_SEQ_HALF = 512
"""Context length at which a flash kernel reaches half its long-sequence rate (FlashAttention-2
paper, Figures 4-7: throughput rises from 512 to 8K and flattens after)."""
ATTENTION_BACKWARD = 2.5
"""Flash attention backward / forward FLOPs (the benchmark convention of flash-attn)."""
ACT_BYTES = 2

Mlp = Literal["swiglu", "gelu"]
PositionEmbedding = Literal["rope", "yarn", "alibi"]
CUDNN_HD64_SHARE = 413.0 / 595.0
"""cuDNN's BF16 attention rate at head dim 64 over head dim 128 ([Note: attention at narrow heads])."""
FA2_HD64_SHARE = 324.0 / 370.0
"""FlashAttention-2's, on the same figure."""
UNFUSED_ROPE_PASSES = 12
"""Passes over q and k of Megatron-Core's unfused rotary embedding ([Note: unfused rotary embedding])."""
Recompute = Literal["none", "selective", "full", "attention", "layer2"]


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
# cuDNN's fused attention on Blackwell, measured by NVIDIA's cudnn-frontend SDPA training benchmark
# on a GB200 with cuDNN 9.18.1 (benchmark/sdpa_benchmark_training/results/gb200_918_only_cudnn/
# llama3.1_20260126_110503.csv, https://github.com/NVIDIA/cudnn-frontend/blob/
# 9072c4e78eaba9e5af685c4d5de69d18d94a1a29/benchmark/sdpa_benchmark_training/results/gb200_918_only_cudnn/
# llama3.1_20260126_110503.csv): causal, BF16, 64 query / 8 key-value heads of 128, sequence 4096:
# forward 1,297 and backward 1,105 TFLOPS (backward counted as 2.5 forwards, our convention), so
# forward+backward 3.5 / (1 / 1297 + 2.5 / 1105) = 1,154 TFLOPS, 0.462 of the 2,500 TFLOPS peak;
# through the model's sequence factor 4096 / (4096 + ATTENTION_SEQ_HALF) that is a long-sequence
# share of 0.52 (the 8192 point, 1,563 / 1,279, gives 0.57: the model's curve is FlashAttention-2's
# and rises more slowly than cuDNN's on Blackwell, so 8192-token runs are priced a little slow).
# 4096 is the sequence of most published Blackwell runs this stack prices (16 of 24); DeepSeek-V3's
# 192/128 MLA heads measure the same there (dsv3_20260126_110621.csv: 1,324 / 1,083, 0.51). Taken for every Blackwell card as a share of its own peak.
CUDNN_BLACKWELL_SHARE = round(3.5 / (1 / 1297 + 2.5 / 1105) / 2500 / (4096 / (4096 + ATTENTION_SEQ_HALF)), 3)
_CUDNN = {**_FA3, "blackwell": CUDNN_BLACKWELL_SHARE}
# torchtitan builds AdamW with foreach=True (fused=False, its default: torchtitan/optimizer.py,
# https://github.com/pytorch/torchtitan/blob/9dec370ad26b5f8e9a7333a0e36165018262644b/torchtitan/optimizer.py)
# and clips with clip_grad_norm_(foreach=True): torch's _multi_tensor_adam runs weight decay (read and write 4
# bytes), lerp of exp_avg (12), mul and addcmul of exp_avg_sq (8 + 12), sqrt, div and add eps into
# a temporary (8 + 8 + 8) and addcdiv into the parameter (16): 80 bytes per parameter; the
# clipping's _foreach_norm reads the gradient (4) and _foreach_mul_ rescales it (8).
FOREACH_ADAMW_CLIP_BYTES = 80 + 12
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
                               fused_linears=True,
                               source="Transformer Engine fused kernels; cuDNN fused attention"),
    # Megatron-LM 2021 (A100): fused bias-GeLU and fused LayerNorm kernels, softmax fused,
    # attention not flash (scores materialized): modelled as FA2-rate attention on Ampere.
    # attention as Megatron-LM computed it in 2021: QK^T and AV as batched GEMMs over the whole
    # s x s score matrix, its fused scale-mask-softmax (read + write) and dropout (read, write and
    # a byte mask) forward, the same three backward: ~10 passes of 2 bytes.
    "megatron-2021": KernelStack(name="Megatron-LM 2021 fused kernels", attention_share=_FA2, norm_passes=2,
                                 rope_passes=0, act_passes=3, residual_passes=6, score_passes=10,
                                 source="Megatron-LM fused layer norm, bias-GeLU and scaled-masked-softmax kernels"),
    # llm-foundry MPT as its benchmark tables ran: scripts/train/benchmarking/submit_benchmarks.py
    # sets attn_impl "triton" (its default in every version that produced the tables, on the
    # torch 1.13.1 image): FlashAttention in Triton; torch layer_norm (one kernel: 2 passes),
    # torch GELU (one kernel), ALiBi (no rotary), eager residual adds and transposes.
    "llm-foundry": KernelStack(name="llm-foundry MPT (eager, Triton flash attention)", attention_share=_FA_TRITON,
                               norm_passes=2, rope_passes=0, act_passes=2, residual_passes=10, flat_param_reduce=True,
                               source="llm-foundry MPT blocks: low-precision LayerNorm, FlashAttention in Triton, GELU"),
    # llm-foundry's large-scale H100 sweep (scripts/train/benchmarking/sweep.py, added with the
    # "H100 80GB BF16 (Large Scale)" table, https://github.com/mosaicml/llm-foundry/blob/
    # 5e85bd62d4ec9e13353ca95877477602ab538e5b/scripts/train/benchmarking/sweep.py) runs the 1b, 3b,
    # 7b and 70b models with `--attn_impl flash` and installs flash-attn 2.4.2 (`.[gpu-flash2]`),
    # whose kernel takes ALiBi slopes: FlashAttention-2, the rest of the block as above.
    "llm-foundry-flash2": KernelStack(name="llm-foundry MPT (eager, FlashAttention-2)", attention_share=_FA2,
                                      norm_passes=2, rope_passes=0, act_passes=2, residual_passes=10,
                                      narrow_head_share=FA2_HD64_SHARE, flat_param_reduce=True,
                                      source="llm-foundry MPT blocks with attn_impl flash (flash-attn 2.4.2)"),
}
# fmt: on


@dataclass(frozen=True, kw_only=True)
class BlockShape:
    """One decoder block: the shape its compute depends on.

    Attention is grouped-query (`head_dim` wide heads; 0: hidden / num_heads) or, with
    `kv_lora_rank`, DeepSeek's multi-head latent attention: queries through a `q_lora_rank`
    bottleneck (0: none), keys and values from one `kv_lora_rank` latent, query/key heads of
    `head_dim` + `rope_head_dim`, value heads of `v_head_dim`. `ffn_hidden` 0: no dense MLP (a
    MoE layer's experts are priced by overlap/step_model/moe.py)."""

    hidden: int
    ffn_hidden: int
    num_heads: int
    num_kv_heads: int
    mlp: Mlp = "swiglu"
    head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    position_embedding: PositionEmbedding = "rope"

    @property
    def qk_head_dim(self) -> int:
        return (self.head_dim or self.hidden // self.num_heads) + self.rope_head_dim

    @property
    def kv_dim(self) -> int:
        return (self.head_dim or self.hidden // self.num_heads) * self.num_kv_heads

    @property
    def attention_width(self) -> float:
        """Heads x (query/key head + value head) / 2: QK^T and AV cost 4 x this FLOPs per token
        and position attended (= hidden for Llama-style heads)."""
        v = self.v_head_dim or self.qk_head_dim
        return self.num_heads * (self.qk_head_dim + v) / 2

    def attention_gemms(self) -> list[tuple[int, int, bool]]:
        """(K, N, row-parallel) of each attention weight, unsharded."""
        h, heads = self.hidden, self.num_heads
        if not self.kv_lora_rank:
            q = heads * self.qk_head_dim
            return [(h, q, False), (h, self.kv_dim, False), (h, self.kv_dim, False), (q, h, True)]
        qk, v, rank = self.qk_head_dim, self.v_head_dim or self.qk_head_dim, self.kv_lora_rank
        nope = qk - self.rope_head_dim
        q = (
            [(h, self.q_lora_rank, False), (self.q_lora_rank, heads * qk, False)]
            if self.q_lora_rank
            else [(h, heads * qk, False)]
        )
        # the latent and the shared rotary key are computed whole on every rank (Megatron's MLA)
        return q + [(h, rank + self.rope_head_dim, False), (rank, heads * (nope + v), False), (heads * v, h, True)]

    def mlp_gemms(self) -> list[tuple[int, int, bool]]:
        h, f = self.hidden, self.ffn_hidden
        if not f:
            return []
        return [(h, f, False), (h, f, False), (f, h, True)] if self.mlp == "swiglu" else [(h, f, False), (f, h, True)]

    def norm_fused_input(self, k: int, row_parallel: bool) -> bool:
        """Whether the attention or MLP GEMM of input width `k` reads its input from a norm fused
        into the linear (Transformer Engine's LayerNormLinear, which takes current scaling's amax
        as it normalizes: [Note: FP8 current scaling]): Megatron-Core's linear_qkv and dense
        linear_fc1, and MLA's q/kv up-projections; not the row-parallel GEMMs, nor MLA's
        down-projections (a standalone norm's output)."""
        if row_parallel:
            return False
        return not (self.kv_lora_rank and k == self.hidden)

    def fused_with_previous(self) -> list[bool]:
        """Per GEMM of `attention_gemms() + mlp_gemms()`: whether Megatron-Core runs it in one linear
        with the GEMM before it (k and v in linear_qkv, the up projection in linear_fc1), reading
        the input that linear quantized once ([Note: Transformer Engine's casts]). MLA's
        down-projections are separate linears."""
        gqa = not self.kv_lora_rank
        attention = [gqa and i in (1, 2) for i in range(len(self.attention_gemms()))]
        return attention + [self.mlp == "swiglu" and i == 1 for i in range(len(self.mlp_gemms()))]

    def gemms(self) -> list[tuple[int, int]]:
        """(K, N) of each weight matrix of the block, unsharded."""
        return [(k, n) for k, n, _ in self.attention_gemms() + self.mlp_gemms()]


@dataclass(frozen=True)
class BlockSeconds:
    """One block on one rank for one micro-batch."""

    forward_s: float
    backward_s: float
    recompute_s: float
    gemm_forward_s: float
    attention_forward_s: float
    elementwise_forward_s: float


def narrow_head_factor(head_dim: int, stack: KernelStack) -> float:
    """The attention rate at `head_dim` over its rate at 128 ([Note: attention at narrow heads])."""
    if head_dim >= 128:
        return 1.0
    return stack.narrow_head_share + (1.0 - stack.narrow_head_share) * max(0, head_dim - 64) / 64


def tile_efficiency(k: int, n: int) -> float:
    d = min(k, n)
    return d / (d + TILE)


def gemm_seconds(tokens: float, k: int, n: int, gpu: Accelerator, fp8: bool, recipe: Fp8Recipe = "tensorwise",
                 cast_bytes: float = INPUT_CAST_BYTES, amax_fused: bool = False) -> float:  # fmt: skip
    """One forward GEMM of `tokens` rows through a K x N weight ([Note: block compute]); with fp8,
    `cast_bytes` per input element for its cast, at HBM bandwidth, and under Transformer Engine's
    recipes the input quantized for both usages (`te_quantize_seconds`), under current scaling
    with its amax pass unless the kernel that wrote the input took it (`amax_fused`, [Note: FP8
    current scaling])."""
    fp8 = bool(fp8 and gpu.fp8_tflops)
    if fp8 and recipe in TE_RECIPES:
        return _gemm_only_seconds(tokens, k, n, gpu, fp8, recipe) + te_quantize_seconds(
            tokens, k, gpu, recipe, amax_fused=amax_fused
        )
    cast = tokens * k * cast_bytes / (gpu.hbm_tbps * 1e12 * HBM_SHARE) if fp8 else 0.0
    return _gemm_only_seconds(tokens, k, n, gpu, fp8, recipe) + cast


def _gemm_only_seconds(tokens: float, k: int, n: int, gpu: Accelerator, fp8: bool, recipe: Fp8Recipe) -> float:
    """The GEMM kernel alone, its operands already in the dtype it reads ([Note: block compute])."""
    if fp8 and gpu.fp8_tflops:
        rate = gpu.fp8_tflops * gpu.fp8_gemm_share * (ROWWISE_KERNEL_SHARE if recipe == "rowwise" else 1.0)
    else:
        rate = gpu.bf16_tflops * gpu.gemm_share
    return 2.0 * tokens * k * n / (rate * 1e12 * tile_efficiency(k, n))


def gemm_backward_seconds(tokens: float, k: int, n: int, gpu: Accelerator, fp8: bool,
                          recipe: Fp8Recipe = "tensorwise", cast_bytes: float = INPUT_CAST_BYTES,
                          grad_rows: float | None = None) -> float:  # fmt: skip
    """The two backward GEMMs (grad input, grad weight) of one forward GEMM ([Note: float8
    recipes]): twice the forward's work, under rowwise scaling the casts along the other axis
    and the rescale of grad input. Under Transformer Engine's recipes twice the forward's GEMM
    and the output gradient quantized for both usages ([Note: Transformer Engine's casts]), on
    its `grad_rows` rows (default `tokens`; the sequence shard where it is all-gathered after)."""
    if fp8 and gpu.fp8_tflops and recipe in TE_RECIPES:
        gathered = tokens if grad_rows is not None and grad_rows < tokens else None
        grad = te_quantize_seconds(tokens if grad_rows is None else grad_rows, n, gpu, recipe, gathered_rows=gathered)
        return 2 * _gemm_only_seconds(tokens, k, n, gpu, fp8, recipe) + grad
    base = 2 * gemm_seconds(tokens, k, n, gpu, fp8, "tensorwise", cast_bytes)
    if not (fp8 and gpu.fp8_tflops) or recipe == "tensorwise":
        return base
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    # grad_output (tokens x N) and the input (tokens x K) cast once more along their other axis:
    # a column amax (one read) and the cast (read 2, write 1 bytes); grad input rescaled (read and
    # write 2 bytes of tokens x K)
    return base + tokens * (n + k) * (2 + 3) / hbm + tokens * k * 4 / hbm


def block_seconds(
    shape: BlockShape,
    tokens: float,
    context: int,
    gpu: Accelerator,
    stack: KernelStack,
    *,
    tp: int = 1,
    fp8: bool = False,
    fp8_recipe: Fp8Recipe = "tensorwise",
    recompute: Recompute = "none",
    window: int = 0,
) -> BlockSeconds:
    """[Note: block compute] for `tokens` tokens on this rank attending over `context` tokens
    (causally; with a sliding `window`, to at most that many before each)."""
    gemms = shape.attention_gemms() + shape.mlp_gemms()
    casts = stack.fp8_casts if fp8 and gpu.fp8_tflops and fp8_recipe == "tensorwise" else None
    cast_bytes = INPUT_CAST_BYTES if casts is None else 0.0
    te = fp8 and gpu.fp8_tflops and fp8_recipe in TE_RECIPES
    shared = shape.fused_with_previous() if stack.fused_linears else [False] * len(gemms)
    gemm = gemm_backward = 0.0
    for (k, n, row), shares_input in zip(gemms, shared, strict=True):
        ks, ns = _shard(k, n, tp, row)
        fused = shape.norm_fused_input(k, row)
        # under sequence parallelism a column-parallel GEMM's input and a row-parallel GEMM's
        # output gradient are quantized on the sequence shard, then gathered
        grad_rows = tokens / tp if row else tokens
        if te:
            gemm += _gemm_only_seconds(tokens, ks, ns, gpu, True, fp8_recipe)
            if not shares_input:
                gathered = None if row or tp == 1 else tokens
                rows = tokens if gathered is None else tokens / tp
                gemm += te_quantize_seconds(rows, ks, gpu, fp8_recipe, amax_fused=fused, gathered_rows=gathered)
        else:
            gemm += gemm_seconds(tokens, ks, ns, gpu, fp8, fp8_recipe, cast_bytes, amax_fused=fused)
        gemm_backward += gemm_backward_seconds(tokens, ks, ns, gpu, fp8, fp8_recipe, cast_bytes, grad_rows)
    if casts is not None:
        cast_forward, cast_backward = fp8_cast_seconds(shape, tokens, gpu, casts, tp, stack.float8_tp_all_gather)
        gemm += cast_forward
        gemm_backward += cast_backward
    heads_dim = shape.attention_width / tp
    if stack.score_passes:
        head_dim = shape.qk_head_dim
        scores = tokens * context * (shape.num_heads / tp) * stack.score_passes * ACT_BYTES
        score_gemms = 4.0 * tokens * context * heads_dim / (gpu.bf16_tflops * 1e12 * gpu.gemm_share
                                                            * tile_efficiency(head_dim, context))  # fmt: skip
        # forward: the GEMMs and a third of the passes; ATTENTION_BACKWARD scales it for backward
        attention = score_gemms + scores / 3 / (gpu.hbm_tbps * 1e12 * HBM_SHARE)
    else:
        span = min(context, window) if window else context
        # a causal token attends to context / 2 positions on average, to w - w^2 / 2s in a window w
        attended = context / 2 if span == context else span - span * span / (2 * context)
        attn_share = stack.attention_share[gpu.generation] * span / (span + ATTENTION_SEQ_HALF)
        attn_share *= narrow_head_factor(shape.qk_head_dim, stack)
        attention = 4.0 * tokens * attended * heads_dim / (gpu.attention_peak_tflops * 1e12 * attn_share)
    h, kv, f = shape.hidden / tp, shape.kv_dim / tp, shape.ffn_hidden / tp
    rope_passes = stack.rope_passes
    if shape.position_embedding != "rope" and stack.unfused_rope_passes is not None:
        rope_passes = stack.unfused_rope_passes
    # the rotary embedding acts on the query heads (their width need not be the hidden size)
    q = h if shape.kv_lora_rank else shape.num_heads * shape.qk_head_dim / tp
    passes = (
        2 * stack.norm_passes * shape.hidden
        + rope_passes * (q + kv)
        + stack.act_passes * f
        + stack.residual_passes * shape.hidden
    )  # norms and residuals act on the full (SP-gathered) width
    elementwise = tokens * passes * ACT_BYTES / (gpu.hbm_tbps * 1e12 * HBM_SHARE)
    forward = gemm + attention + elementwise
    backward = gemm_backward + ATTENTION_BACKWARD * attention + 2 * elementwise
    recompute_s = {
        "none": 0.0,
        "full": forward,
        "selective": 0.5 * gemm + elementwise,
        "attention": attention,
        "layer2": 0.5 * forward,
    }[recompute]
    return BlockSeconds(forward, backward, recompute_s, gemm, attention, elementwise)


def fp8_cast_seconds(shape: BlockShape, tokens: float, gpu: Accelerator, casts: Fp8Casts, tp: int,
                     float8_tp: bool) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds of one block's activation casts under tensorwise fp8
    ([Note: float8 recipes]). Column-parallel GEMMs that read the same input (q, k, v; the MLP's
    gate and up) cast it once (torch.compile merges the identical casts); with float8 tensor
    parallelism that cast runs on the rank's sequence shard before the fp8 all-gather, and the
    row-parallel GEMMs' output gradients are scaled and cast on the shard before theirs, the
    gathered fp8 tensors transposed (read and write 1 byte) for grad_weight."""
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    shard = tokens / tp if float8_tp and tp > 1 else tokens
    forward = backward = 0.0
    for gemms in (shape.attention_gemms(), shape.mlp_gemms()):
        inputs = {k for k, _, row in gemms if not row}  # one input per width of column GEMMs
        forward += sum(shard * k * casts.forward_input for k in inputs)
        backward += sum(tokens * k * (2 if shard < tokens else casts.backward_input) for k in inputs)
        for k, n, row in gemms:
            if not row:
                backward += tokens * (n / tp) * casts.backward_grad
                continue
            forward += tokens * (k / tp) * casts.forward_input
            backward += tokens * (k / tp) * casts.backward_input
            grad_scaled = casts.forward_input  # amax and the first cast, on the shard
            backward += shard * n * grad_scaled + tokens * n * (
                2 if shard < tokens else casts.backward_grad - grad_scaled
            )
    return forward / hbm, backward / hbm


def _shard(k: int, n: int, tp: int, row_parallel: bool) -> tuple[int, int]:
    """Column-parallel matrices split N, row-parallel (wo, the MLP's last) split K."""
    return (k // tp, n) if row_parallel else (k, n // tp)


def head_seconds(tokens: float, hidden: int, vocab: int, gpu: Accelerator, tp: int = 1) -> tuple[float, float]:
    """Forward and backward seconds of the output projection and the loss (logits in fp32: one
    write and three passes of the cross-entropy, forward and backward)."""
    fwd = gemm_seconds(tokens, hidden, vocab // tp, gpu, fp8=False)
    loss = tokens * (vocab / tp) * 4 * 4 / (gpu.hbm_tbps * 1e12 * HBM_SHARE)
    return fwd + loss, 2 * fwd + loss


def stack(name: str) -> KernelStack:
    try:
        return STACKS[name]
    except KeyError:
        raise ValueError(f"unknown kernel stack {name!r}; use one of {sorted(STACKS)}") from None
