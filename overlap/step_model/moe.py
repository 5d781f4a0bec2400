"""Seconds of a mixture-of-experts layer on one rank of an expert-parallel group: the router, the
token dispatch and combine all-to-alls, the grouped expert GEMMs and the shared experts.

[Note: expert parallelism]
A MoE layer replaces the dense MLP with E experts (SwiGLU of width f_e each) of which a router
picks the top k per token, plus optional shared experts every token passes through (DeepSeek-V3,
Llama 4). Under expert parallelism EP the experts are split E/EP per rank; one MoE layer on a rank
holding t tokens (its sequence-parallel shard when the attention is tensor parallel and the
experts are not, Megatron-Core's expert_tensor_parallel_size 1) costs, forward:
    router       a t x h x E GEMM, its softmax / top-k and the permutation that groups the
                 t·k token copies by expert (read and write of t·k·h activations, twice: permute
                 before the experts, unpermute and weighted sum after)
    dispatch     all-to-all of t·k·h activations (bf16) over the EP group: (EP-1)/EP of them
                 leave the rank; the peers inside its NVLink domain are reached over NVLink, the
                 others over the GPU's own rail adapter, both at once ([Note: rails] in
                 hardware.py); `all_to_all_s`
    experts      three grouped GEMMs (gate, up, down) over the E/EP local experts with
                 M = t·k·EP/E rows each when routing is balanced; `expert_gemm_seconds`
    combine      the dispatch's all-to-all in reverse
    shared       a dense SwiGLU of the shared experts' width over all t tokens
Backward is twice the GEMMs and the permutations, and both all-to-alls again. Balanced routing
is what the published benchmarks run (Megatron-Bridge: "we force-balance the token distribution
among experts and all benchmarks are token-dropless"); no load imbalance is priced, since no
source publishes the skew of the runs it measured. A capacity factor (token dropping with padding
to capacity) multiplies the expert rows and the dispatched tokens.

[Note: grouped GEMMs at small M]
An expert's GEMM has few rows: Qwen3-30B-A3B at 4,096 tokens, top 8 of 128 experts and EP 8 gives
M = 2,048 per expert; DeepSeek-V3 at EP 64, micro-batch 1 of 4,096 tokens, M = 8,192 (but 256
experts, top 8). Two facts set the rate. Each group's rows fill whole output tiles: grouped GEMM
kernels (CUTLASS grouped GEMM, cuBLASLt grouped / Transformer Engine's) tile each problem of the
group separately with 128-row tiles, so M is paid as ceil(M/128)·128. And an expert's weights
must be read once per GEMM: below the roofline's ridge point (datasheet FLOPS / HBM bandwidth,
~295 FLOP/byte on an H100 SXM) the GEMM streams K·N weights plus M·(K+N) activations at HBM
bandwidth instead of computing at the tensor-core rate; the larger of the two times is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from overlap.step_model.cost import Link
from overlap.step_model.hardware import HBM_SHARE, Accelerator
from overlap.step_model.kernels import ACT_BYTES, TILE, Fp8Recipe, gemm_backward_seconds, gemm_seconds


@dataclass(frozen=True, kw_only=True)
class MoeShape:
    """A model's mixture-of-experts layers, as its configuration declares them."""

    num_experts: int
    """Routed experts per MoE layer (n_routed_experts, num_experts, num_local_experts)."""
    top_k: int
    """Experts each token is routed to (num_experts_per_tok)."""
    expert_ffn_hidden: int
    """Width of one routed expert's SwiGLU (moe_intermediate_size)."""
    shared_ffn_hidden: int = 0
    """Total width of the shared experts every token passes (n_shared_experts x their width)."""
    dense_layers: int = 0
    """Leading layers with the dense MLP (first_k_dense_replace) instead of experts."""
    every: int = 1
    """A MoE layer every this many layers after the dense ones (Llama 4's interleave step)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_ffn_hidden", "every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoeShape.{name} must be an int >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoeShape: top_k {self.top_k} > num_experts {self.num_experts}")
        if self.shared_ffn_hidden < 0 or self.dense_layers < 0:
            raise ValueError("MoeShape: shared_ffn_hidden and dense_layers must be >= 0")

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.dense_layers and (index - self.dense_layers) % self.every == self.every - 1

    def num_moe_layers(self, num_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(num_layers))

    def expert_numel(self, hidden: int) -> int:
        """Parameters of one routed expert (gate, up, down)."""
        return 3 * hidden * self.expert_ffn_hidden

    def dense_numel(self, hidden: int) -> int:
        """Parameters of a MoE layer outside its routed experts: the router and shared experts."""
        return hidden * self.num_experts + 3 * hidden * self.shared_ffn_hidden


@dataclass(frozen=True)
class MoeSeconds:
    """One MoE layer's MLP on one rank for one micro-batch (the attention is priced apart)."""

    forward_s: float
    backward_s: float
    expert_forward_s: float
    router_forward_s: float
    dispatch_bytes: float
    """Bytes one rank sends into one all-to-all (dispatch or combine), its own share included."""


