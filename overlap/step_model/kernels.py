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
    Fp8Casts,
    Fp8Recipe,
    te_quantize_seconds,
)
from overlap.step_model.hardware import HBM_SHARE, Accelerator
from overlap.step_model.stacks import (  # noqa: F401  the kernel stacks (stacks.py), importable from here as before
    ATTENTION_BACKWARD,
    ATTENTION_SEQ_HALF,
    CUDNN_HD64_SHARE,
    FA2_HD64_SHARE,
    STACKS,
    UNFUSED_ROPE_PASSES,
    KernelStack,
)

TILE = 128
"""Output tile width of the GEMM kernels (CUTLASS/cuBLAS sm80 and sm90 tiles are 128 wide)."""
ACT_BYTES = 2

Mlp = Literal["swiglu", "gelu"]
PositionEmbedding = Literal["rope", "yarn", "alibi"]
Recompute = Literal["none", "selective", "full", "attention", "layer2"]


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
        if span < context and gpu.generation in stack.window_curve:
            # measured at head dim 64 ([Note: cuDNN sliding-window attention] in stacks.py)
            share, half = stack.window_curve[gpu.generation]
            narrow = narrow_head_factor(shape.qk_head_dim, stack) / narrow_head_factor(64, stack)
            attn_share = share * span / (span + half) * narrow
        else:
            half = stack.attention_seq_half.get(gpu.generation, ATTENTION_SEQ_HALF)
            attn_share = stack.attention_share[gpu.generation] * span / (span + half)
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
