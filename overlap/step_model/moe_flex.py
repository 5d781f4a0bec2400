"""Seconds of the flex dispatcher's dispatch and combine at the bandwidths their kernels' authors
publish, per backend (HybridEP, DeepEP), instead of a link's line rate.

[Note: flex kernels' achieved bandwidth]
Megatron-Core's flex dispatcher (`moe_token_dispatcher_type: flex`) runs one of two kernel
libraries (`moe_flex_dispatcher_backend`): DeepEP or NVIDIA's HybridEP (the `hybrid-ep` branch of
deepseek-ai/DeepEP). Both publish what their dispatch and combine achieve, end to end through the
PyTorch call (metadata, copies and flag updates included), and those figures price a flex
all-to-all here; the link model ([Note: flex dispatch] in moe.py) is kept only where no figure
applies.

HybridEP (https://github.com/deepseek-ai/DeepEP/blob/hybrid-ep/docs/README_Hybrid-EP.md,
"Performance Results", 4,096 tokens of hidden 7,168, top 8, 8 local experts, "Torch API", BF16
dispatch and combine) at the SMs the published runs gave it: Megatron-Core's default
`moe_hybridep_num_sms` is 16, but Megatron-Bridge's performance scripts set 32 for every HybridEP
workload ("recipe.model.moe_hybridep_num_sms = 32", scripts/performance/utils/helpers.py
`set_common_perf_overrides` in v0.2.1,
https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/v0.2.1/scripts/performance/utils/helpers.py,
and scripts/performance/utils/overrides.py `_set_common_perf_overrides` in v0.4.2,
https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/v0.4.2/scripts/performance/utils/overrides.py,
applied after the workload's config has named its backend). The page measures 32 SMs on GB200;
on B200 and H100 InfiniBand it measures at most 16, which is taken (on H100 the InfiniBand
figures at 8 and 16 SMs are within 10% of each other: the adapter, not the SMs, bounds them):
    GB200 NVLink, 32 SMs, by ranks  8: 545.71 / 568.94 GB/s, 16: 523.48 / 521.55,
                                    24: 507.32 / 483.76, 32: 484.22 / 464.54, 36: 479.02 / 447.89
                                    (dispatch / combine)
    B200 NVLink, 16 SMs, 8 ranks    535.94 / 530.86
    H100 InfiniBand, 16 SMs, by ranks 16: 54.47 / 53.35, 32: 47.36 / 52.53, 64: 41.24 / 46.57
The NVLink figure divides the bytes a rank receives (`dispatched_hidden.numel() * 2`: one copy of
each token per destination rank, its own tokens included) by the call's time; the InfiniBand
figure divides one copy per token and destination node, its own node included, by it
(`count_rdma_send_from_routing_map` in tests/utils.py on that branch, used by
tests/test_hybrid_ep.py: "To align with the implementation in the DeepEP, we do not set the
local node map to zeros"; DeepEP's test_internode.py counts `num_rdma_token_sent` over every node
a token reaches the same way, which makes its figure N / (N - 1) times the adapter's traffic on
N nodes: "algorithm bandwidth", as both pages label it, its maintainers' answer in
https://github.com/deepseek-ai/DeepEP/issues/141, and in
https://github.com/deepseek-ai/DeepEP/issues/285 (EP 16's 43 GB/s is "only 43 * 0.5 = 21.5GB/s"
on the wire; NIC counters agree in https://github.com/deepseek-ai/DeepEP/issues/51). A figure is
applied to the bytes it was computed on, so one call costs
    NVLink domain only   ranks_hit · t·h·2 / B_nvl
    across domains       max(nodes_hit · t·h·2 / B_ib, the NVLink part)
with ranks_hit and nodes_hit (the token's own node counted when hit) from [Note: flex dispatch]
(balanced routing): on 2 nodes twice the remote copies, on 8 nodes 8/7 of them. A group of
more ranks than the table's largest takes the largest's figure, a group between two the smaller
group's; the InfiniBand figures were measured with ConnectX-7 at 400 Gb/s and price any node
with that adapter (the NIC bounds them, not the GPU).
DeepEP (https://github.com/deepseek-ai/DeepEP/blob/main/docs/legacy.md, "Normal kernels with
NVLink and RDMA forwarding", H800 with "~160 GB/s NVLink maximum bandwidth" and CX7 400 Gb/s):
intranode EP 8 153 / 158 GB/s over NVLink, i.e. 0.956 / 0.988 of the NVLink maximum (taken as a
share of any GPU's NVLink); internode EP 16 43 / 43, EP 32 58 / 57, EP 64 51 / 50 GB/s over RDMA.
Its NVLink figure counts the same received bytes, its RDMA figure the same per-node copies, its own
node included. On Blackwell, HybridEP's page measures DeepEP beside it (Torch API, BF16, the same
received bytes) at 16 and 24 SMs: B200 8 ranks 348 / 302 and 494 / 420 GB/s; GB200 8 ranks
362.01 / 310.21 and 512.72 / 425.95, 16 ranks 328.80 / 278.34 and 442.47 / 378.32, 24 ranks
324.64 / 126.53 and 450.22 / 163.62. Megatron-Core gives DeepEP 20 SMs (`moe_deepep_num_sms`,
"historical default 20"), halfway between the two measured counts: the mean of the two rows
(`DEEPEP_NVLINK_GBPS`); the H800 share prices DeepEP on Hopper's NVLink.
"""

from __future__ import annotations

from typing import Literal

from overlap.step_model.cost import Link
from overlap.step_model.moe import MoeShape, flex_copies, hit_share

