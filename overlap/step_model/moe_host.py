"""The host's pace of a mixture-of-experts layer: the CPU seconds its forward and backward take to
issue, split at the dispatcher's token-count sync, and the layer's forward with that sync
([Note: expert parallelism] in overlap/step_model/moe.py prices the GPU's side).

[Note: MoE host work]
A dropless MoE layer cannot run ahead of its host. Its expert GEMMs are sized by how many tokens
each expert got, and the sizes must reach the CPU: Megatron-Core's alltoall dispatcher copies the
token counts to the host and waits on them before the all-to-all ("A synchronization is needed
before expert parallel AlltoAll communication to get the `input_splits` and `output_splits` CPU
values", megatron/core/transformer/moe/token_dispatcher.py, `_maybe_dtoh_and_synchronize`), the
flex dispatcher's DeepEP dispatch blocks the CPU until the GPU signals the received counts ("the
CPU will wait for GPU's signal to arrive, so this is not compatible with CUDA graph",
moe/fused_a2a.py), and Transformer Engine's grouped GEMM takes the splits as host integers
(`tokens_per_expert.tolist()`, moe/experts.py). So once per MoE layer forward the GPU's queue
drains, and what follows runs no faster than the CPU issues it: the layer's forward takes
max(GPU seconds, host seconds). Backward has no such point (its splits are saved), so the CPU
runs ahead unless its work for the layer exceeds the GPU's; the same max is taken.
Host seconds per layer are counted per Python-level call, of two weights. A Transformer Engine
module (LayerNormLinear, DotProductAttention, Linear, RMSNorm, GroupedLinear) costs what TE's own
issue measured for one `te.Linear` forward (bf16, 8,192 tokens of hidden 2,048): 99.66 us of CPU on a
GB200 (Grace), against 37.08 us for `torch.nn.Linear` on the same host and 13.48 us for
`torch.nn.Linear` on an x86 DGX H100 (https://github.com/NVIDIA/TransformerEngine/issues/2053);
the x86 cost of a TE module is taken at the same Grace / x86 ratio (99.66 x 13.48 / 37.08 =
36.2 us), and under fp8 a TE module costs twice its bf16 cost ("scheduling a te.Linear layer in
FP8 takes more than 2x more time compared to scheduling the te.Linear layer in BF16",
https://github.com/NVIDIA/TransformerEngine/issues/761). Any other eager operator (rotary, the
fused bias-dropout-add, the router's fused top-k and auxiliary loss, the token counts, permute,
the all-to-all call) costs `torch.nn.Linear`'s CPU time on that host (`TORCH_OP_S`). Inside TE's
grouped GEMM each local expert's GEMM (and under fp8 each input's cast) is one more C++ launch:
4 to 6 us on x86 (susun-blog.com, "From Launch Overhead to CUDA Graph": `LAUNCH_S`), scaled by
the same Grace / x86 ratio on a GB200. GB200 is the one preset whose host is a Grace CPU (the
GB200 superchip pairs two B200 with one Grace); the DGX nodes are x86. Counts follow
Megatron-Core's MoE layer with router and permute fusion (the recipes set both): `HOST_OPS` per
part, backward twice the forward's. A part inside a CUDA graph (`cuda_graph_scope`: Transformer
Engine's graphs of "attn", "moe_router", "moe_preprocess", the scopes the Megatron-Bridge recipes
name) is one launch. The Megatron-Core MoE guide lists the remedy for this bottleneck ("gaps
between GPU kernels where CPU cannot launch kernels fast enough": CUDA graphs, "increase
micro-batch size"): the host work is per micro-batch, so it shows at small micro-batches and
many local experts.

[Note: the dispatcher's sync]
The host wait of [Note: MoE host work] sits in the middle of the layer: the host issues the
attention, the router and the preprocessing (H1), waits until the GPU has run them (G1) and the
token counts have come back, then issues the dispatch, the experts, the combine and what follows
(H2) while the GPU runs them (G2, and the all-to-alls A). Until the host reaches the sync again,
its queue holds nothing the GPU could run ahead: after the sync the GPU runs no faster than the
host issues, and the host cannot issue past the next sync before the GPU gets there. So a layer's
forward takes max(H1 + H2, G1 + launch + max(G2 + A, H2)) with its all-to-alls, where the launch
is the first kernel after the sync reaching an idle GPU (`LAUNCH_S`): no longer max(G1 + G2 + A,
H1 + H2), since the GPU cannot use the host's lead over the pre-sync part to cover the post-sync
part's issue. A layer with few tokens per expert and many local experts (a long H2 of per-expert
launches beside a short G2) pays the difference; a capacity factor (experts padded to a size
known in advance) needs no sync and keeps the plain max.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from overlap.step_model.moe_shape import MoeShape

HostCpu = Literal["x86", "grace"]
GRACE_HOSTED = ("gb200",)
"""Accelerator presets whose host CPU is a Grace ([Note: MoE host work])."""
FORCE_BALANCE_OPS = 6
"""Eager operators of the random logits on the host: clone, normal_ and the RNG tracker fork's two
gets and two sets of the CUDA generator's state ([Note: forced load balancing] in moe.py)."""
TORCH_OP_S: dict[HostCpu, float] = {"x86": 13.48e-6, "grace": 37.08e-6}
"""CPU seconds of one eager PyTorch operator: `torch.nn.Linear`'s forward ([Note: MoE host work])."""
TE_MODULE_S: dict[HostCpu, float] = {"x86": 99.66e-6 * 13.48 / 37.08, "grace": 99.66e-6}
"""CPU seconds of one Transformer Engine module's bf16 forward ([Note: MoE host work])."""
TE_FP8_FACTOR = 2.0
"""A TE module's CPU cost under fp8 over bf16 ([Note: MoE host work])."""
LAUNCH_S: dict[HostCpu, float] = {"x86": 5e-6, "grace": 5e-6 * 37.08 / 13.48}
"""CPU seconds of one kernel launch from C++ ([Note: MoE host work])."""
HOST_OPS: dict[str, tuple[int, int]] = {
    "attn": (4, 8),
    "moe_router": (0, 31),
    "moe_preprocess": (0, 10),
    "dispatch": (0, 8),
    "experts": (2, 1),
}
"""(Transformer Engine modules, other eager operators) of one MoE layer's forward ([Note: MoE
host work]), Megatron-Core with router and permute fusion: attention (TE LayerNormLinear for
QKV, DotProductAttention, the output Linear, the pre-MLP RMSNorm; rotary, bias-dropout-add and
the glue between), router (gate GEMM, fused top-k scores, auxiliary loss and its scaling),
preprocessing (token counts, the splits of the EP group: their gather, slices and sums, the
device-to-host copies), dispatch and combine (permute, all-to-all, chunk sort, each way) and the
experts (TE GroupedLinear fc1 and fc2; the activation). The router's count is Megatron-Core's
own: router fusion "reducing the total number of kernels in the router part from 72 to 31"; the
flex dispatcher's fused preprocessing brings "the router and preprocess parts to 17"
(deepseek-v3-gb200-optimization.md, sections 2.1.4 and 2.2.1; `FLEX_ROUTER_OPS`, the two parts
are graphed together or not at all). Shared experts add two TE Linears and their activation,
inside the router's graph when it has one ("`moe_router`: capture the moe router part. Also
capture shared experts unless the shared experts overlap is enabled", ibid. section 2.3)."""
FLEX_ROUTER_OPS = {"moe_router": (0, 12), "moe_preprocess": (0, 5)}
SHARED_OPS = (2, 1)