def expert_gemm_seconds(
    m: float, k: int, n: int, gpu: Accelerator, fp8: bool, recipe: Fp8Recipe = "tensorwise"
) -> float:
    """One expert's forward GEMM of `m` rows through a K x N weight ([Note: grouped GEMMs at
    small M]): M padded to whole tiles, and no faster than streaming its operands from HBM."""
    if m <= 0:
        return 0.0
    padded = math.ceil(m / TILE) * TILE
    compute = gemm_seconds(padded, k, n, gpu, fp8, recipe)
    weight_bytes = 1 if fp8 and gpu.fp8_tflops else ACT_BYTES
    stream = (k * n * weight_bytes + m * (k + n) * ACT_BYTES) / (gpu.hbm_tbps * 1e12 * HBM_SHARE)
    return max(compute, stream)


def expert_rows(tokens: float, moe: MoeShape, ep: int, capacity_factor: float | None) -> float:
    """Rows of each local expert's GEMMs ([Note: expert parallelism]): the EP group's t·k token
    copies spread evenly over the E experts, times the capacity factor when padded to it."""
    rows = tokens * moe.top_k * ep / moe.num_experts
    return rows * (capacity_factor or 1.0)


def moe_seconds(
    moe: MoeShape,
    hidden: int,
    tokens: float,
    gpu: Accelerator,
    *,
    ep: int = 1,
    tp: int = 1,
    etp: int = 1,
    shared_tokens: float | None = None,
    fp8: bool = False,
    fp8_recipe: Fp8Recipe = "tensorwise",
    capacity_factor: float | None = None,
) -> MoeSeconds:
    """[Note: expert parallelism] for `tokens` tokens routed from this rank; the routed experts
    split over `etp`, the shared experts over `tp` like a dense MLP, run on `shared_tokens`
    (default `tokens`)."""
    if moe.num_experts % ep:
        raise ValueError(f"{moe.num_experts} experts do not split over expert parallel {ep}")
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    router = gemm_seconds(tokens, hidden, moe.num_experts, gpu, fp8=False)
    copies = tokens * moe.top_k * (capacity_factor or 1.0)
    # softmax / top-k over E logits (fp32, read and write) and the permute + unpermute copies
    router += tokens * moe.num_experts * 4 * 2 / hbm + 2 * copies * hidden * ACT_BYTES * 2 / hbm
    rows, f = expert_rows(tokens, moe, ep, capacity_factor), moe.expert_ffn_hidden // etp
    shapes = [(hidden, f), (hidden, f), (f, hidden)]  # gate and up split N, down splits K over ETP
    local = moe.num_experts // ep
    experts = local * sum(expert_gemm_seconds(rows, k, n, gpu, fp8, fp8_recipe) for k, n in shapes)
    # the SwiGLU activation between them: read 2, write 1 of rows x f per expert
    act = local * rows * f * 3 * ACT_BYTES / hbm
    shared = shared_bwd = 0.0
    if moe.shared_ffn_hidden:
        s, t = moe.shared_ffn_hidden // tp, tokens if shared_tokens is None else shared_tokens
        parts = [(hidden, s), (hidden, s), (s, hidden)]
        shared = sum(gemm_seconds(t, k, n, gpu, fp8, fp8_recipe) for k, n in parts)
        shared_bwd = sum(gemm_backward_seconds(t, k, n, gpu, fp8, fp8_recipe) for k, n in parts)
    forward = router + experts + act + shared
    backward = 2 * (router + experts + act) + shared_bwd
    return MoeSeconds(forward, backward, experts, router, copies * hidden * ACT_BYTES)


def all_to_all_s(num_bytes: float, ep: int, ranks_per_domain: int, nvlink: Link, rail: Link) -> float:
    """One all-to-all in which every rank of an `ep`-rank group holds `num_bytes` and sends an
    equal share to every rank ([Note: expert parallelism]): the `ranks_per_domain` - 1 peers in
    its NVLink domain over NVLink, the rest over its rail at the same time."""
    if ep == 1:
        return 0.0
    local = max(1, min(ep, ranks_per_domain))
    share = num_bytes / ep
    intra = (local - 1) * share
    inter = (ep - local) * share
    if inter == 0:
        return nvlink.alpha_s + nvlink.seconds(intra)
    return rail.alpha_s + max(nvlink.seconds(intra), rail.seconds(inter))


__all__ = ["MoeSeconds", "MoeShape", "all_to_all_s", "expert_gemm_seconds", "expert_rows", "moe_seconds"]
