"""fp8 GEMM operands: what casting and quantizing them costs, per recipe and kernel stack.

The GEMMs themselves are priced in kernels.py ([Note: block compute]); this module prices the
memory-bound work around them: torchao's tensorwise and rowwise casts, Transformer Engine's
quantizers (current scaling, MXFP8) and Hopper's transposed copies.

[Note: float8 recipes]
torchao's float8 training recipes (torchao.float8.Float8LinearRecipeName) differ in more than the
scale's granularity. TENSORWISE calls cuBLAS's fp8 kernel with one scale per tensor; the cast of an
operand and of its transpose share that scale. ROWWISE calls PyTorch's CUTLASS rowwise kernel,
which runs "most shapes within 90-100% of tensor-wise efficiency, a long tail down to 50%"
(https://github.com/pytorch/pytorch/issues/147971): 0.9 of the fp8 rate is taken. Its backward casts grad_output and
the input again along the other axis (a row scale is not a column scale: one more amax pass and
cast each), and because the CUTLASS kernel is slow with the precise accumulation the backward
needs, torchao runs the backward GEMMs on cuBLAS with unit scales and rescales the output
afterwards (https://github.com/pytorch/ao/pull/1325): one more read and write of grad input. The casts weigh most on
thin GEMMs (https://github.com/pytorch/torchtitan/issues/1207: rowwise made Llama's tensor-parallel wk and wv ~40% slower,
flat against bf16 overall), which the per-GEMM casts below price by the GEMM's own K and N.
TENSORWISE in torchao (torchtitan's stacks, `Fp8Casts`) scales dynamically: the amax of the
tensor first, then the cast. Per linear it casts the input forward and, backward, the output
gradient for both backward GEMMs and the input again for grad_weight (torchao's training
workflow: grad_input = to_fp8(grad_output) @ to_fp8(weight), grad_weight = to_fp8(input.t()) @
to_fp8(grad_output), https://docs.pytorch.org/ao/stable/workflows/training.html). These bytes
reproduce torchao's own Float8Linear microbenchmark on H100 (torchao/float8/README.md,
"Performance": 1.39x over bf16 at M, K, N = 4096, 8192, 16384; 0.80x at 1024, 2048, 1024) within
3%, where a single 3-byte input cast per GEMM gives 1.50x and 0.85x. Linears that read the same
input (q, k and v; the gate and up projections) share its cast under torch.compile; with float8
tensor parallelism it runs on the sequence shard before the fp8 all-gather (`fp8_cast_seconds`).

[Note: MXFP8]
Transformer Engine's MXFP8BlockScaling (Megatron-Bridge's FP8-MX / MXFP8 on Blackwell) scales
every 32 consecutive elements by one E8M0 byte. "Rowwise and columnwise quantizations are
different ... one cannot derive one from the other. Both must be quantized independently from
the full-precision data" (https://github.com/NVIDIA/TransformerEngine/blob/
d0067d0da6cb01811b8072a7d304f0e00344ce2b/docs/features/low_precision_training/mxfp8/mxfp8.rst):
the forward GEMM reads its input in 1x32 blocks along K, the weight-gradient GEMM in 32x1 blocks
along the tokens, and likewise the output gradient for the data- and weight-gradient GEMMs. A
tensorwise-scaled tensor on Blackwell serves both usages from one copy ("the rowwise and
columnwise tensors share the same physical memory layout", fp8_current_scaling.rst there). So
per GEMM, beyond the tensorwise cast the model prices (`INPUT_CAST_BYTES`), MXFP8 writes a second
fp8 copy of its input forward and of its output gradient backward, each with its scales (1 byte
per 32 elements per copy): `MXFP8_EXTRA_BYTES` per element, at HBM bandwidth. The block amax is
taken in the quantizing kernel's one read (no separate amax pass). The scales' swizzle into the
layout cuBLAS reads "can be fused with quantization" when no communication sits between them;
the rows it applies to quantize after their collectives (TP 1; experts' tokens arrive in bf16),
so no separate pass is priced. Weights are quantized once per step (Megatron-Core passes
is_first_microbatch to Transformer Engine, which caches the fp8 weights across micro-batches)
and are not priced, as under tensorwise scaling.

[Note: FP8 current scaling]
Transformer Engine's Float8CurrentScaling (Megatron-Core's fp8_recipe "tensorwise", which
megatron/core/fp8_utils.py maps to it; Megatron-Bridge's FP8-CS) scales each tensor by the amax of
the data being cast: "Quantization is a memory-bound operation that requires reading the tensor
twice: First read: compute amax across all elements. Second read: apply the scaling factor and
cast to FP8" (https://github.com/NVIDIA/TransformerEngine/blob/
d0067d0da6cb01811b8072a7d304f0e00344ce2b/docs/features/low_precision_training/fp8_current_scaling/
fp8_current_scaling.rst). `Float8CurrentScalingQuantizer::quantize` runs nvte_compute_amax (a
read of the bf16 tensor), the scale, then the cast (transformer_engine/pytorch/csrc/quantizer.cpp
there), so beyond the cast the model prices (`INPUT_CAST_BYTES`) each quantized activation costs
`CURRENT_AMAX_BYTES` per element, at HBM bandwidth. Transformer Engine fuses the amax into the
kernel that produces the tensor in two places (extensions/normalization.cpp's FUSED_NORM_AMAX_FP8
and extensions/activation.cpp's FUSED_ACTIVATION_AMAX_FP8: the norm or activation writes its bf16
output and its amax, then `quantize_with_amax` casts): a LayerNormLinear's input, i.e. Megatron-
Core's linear_qkv and a dense MLP's linear_fc1 (and MLA's up-projections behind their q/kv norms),
pays no amax pass. Everything else does: the attention output into linear_proj; linear_fc2's input,
which Megatron-Core's own fused bias-SwiGLU writes in bf16 (use_te_activation_func is off by
default, so TE's fused activation + amax does not run); MLA's down-projections, which read a
standalone TENorm's output; and every output gradient backward (TE's grad_output_preprocess calls
the quantizer on it; under sequence parallelism on the rank's shard, before the fp8 all-gather).

[Note: Transformer Engine's casts]
Under its own recipes (current scaling, MXFP8) Transformer Engine quantizes each GEMM operand once
for both of its usages, in forward the input for fprop (rowwise) and wgrad (columnwise), in
backward the output gradient for dgrad and wgrad (transformer_engine/pytorch/module/linear.py:
`input_quantizer.set_usage(rowwise=True, columnwise=backward_needs_input)`, the columnwise input
saved for backward; https://github.com/NVIDIA/TransformerEngine/blob/
d0067d0da6cb01811b8072a7d304f0e00344ce2b/transformer_engine/pytorch/module/linear.py). The input
is not cast again backward. What a columnwise copy costs depends on the GPU: "Hopper: cannot
efficiently access elements in columnwise fashion, so columnwise tensors need to be physically
transposed in memory ... Blackwell: supports columnwise access natively, so no transpose is
needed" (docs/features/low_precision_training/performance_considerations/
performance_considerations.rst there). Per-tensor fp8 (`Float8CurrentScalingQuantizer::
create_tensor` in transformer_engine/pytorch/csrc/quantizer.cpp allocates a transpose only where
`nvte_is_non_tn_fp8_gemm_supported()` is false) is then written by one kernel, `cast_transpose`
(transformer_engine/common/cast/dispatch/quantize.cuh: a tensor with columnwise data), which
reads the bf16 tensor once and writes both fp8 copies: `HOPPER_TRANSPOSE_BYTES` more per element
than the cast. A tensor gathered in fp8 under sequence parallelism (a column-parallel linear's
input forward, a row-parallel linear's output gradient backward) is quantized on the rank's
sequence shard, rowwise only ("All-gather is not supported with FP8 column-wise data",
linear.py), and the gathered copy is transposed when wgrad needs it (`update_usage(
columnwise_usage=True)`): a read and a write of one byte per gathered element on Hopper. MXFP8's
second copy is [Note: MXFP8]'s. Megatron-Core runs q, k and v as one linear (linear_qkv) and a
gated MLP's gate and up projections as one (linear_fc1, 2 x ffn wide): one input, quantized once
(`KernelStack.fused_linears`). torchao's Float8Linear (torchtitan's wq, wk, wv and w1, w3) casts
each module's input itself ([Note: float8 recipes]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from overlap.step_model.hardware import HBM_SHARE, Accelerator

Fp8Recipe = Literal["tensorwise", "rowwise", "mxfp8", "current"]
FP8_RECIPES: tuple[Fp8Recipe, ...] = ("tensorwise", "rowwise", "mxfp8", "current")
ROWWISE_KERNEL_SHARE = 0.9
"""Rowwise-scaled fp8 GEMM rate / tensorwise ([Note: float8 recipes])."""
INPUT_CAST_BYTES = 3
"""HBM bytes per input element of a GEMM's fp8 cast (read bf16, write fp8) where the stack does
not say more (`KernelStack.fp8_casts`); outside Transformer Engine's recipes the backward pays it
twice, under them each output gradient pays it ([Note: Transformer Engine's casts])."""
MXFP8_BLOCK = 32
"""Elements sharing one E8M0 (1-byte) scale under MXFP8 ([Note: MXFP8])."""
MXFP8_EXTRA_BYTES = 1 + 2 / MXFP8_BLOCK
"""HBM bytes per element of a quantized activation that MXFP8 writes beyond a tensorwise cast:
its second (columnwise) fp8 copy and both copies' E8M0 scales ([Note: MXFP8])."""
CURRENT_AMAX_BYTES = 2
"""HBM bytes per element of current scaling's amax pass: one read of the bf16 tensor before its
cast ([Note: FP8 current scaling])."""
TE_RECIPES: tuple[Fp8Recipe, ...] = ("current", "mxfp8")
"""The recipes Transformer Engine runs, which quantize each operand once for both usages
([Note: Transformer Engine's casts])."""
HOPPER_TRANSPOSE_BYTES = 1
"""HBM bytes per element of the transposed fp8 copy that per-tensor fp8 writes on Hopper beside
the rowwise one ([Note: Transformer Engine's casts])."""


@dataclass(frozen=True, kw_only=True)
class Fp8Casts:
    """HBM bytes per element of the activation-sized casts around one tensorwise fp8 GEMM
    ([Note: float8 recipes]): its input (tokens x K) forward, its output gradient (tokens x N)
    and its input again backward."""

    forward_input: float
    backward_grad: float
    backward_input: float


# torchao's tensorwise Float8Linear ([Note: float8 recipes]): dynamic scaling takes the tensor's
# amax (one read) before the cast (read 2, write 1): 5 bytes for the input forward; backward the
# output gradient is scaled once and cast for both GEMMs, grad_input's row-major and grad_weight's
# transposed operand (2 + 3 + 3), and the input is cast again transposed for grad_weight at the
# scale it had forward (its amax kept; torchtitan's per-op checkpointing also saves max outputs): 3.
TORCHAO_TENSORWISE_CASTS = Fp8Casts(forward_input=5, backward_grad=8, backward_input=3)


def te_quantize_seconds(rows: float, width: int | float, gpu: Accelerator, recipe: Fp8Recipe, *,
                        amax_fused: bool = False, gathered_rows: float | None = None) -> float:  # fmt: skip
    """Seconds Transformer Engine takes to quantize a `rows` x `width` bf16 GEMM operand for both its
    usages ([Note: Transformer Engine's casts]): the cast (`INPUT_CAST_BYTES`); under current
    scaling the amax pass (unless the kernel that wrote the tensor took it) and, on Hopper, the
    transposed copy, written by the cast's kernel or, for a tensor then all-gathered in fp8 to
    `gathered_rows` rows, transposed after the gather; under MXFP8 the second copy and scales."""
    per_element = INPUT_CAST_BYTES + (MXFP8_EXTRA_BYTES if recipe == "mxfp8" else 0.0)
    per_element += CURRENT_AMAX_BYTES if recipe == "current" and not amax_fused else 0.0
    transpose = 0.0
    if recipe == "current" and gpu.generation != "blackwell":
        transpose = (gathered_rows * 2 if gathered_rows else rows) * width * HOPPER_TRANSPOSE_BYTES
    return (rows * width * per_element + transpose) / (gpu.hbm_tbps * 1e12 * HBM_SHARE)