def host_cpu(gpu: str) -> HostCpu:
    """The CPU that issues the kernels of accelerator preset `gpu` ([Note: MoE host work])."""
    return "grace" if gpu in GRACE_HOSTED else "x86"


def moe_host_split(moe: MoeShape, ep: int, fp8: bool, graphed: tuple[str, ...] = (), *, host: HostCpu = "x86",
                   dispatcher: str = "alltoall", force_balance: bool = False) -> tuple[float, float]:  # fmt: skip
    """(before the token-count sync, after it) CPU seconds of one MoE layer's forward ([Note: MoE
    host work]): its TE modules and other eager operators outside CUDA graphs, a graphed part as
    one launch, and the grouped GEMMs' launches per local expert (fc1 and fc2; with fp8 each
    input's cast too). Before the sync: the attention, router and preprocessing (and the shared
    experts inside the router's graph); after it: the dispatch, the experts, the combine and
    ungraphed shared experts ([Note: the dispatcher's sync]); `force_balance` adds the random
    logits' operators to the router's part ([Note: forced load balancing] in moe.py)."""
    module_s = TE_MODULE_S[host] * (TE_FP8_FACTOR if fp8 else 1.0)
    parts = dict(HOST_OPS, **FLEX_ROUTER_OPS) if dispatcher == "flex" else dict(HOST_OPS)
    if force_balance:
        modules, ops = parts["moe_router"]
        parts["moe_router"] = (modules, ops + FORCE_BALANCE_OPS)
    if moe.shared_ffn_hidden and "moe_router" not in graphed:
        parts["shared"] = SHARED_OPS
    pre = post = 0.0
    for part, (modules, ops) in parts.items():
        seconds = LAUNCH_S[host] if part in graphed else modules * module_s + ops * TORCH_OP_S[host]
        if part in PRE_SYNC_PARTS:
            pre += seconds
        else:
            post += seconds
    per_expert = 4 if fp8 else 2
    return pre, post + moe.num_experts // ep * per_expert * LAUNCH_S[host]


def moe_host_seconds(moe: MoeShape, ep: int, fp8: bool, graphed: tuple[str, ...] = (), *, host: HostCpu = "x86",
                     dispatcher: str = "alltoall", force_balance: bool = False) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) CPU seconds of one MoE layer ([Note: MoE host work]): `moe_host_split`'s
    two parts, backward twice the forward."""
    forward = sum(moe_host_split(moe, ep, fp8, graphed, host=host, dispatcher=dispatcher, force_balance=force_balance))
    return forward, 2 * forward


PRE_SYNC_PARTS = ("attn", "moe_router", "moe_preprocess")
"""Parts of a MoE layer's forward the host issues before its token-count sync."""


def synced_forward_s(gpu_pre_s: float, gpu_post_s: float, host_pre_s: float, host_post_s: float,
                     a2a_s: float, host: HostCpu) -> float:  # fmt: skip
    """Seconds of one dropless MoE layer's forward on the compute stream, its exposed dispatch
    and combine (`a2a_s`) excluded ([Note: the dispatcher's sync]): the host issuing the whole
    layer, or the GPU's work before the sync, one launch, then its work after the sync or the
    host issuing it, whichever is longer."""
    host_bound = host_pre_s + host_post_s - a2a_s
    gpu_bound = gpu_pre_s + LAUNCH_S[host] + max(gpu_post_s, host_post_s - a2a_s)
    return max(host_bound, gpu_bound)


__all__ = [
    "FORCE_BALANCE_OPS",
    "GRACE_HOSTED",
    "HOST_OPS",
    "LAUNCH_S",
    "PRE_SYNC_PARTS",
    "TE_MODULE_S",
    "TORCH_OP_S",
    "HostCpu",
    "host_cpu",
    "moe_host_seconds",
    "moe_host_split",
    "synced_forward_s",
]
