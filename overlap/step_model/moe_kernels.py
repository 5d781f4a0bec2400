"""GPU seconds a mixture-of-experts layer spends between its many small kernels: Megatron-Core's
kernel counts per part of the layer, at the idle time a GPU measurably leaves between two
kernels of a stream and of a CUDA graph.

[Note: small kernels' GPU floor]
Besides its grouped GEMMs a Megatron-Core MoE layer runs dozens of small kernels (the router's
softmax, top-k and auxiliary loss, the token counts, the permutations, the activation, the fp8
casts) whose bytes take a microsecond or less at HBM bandwidth. A GPU does not run them
back to back: between the end of one kernel and the start of the next it sits idle while the
next grid is launched and the last one drains. Hazy Research measured that idle time on an H100
with a dummy kernel that records its own start and end time ("Look Ma, No Bubbles! Designing a
Low-Latency Megakernel for Llama-1B", 2025-05-27,
https://hazyresearch.stanford.edu/blog/2025-05-27-no-bubbles): "running on a CUDA stream incurs
a launch cost of about 2.1 microseconds, and with CUDA graphs the launch cost only decreases to
around 1.3 microseconds - time spent with the GPU doing no useful work". A graph removes the
host's work, not this gap, so each kernel of a part costs its bytes plus `KERNEL_GAP_S` (2.1 us)
on a stream and `GRAPH_KERNEL_GAP_S` (1.3 us) inside a CUDA graph (`cuda_graph_scope`'s
"moe_router" and "moe_preprocess", forward and backward graphs alike). The grouped GEMMs' own
per-GEMM cost resolved from Transformer Engine's benchmark is of the same size (2.75 us,
`GROUPED_GEMM_TAIL_S`, [Note: grouped GEMMs at small M] in moe.py). No Blackwell measurement is
published; the gap is the launch and drain of a grid, not FLOPs or bandwidth, and Megatron-Core's
GB200 guide still gained from shortening it (programmatic dependent launch "for quantization
kernels", 762 -> 798 TFLOPS with the swizzle fusion, deepseek-v3-gb200-optimization.md section
3), so the H100 gaps are taken for every card.

Kernels counted per MoE layer forward (Megatron-Core with router and permute fusion, as the
recipes run it):
    router       31 ("reducing the total number of kernels in the router part from 72 to 31",
                 https://github.com/NVIDIA/Megatron-LM/blob/dev/docs/discussions/deepseek-v3-gb200-optimization/deepseek-v3-gb200-optimization.md
                 section 2.1.4); forced balancing adds the random logits' clone and normal_ (the
                 RNG tracker's state changes run on the host)
    preprocess   10, one device operation per operator of `HOST_OPS` (moe_host.py): the token
                 counts and the splits' sums, the EP group's all-gather, the device-to-host copies;
                 the flex dispatcher's fused preprocessing leaves "the router and preprocess parts
                 [at] 17" (ibid. section 2.2.1), split 12 and 5 as `FLEX_ROUTER_OPS`
    permute      4 before the token-count sync, which a dropless alltoall dispatcher takes
                 "before_ep_alltoall" (megatron/core/transformer/moe/token_dispatcher.py): TE's
                 fused permute runs `make_row_id_map`'s three Triton passes and the permute kernel
                 (transformer_engine/pytorch/triton/permutation.py,
                 https://github.com/NVIDIA/TransformerEngine/blob/0448187486cb56234d50b2a9cc7b6832eb0d2495/transformer_engine/pytorch/triton/permutation.py)
after the sync:
    chunk sort   `make_chunk_sort_map` and `sort_chunks_by_map` (ibid.), after the dispatch and
                 again before the combine, when EP > 1 and a rank holds several experts
    unpermute    1 (`unpermute_with_mask_map`, the weighted sum with the probabilities fused)
    activation   1 fused activation; GPT-OSS's clamp outside it 3 more (two clamps and the cat,
                 [Note: clamped expert activation] in moe.py)
    casts        under fp8 each local expert's fc1 and fc2 input cast, the launches the host
                 model counts per expert (moe_host.py)
Under the flex dispatcher the permute and unpermute run inside HybridEP's own kernels, fused
with its buffer copies (ibid. section 2.5), and none is counted (DeepEP's TE permute on the
receiving rank is left out too: the counts are a lower bound). Backward runs twice the forward's
count, as the host model assumes. Not counted here: the grouped GEMMs (`GROUPED_GEMM_TAIL_S`
holds their launch and tail), the all-to-alls (their latency is in `all_to_all_s` and
`flex_call_s`; the all-to-all is also the first kernel after the sync, the one that pays the
host's `LAUNCH_S`), and the attention and shared experts, priced as dense layers are (no gap is
priced for a dense layer's kernels either).
Nothing is counted twice with the host's pace ([Note: MoE host work] in moe_host.py): a layer
runs at max(host, GPU), the gaps add to the GPU's side only, and they are the GPU's idle time
when the host is ahead of it; when the host is behind, its own issue time paces the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from overlap.step_model.moe_shape import MoeShape

KERNEL_GAP_S = 2.1e-6
"""GPU idle seconds between two kernels queued on a stream (H100, [Note: small kernels' GPU floor])."""
GRAPH_KERNEL_GAP_S = 1.3e-6
"""GPU idle seconds between two kernels of a CUDA graph (H100, [Note: small kernels' GPU floor])."""
PRE_SYNC_KERNELS: dict[str, dict[str, int]] = {
    "alltoall": {"moe_router": 31, "moe_preprocess": 10, "permute": 4},
    "flex": {"moe_router": 12, "moe_preprocess": 5, "permute": 0},
}
"""Forward kernels before the token-count sync per dispatcher ([Note: small kernels' GPU floor])."""
FORCE_BALANCE_KERNELS = 2
"""The random logits' clone and normal_ ([Note: forced load balancing] in moe.py)."""
CHUNK_SORT_KERNELS = 2
"""One chunk sort by local expert: `make_chunk_sort_map` and `sort_chunks_by_map`."""
UNPERMUTE_KERNELS = 1
"""The unpermute with its weighted sum (`unpermute_with_mask_map`)."""
ACT_KERNELS = 1
"""The experts' fused activation."""
CLAMP_KERNELS = 3
"""GPT-OSS's two clamps and the cat outside the fused activation ([Note: clamped expert activation])."""
CASTS_PER_EXPERT = 2
"""fp8 input casts of one local expert's fc1 and fc2."""


@dataclass(frozen=True)
class MoeKernelGaps:
    """GPU idle seconds between the small kernels of one MoE layer's forward, by where they fall
    ([Note: small kernels' GPU floor]); backward is twice their sum."""

    pre_sync_s: float
    """Router, preprocessing and (alltoall) the permute, before the token-count sync."""
    dispatch_s: float
    """The chunk sorts and the unpermute after the sync."""
    experts_s: float
    """The experts' fp8 input casts."""
    act_s: float
    """The activation (and a clamp outside it)."""

    @property
    def forward_s(self) -> float:
        return self.pre_sync_s + self.dispatch_s + self.experts_s + self.act_s


def moe_kernel_gaps(moe: MoeShape, ep: int, fp8: bool, graphed: tuple[str, ...] = (), *,
                    dispatcher: str = "alltoall", force_balance: bool = False) -> MoeKernelGaps:  # fmt: skip
    """[Note: small kernels' GPU floor] for one MoE layer's forward on a rank of an `ep`-rank
    group: each counted kernel's gap, `GRAPH_KERNEL_GAP_S` inside a part `graphed` names and
    `KERNEL_GAP_S` elsewhere; `dispatcher` is Megatron-Core's moe_token_dispatcher_type and
    `force_balance` its moe_router_force_load_balancing."""
    flex = dispatcher == "flex"
    counts = dict(PRE_SYNC_KERNELS["flex" if flex else "alltoall"])
    counts["moe_router"] += FORCE_BALANCE_KERNELS if force_balance else 0
    pre = sum(n * (GRAPH_KERNEL_GAP_S if part in graphed else KERNEL_GAP_S) for part, n in counts.items())
    local = moe.num_experts // ep
    dispatch = 0 if flex else UNPERMUTE_KERNELS + (2 * CHUNK_SORT_KERNELS if ep > 1 and local > 1 else 0)
    act = ACT_KERNELS + (CLAMP_KERNELS if moe.activation_clamp else 0)
    casts = CASTS_PER_EXPERT * local if fp8 else 0
    return MoeKernelGaps(pre, dispatch * KERNEL_GAP_S, casts * KERNEL_GAP_S, act * KERNEL_GAP_S)


__all__ = ["GRAPH_KERNEL_GAP_S", "KERNEL_GAP_S", "PRE_SYNC_KERNELS", "MoeKernelGaps", "moe_kernel_gaps"]
