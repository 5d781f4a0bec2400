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
                 before the experts, unpermute and weighted sum after); the alltoall dispatcher
                 sorts the received chunks by local expert after the dispatch and back before the
                 combine ("Permutation 2: Sort tokens by local expert", `sort_chunks_by_idxs`
                 when num_local_experts > 1, megatron/core/transformer/moe/token_dispatcher.py):
                 two more read-and-write passes over the t·k·h copies under expert parallelism
                 (without it the permute already leaves one chunk per expert); the flex
                 dispatcher's receiving rank permutes what it received straight into expert
                 order (none)
    dispatch     all-to-all of t·k·h activations (bf16) over the EP group: (EP-1)/EP of them
                 leave the rank; the peers inside its NVLink domain are reached over NVLink, the
                 others over the GPU's own rail adapter, both at once ([Note: rails] in
                 hardware.py); `all_to_all_s`
    experts      two grouped GEMMs (fc1: gate and up fused, N = 2·f_e; fc2) over the E/EP local
                 experts with M = t·k·EP/E rows each when routing is balanced;
                 `expert_gemm_seconds` ([Note: grouped GEMMs at small M])
    combine      the dispatch's all-to-all in reverse
    shared       a dense SwiGLU of the shared experts' width over all t tokens
Backward is twice the GEMMs and the permutations, and both all-to-alls again. Balanced routing
is what the published benchmarks run (Megatron-Bridge: "we force-balance the token distribution
among experts and all benchmarks are token-dropless"); a learned router's imbalance is not
priced, since no source publishes the skew of the runs it measured, and the random router of
forced balancing is priced at its busiest rank ([Note: forced-balance skew] in moe_skew.py). A
capacity factor (token dropping with padding to capacity) multiplies the expert rows and the
dispatched tokens.

[Note: grouped GEMMs at small M]
An expert's GEMM has few rows: Qwen3-30B-A3B at 4,096 tokens, top 8 of 128 experts and EP 8 gives
M = 2,048 per expert; DeepSeek-V3 at EP 64, micro-batch 1 of 4,096 tokens, M = 8,192 (but 256
experts, top 8). Megatron-Core's grouped MLP runs two grouped GEMMs per expert forward (fc1, gate
and up fused into one N = 2·f_e weight; fc2) and four backward (data and weight gradient of
each); Transformer Engine's grouped GEMM issues them as one cuBLAS GEMM per expert on several
streams (https://github.com/NVIDIA/TransformerEngine/pull/853, "Grouped GEMM via multi-stream
cuBLAS"). Its benchmark at Qwen3-30B-A3B's shapes on an H100, bf16, TE 2.7
(https://github.com/NVIDIA/TransformerEngine/pull/2045: (g, m, n, k) = (8, 4096, 768, 2048)
627.9 TFLOPS, (16, 2048, 768, 2048) 553.9 TFLOPS; the same FLOPs in twice the GEMMs take 22 us
more) resolves into a rate and a cost per GEMM: 103 GFLOP in 8 GEMMs take 164 us, in 16 GEMMs
186 us, so each GEMM of the group pays `GROUPED_GEMM_TAIL_S` = 2.75 us (its launch on its
stream and its last partial wave) and the FLOPs run at 725 TFLOPS, the large-GEMM share of the
peak (`gemm_share`, 0.72 of 989 TFLOPS: 713) with no further loss to the 768-wide N. So one
expert's GEMM costs its FLOPs at the peak x `gemm_share` (fp8: x `fp8_gemm_share`) plus the
tail; the tail does not shrink on a faster GPU, so Blackwell's small experts lose relatively
more. On Blackwell the fp8 experts run MXFP8 (the Megatron-Bridge recipes' FP8-MX), whose grouped
GEMM Megatron-Core's GB200 guide measures at "2,672 TFLOP/s (flush L2) on the shape K=7,168,
N=2,048" with its multi-stream cuBLAS implementation
(https://github.com/NVIDIA/Megatron-LM/blob/dev/docs/discussions/deepseek-v3-gb200-optimization/deepseek-v3-gb200-optimization.md,
section 1, item 3): 0.534 of the 5,000 TFLOPS fp8 peak where the dense MAMF share is 0.72, taken
for every Blackwell card's fp8 expert GEMMs (`BLACKWELL_FP8_GROUPED_SHARE`). Each group's rows
still fill whole 128-row tiles (M paid as ceil(M/128)·128), an fp8 GEMM first casts its input
(read 2, write 1 byte per element), and an expert's weights must be read once per GEMM: below
the roofline's ridge point the GEMM streams K·N weights plus M·(K+N) activations at HBM
bandwidth; the larger of the FLOP and the stream time is taken.

[Note: clamped expert activation]
GPT-OSS clamps the GLU's inputs (gate at most 7, linear part within +-7) before its activation.
Megatron-Core's fused weighted quick-GeGLU (`weighted_bias_quick_geglu_impl`,
https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/fusions/fused_bias_geglu.py) does
the clamp outside the fused function, eagerly: `input.chunk(2, -1)`, a clamp of each half (read
and write rows x f each) and `torch.cat` of the two (read and write rows x 2f): 8 passes over
rows x f forward, where the fused activation itself makes 3. Backward, autograd runs the clamps'
masked gradients (read the gradient and the input, write: 3 passes of each half) and the chunk's
concatenation of the two halves' gradients (4): 10 passes. A recomputed activation (moe_act)
repeats the forward's.

[Note: forced load balancing]
The published Megatron-Bridge MoE runs route at random: every performance recipe sets
`moe_router_force_load_balancing` (scripts/performance/configs/*/…_llm_pretrain.py, e.g.
https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/v0.4.2/scripts/performance/configs/gpt_oss/gpt_oss_llm_pretrain.py),
under which Megatron-Core's router replaces the gate's logits by `RandomSTE.apply(logits)`
(megatron/core/transformer/moe/router.py, moe_utils.py,
https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/megatron/core/transformer/moe/moe_utils.py):
inside `get_cuda_rng_tracker().fork(...)` it runs `logits.clone().normal_()`. On the GPU that is
a read and a write of the t x E logits and one more write (`FORCE_BALANCE_PASSES`, fp32 as the
router's other logit passes); on the host two eager operators and the tracker's fork, which
gets and sets the CUDA generator's state on entry and again on exit (tensor_parallel/random.py
`fork`): `FORCE_BALANCE_OPS` = 6 eager operators in the router's part (one launch when the
router is a CUDA graph; [Note: MoE host work] in moe_host.py). The fork's checks of the CPU
generator's state touch no device and are not counted. The routing it produces is balanced only
in expectation: the busiest rank of the EP group receives about one percent more than its share,
and the layer runs at its rows ([Note: forced-balance skew] in moe_skew.py).

[Note: flex dispatch]
Megatron-Core's alltoall dispatcher sends one copy of a token per routed expert (t·k rows,
permuted by expert). Its flex dispatcher (`moe_token_dispatcher_type: flex`, backends DeepEP and
HybridEP) sends a token once per destination rank, and across nodes once per destination node,
forwarded to that node's ranks over NVLink (DeepSeek-V3 technical report, Section 3.2.2: over
InfiniBand to the GPU of the same in-node index on each target node, then over NVLink to the
GPUs holding its experts). With balanced routing, a token's k experts drawn from
E, a destination holding E/D of them is hit with probability 1 - C(E - E/D, k) / C(E, k).
DeepSeek-V3 limits each token to `group_topk` of `groups` expert groups (config.json `topk_group`
4 of `n_group` 8; the report's node limit of 4 per token); where the nodes hold whole
groups a node is hit with probability 1 - C(G - G/N, g) / C(G, g). These counts are priced at the
bandwidths the flex kernels' authors publish ([Note: flex kernels' achieved bandwidth] in
moe_flex.py), not at the links' line rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from overlap.step_model.cost import Link
from overlap.step_model.fp8 import ROWWISE_KERNEL_SHARE, TE_RECIPES, Fp8Recipe, te_quantize_seconds
from overlap.step_model.hardware import HBM_SHARE, Accelerator
from overlap.step_model.kernels import ACT_BYTES, TILE, gemm_backward_seconds, gemm_seconds
from overlap.step_model.moe_host import (
    FORCE_BALANCE_OPS,
    HOST_OPS,
    LAUNCH_S,
    TE_MODULE_S,
    TORCH_OP_S,
    host_cpu,
    moe_host_seconds,
    moe_host_split,
    synced_forward_s,
)
from overlap.step_model.moe_shape import MoeShape
from overlap.step_model.moe_skew import routing_skew

GROUPED_GEMM_TAIL_S = 2.75e-6
"""Seconds each GEMM of a grouped GEMM pays beyond its FLOPs ([Note: grouped GEMMs at small M])."""
BLACKWELL_FP8_GROUPED_SHARE = 2672.0 / 5000.0
"""Share of the fp8 peak Blackwell's MXFP8 grouped GEMM sustains ([Note: grouped GEMMs at small M])."""


@dataclass(frozen=True)
class MoeSeconds:
    """One MoE layer's MLP on one rank for one micro-batch (the attention is priced apart)."""

    forward_s: float
    backward_s: float
    expert_forward_s: float
    router_forward_s: float
    dispatch_bytes: float
    """Bytes one rank sends into one all-to-all (dispatch or combine), its own share included; under
    forced balancing what the busiest rank receives ([Note: forced-balance skew] in moe_skew.py)."""
    act_forward_s: float = 0.0
    """The experts' SwiGLU activation (what Megatron-Core's `moe_act` recompute repeats)."""
    shared_forward_s: float = 0.0
    dispatch_forward_s: float = 0.0
    """Dispatcher work after the token-count sync that `forward_s` holds apart from the experts: the
    gaps between its kernels ([Note: small kernels' GPU floor] in moe_kernels.py)."""


def expert_gemm_seconds(
    m: float, k: int, n: int, gpu: Accelerator, fp8: bool, recipe: Fp8Recipe = "tensorwise", *, cast: bool = True
) -> float:
    """One expert's forward GEMM of `m` rows through a K x N weight inside a grouped GEMM ([Note:
    grouped GEMMs at small M]): M padded to whole tiles at the large-GEMM rate, no faster than
    streaming its operands from HBM, plus the group's per-GEMM tail and, with `cast`, an fp8
    input's quantization (under Transformer Engine's recipes as a dense linear's,
    `te_quantize_seconds`: TE's grouped linear quantizes each expert's input with the same
    quantizer)."""
    if m <= 0:
        return 0.0
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    padded = math.ceil(m / TILE) * TILE
    if fp8 and gpu.fp8_tflops:
        share = BLACKWELL_FP8_GROUPED_SHARE if gpu.generation == "blackwell" else gpu.fp8_gemm_share
        rate = gpu.fp8_tflops * share * (ROWWISE_KERNEL_SHARE if recipe == "rowwise" else 1.0)
        quantize = te_quantize_seconds(m, k, gpu, recipe) if recipe in TE_RECIPES else m * k * 3 / hbm
        weight_bytes, input_cast = 1, quantize if cast else 0.0
    else:
        rate, weight_bytes, input_cast = gpu.bf16_tflops * gpu.gemm_share, ACT_BYTES, 0.0
    compute = 2.0 * padded * k * n / (rate * 1e12)
    stream = (k * n * weight_bytes + m * (k + n) * ACT_BYTES) / hbm
    return max(compute, stream) + input_cast + GROUPED_GEMM_TAIL_S


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
    dispatcher: str = "alltoall",
    force_balance: bool = False,
) -> MoeSeconds:
    """[Note: expert parallelism] for `tokens` tokens routed from this rank; the routed experts
    split over `etp`, the shared experts over `tp` like a dense MLP, run on `shared_tokens`
    (default `tokens`); `dispatcher` is Megatron-Core's moe_token_dispatcher_type;
    `force_balance` its moe_router_force_load_balancing ([Note: forced load balancing])."""
    if moe.num_experts % ep:
        raise ValueError(f"{moe.num_experts} experts do not split over expert parallel {ep}")
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    router = gemm_seconds(tokens, hidden, moe.num_experts, gpu, fp8=False)
    copies = tokens * moe.top_k * (capacity_factor or 1.0)
    local = moe.num_experts // ep
    # softmax / top-k over E logits (fp32, read and write) and the permute + unpermute copies;
    # the alltoall dispatcher's chunk sorts by local expert, there and back
    permutations = 2 + (2 if dispatcher == "alltoall" and ep > 1 and local > 1 else 0)
    logit_passes = 2 + (FORCE_BALANCE_PASSES if force_balance else 0)
    router += tokens * moe.num_experts * 4 * logit_passes / hbm + permutations * copies * hidden * ACT_BYTES * 2 / hbm
    rows, f = expert_rows(tokens, moe, ep, capacity_factor), moe.expert_ffn_hidden // etp
    shapes = [(hidden, 2 * f), (f, hidden)]  # fc1 (gate and up) splits N, fc2 splits K over ETP
    experts = local * sum(expert_gemm_seconds(rows, k, n, gpu, fp8, fp8_recipe) for k, n in shapes)
    # backward: twice the forward's GEMMs and casts; under Transformer Engine's recipes twice the
    # GEMMs and each output gradient quantized for both usages, the inputs' columnwise copies
    # made forward ([Note: Transformer Engine's casts] in fp8.py)
    experts_backward = 2 * experts
    if fp8 and gpu.fp8_tflops and fp8_recipe in TE_RECIPES:
        gemms = sum(expert_gemm_seconds(rows, k, n, gpu, fp8, fp8_recipe, cast=False) for k, n in shapes)
        experts_backward = local * (2 * gemms + sum(te_quantize_seconds(rows, n, gpu, fp8_recipe) for _, n in shapes))
    # the SwiGLU activation between them: read 2, write 1 of rows x f per expert
    act = act_backward = local * rows * f * 3 * ACT_BYTES / hbm
    act_backward *= 2
    if moe.activation_clamp:  # [Note: clamped expert activation]
        act += local * rows * f * CLAMP_PASSES[0] * ACT_BYTES / hbm
        act_backward += local * rows * f * CLAMP_PASSES[1] * ACT_BYTES / hbm
    # random routing: the busiest rank's experts pace the layer, its copies the all-to-alls ([Note:
    # forced-balance skew]); the balanced rows keep their tiles
    skew = routing_skew(moe, ep, tokens, force_balance=force_balance, capacity_factor=capacity_factor)
    experts, experts_backward, act, act_backward = (skew * x for x in (experts, experts_backward, act, act_backward))
    shared = shared_bwd = 0.0
    if moe.shared_ffn_hidden:
        s, t = moe.shared_ffn_hidden // tp, tokens if shared_tokens is None else shared_tokens
        parts = [(hidden, 2 * s), (s, hidden)]  # Megatron-Core's linear_fc1 (gate and up) and linear_fc2
        shared = sum(gemm_seconds(t, k, n, gpu, fp8, fp8_recipe) for k, n in parts)
        shared_bwd = sum(gemm_backward_seconds(t, k, n, gpu, fp8, fp8_recipe) for k, n in parts)
    forward = router + experts + act + shared
    backward = 2 * router + experts_backward + act_backward + shared_bwd
    return MoeSeconds(forward, backward, experts, router, copies * skew * hidden * ACT_BYTES, act, shared)


FORCE_BALANCE_PASSES = 3
"""Passes over the t x E fp32 logits of the random logits' clone and normal_ ([Note: forced load
balancing])."""
CLAMP_PASSES = (8, 10)
"""(forward, backward) passes over rows x f of the clamp outside the fused activation ([Note:
clamped expert activation])."""


def hit_share(items: int, bins: int, picks: int) -> float:
    """Probability that `picks` of `items` drawn without replacement hit a given one of `bins`
    equal bins ([Note: flex dispatch])."""
    if bins <= 1:
        return 1.0
    return 1.0 - math.comb(items - items // bins, picks) / math.comb(items, picks)


def flex_copies(moe: MoeShape, ep: int, ranks_per_domain: int) -> tuple[float, float]:
    """(copies to other ranks of the NVLink domain, copies to other domains) that one token sends
    under the flex dispatcher ([Note: flex dispatch]): once per destination rank, across domains
    once per destination domain; balanced routing, group-limited where the domains hold whole
    expert groups."""
    local = max(1, min(ep, ranks_per_domain))
    domains = ep // local
    ranks_hit = ep * hit_share(moe.num_experts, ep, moe.top_k)
    if domains == 1:
        return ranks_hit * (ep - 1) / ep, 0.0
    if moe.groups > 1 and moe.groups % domains == 0:
        domain_share = hit_share(moe.groups, domains, moe.group_topk)
    else:
        domain_share = hit_share(moe.num_experts, domains, moe.top_k)
    remote = (domains - 1) * domain_share
    # the other ranks hit are reached over NVLink: in its own domain directly, in a remote one
    # from the rank the rail delivered to
    return max(0.0, ranks_hit * (ep - 1) / ep - remote), remote


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


__all__ = [
    "BLACKWELL_FP8_GROUPED_SHARE",
    "FORCE_BALANCE_OPS",
    "FORCE_BALANCE_PASSES",
    "GROUPED_GEMM_TAIL_S",
    "HOST_OPS",
    "LAUNCH_S",
    "TE_MODULE_S",
    "TORCH_OP_S",
    "MoeSeconds",
    "MoeShape",
    "all_to_all_s",
    "expert_gemm_seconds",
    "expert_rows",
    "flex_copies",
    "hit_share",
    "host_cpu",
    "moe_host_seconds",
    "moe_host_split",
    "moe_seconds",
    "synced_forward_s",
]