FlexBackend = Literal["hybridep", "deepep"]
FLEX_BACKENDS = ("hybridep", "deepep")

HYBRIDEP_NVLINK_GBPS: dict[str, dict[int, tuple[float, float]]] = {
    "gb200": {
        8: (545.71, 568.94),
        16: (523.48, 521.55),
        24: (507.32, 483.76),
        32: (484.22, 464.54),
        36: (479.02, 447.89),
    },
    "b200": {8: (535.94, 530.86)},
}
"""(dispatch, combine) GB/s HybridEP reaches over NVLink, by GPU and ranks, at the SMs Megatron-Bridge's
performance runs give it (32; on B200 the 16 measured) ([Note: flex kernels' achieved bandwidth])."""
HYBRIDEP_IB_GBPS: dict[int, tuple[float, float]] = {16: (54.47, 53.35), 32: (47.36, 52.53), 64: (41.24, 46.57)}
"""(dispatch, combine) GB/s HybridEP sends to other nodes over one 400 Gb/s ConnectX-7, by ranks."""
DEEPEP_NVLINK_GBPS: dict[str, dict[int, tuple[float, float]]] = {
    "gb200": {
        8: ((362.01 + 512.72) / 2, (310.21 + 425.95) / 2),
        16: ((328.80 + 442.47) / 2, (278.34 + 378.32) / 2),
        24: ((324.64 + 450.22) / 2, (126.53 + 163.62) / 2),
    },
    "b200": {8: ((348.0 + 494.0) / 2, (302.0 + 420.0) / 2)},
}
"""(dispatch, combine) GB/s DeepEP reaches over Blackwell's NVLink at 20 SMs, by GPU and ranks
([Note: flex kernels' achieved bandwidth])."""
DEEPEP_NVLINK_SHARE = (153.0 / 160.0, 158.0 / 160.0)
"""(dispatch, combine) share of the NVLink maximum DeepEP's normal kernels reach intranode."""
DEEPEP_RDMA_GBPS: dict[int, tuple[float, float]] = {16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}
"""(dispatch, combine) GB/s DeepEP's normal kernels send over one 400 Gb/s CX7, by ranks."""
MEASURED_RAIL_GBIT = 400.0
"""The adapter line rate both libraries measured their inter-node figures on, Gb/s."""


def _measured(table: dict[int, tuple[float, float]], ranks: int) -> tuple[float, float]:
    """The figure measured on the largest group not above `ranks` (the smallest group's below it)."""
    sizes = sorted(table)
    below = [s for s in sizes if s <= ranks]
    return table[below[-1] if below else sizes[0]]


def _nvlink_gbps(backend: FlexBackend, gpu: str, ranks: int, nvlink_max_gbps: float) -> tuple[float, float] | None:
    table = (HYBRIDEP_NVLINK_GBPS if backend == "hybridep" else DEEPEP_NVLINK_GBPS).get(gpu)
    if table is not None:
        return _measured(table, ranks)
    if backend == "deepep":
        return (nvlink_max_gbps * DEEPEP_NVLINK_SHARE[0], nvlink_max_gbps * DEEPEP_NVLINK_SHARE[1])
    return None


def flex_call_s(token_bytes: float, moe: MoeShape, ep: int, ranks_per_domain: int, *, backend: FlexBackend,
                gpu: str, nvlink_max_gbps: float, rail_gbit: float, nvlink: Link,
                rail: Link) -> tuple[float, float]:  # fmt: skip
    """(dispatch, combine) seconds of one flex call for a rank holding `token_bytes` (its tokens
    once, t·h bf16) at the backend's published bandwidths ([Note: flex kernels' achieved
    bandwidth]) on preset `gpu` (NVLink maximum `nvlink_max_gbps`) and rails of `rail_gbit`; a
    part no figure covers at the link's rate (`nvlink`, `rail`)."""
    if ep == 1:
        return 0.0, 0.0
    local = max(1, min(ep, ranks_per_domain))
    intra, inter = flex_copies(moe, ep, ranks_per_domain)
    if ep == local:  # one NVLink domain: every received copy, its own included, over NVLink
        received = ep * hit_share(moe.num_experts, ep, moe.top_k) * token_bytes
        rates = _nvlink_gbps(backend, gpu, ep, nvlink_max_gbps)
        if rates is None:
            link_s = nvlink.alpha_s + nvlink.seconds(intra * token_bytes)
            return link_s, link_s
        return received / (rates[0] * 1e9), received / (rates[1] * 1e9)
    nvlink_s = nvlink.alpha_s + nvlink.seconds(intra * token_bytes)
    if rail_gbit != MEASURED_RAIL_GBIT:
        rail_s = rail.alpha_s + rail.seconds(inter * token_bytes)
        return max(nvlink_s, rail_s), max(nvlink_s, rail_s)
    table = HYBRIDEP_IB_GBPS if backend == "hybridep" else DEEPEP_RDMA_GBPS
    dispatch_gbps, combine_gbps = _measured(table, ep)
    # the figures count a copy to the sender's own node too ([Note: flex kernels' achieved bandwidth])
    domains = ep // local
    counted = inter * domains / (domains - 1) * token_bytes
    return max(nvlink_s, counted / (dispatch_gbps * 1e9)), max(nvlink_s, counted / (combine_gbps * 1e9))


__all__ = [
    "DEEPEP_NVLINK_GBPS",
    "DEEPEP_NVLINK_SHARE",
    "DEEPEP_RDMA_GBPS",
    "FLEX_BACKENDS",
    "HYBRIDEP_IB_GBPS",
    "HYBRIDEP_NVLINK_GBPS",
    "FlexBackend",
    "flex_call_s",
]
