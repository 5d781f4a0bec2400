"""The expert-parallel parts of a run's step ([Note: a run's step] in run_step.py, [Note: expert
parallelism] in overlap/step_model/moe.py): a MoE layer's compute and host pace, its dispatch and
combine, and the expert data-parallel group its experts are sharded and reduced over; and the link
any group of a run's ranks runs on."""

from __future__ import annotations

from dataclasses import replace

from overlap.step_model.cost import Link
from overlap.step_model.hardware import NVLINK_SHARE, accelerator, node_spec, ring_link
from overlap.step_model.kernels import ACT_BYTES
from overlap.step_model.moe import MoeSeconds, all_to_all_s, moe_seconds
from overlap.step_model.moe_flex import flex_call_s
from overlap.step_model.moe_host import host_cpu, moe_host_split, synced_forward_s
from overlap.step_model.moe_kernels import moe_kernel_gaps
from overlap.step_model.moe_skew import routing_skew
from overlap.tools.plan.run_spec import RankShare, RunSpec

RECOMPUTED_FORWARDS = {"none": 0.0, "selective": 0.0, "attention": 0.0, "full": 1.0, "layer2": 0.5}
"""Forwards of a block's weights that recomputation repeats, per micro-batch."""


def group_link(spec: RunSpec, size: int, ranks_per_node: int) -> Link:
    """The link a ring of `size` of the run's ranks, `ranks_per_node` of them in each host, runs
    on ([Note: rails] in overlap/step_model/hardware.py)."""
    return ring_link(accelerator(spec.gpu), node_spec(spec.node), size, max(1, min(size, ranks_per_node)))


def module_recompute_moe_s(spec: RunSpec, e: MoeSeconds) -> float:
    """The MoE parts of [Note: recomputed modules] (run_step.py): the experts' activation (moe_act),
    the whole layer (moe; its all-to-alls in `ep_exposed`) or the shared experts (shared_experts)."""
    modules = spec.recompute_modules
    if spec.ac == "full":
        return 0.0
    if "moe" in modules:
        return e.forward_s
    return ("moe_act" in modules) * e.act_forward_s + ("shared_experts" in modules) * e.shared_forward_s


def moe_layer_seconds(spec: RunSpec, tokens: float) -> MoeSeconds:
    """One MoE layer's MLP for the rank's `tokens` (sequence-parallel shard of them with ETP 1): its
    bytes and FLOPs, and the GPU's idle time between Megatron-Core's small kernels ([Note: small
    kernels' GPU floor] in overlap/step_model/moe_kernels.py), the router's before the sync."""
    assert spec.model.moe is not None
    routed, fp8 = tokens / (spec.tp // spec.etp), spec.precision == "fp8"
    e = moe_seconds(spec.model.moe, spec.model.hidden, routed, accelerator(spec.gpu), ep=spec.ep,
                    tp=spec.tp, etp=spec.etp, shared_tokens=tokens, fp8=fp8,
                    fp8_recipe=spec.fp8_recipe, capacity_factor=spec.capacity_factor,
                    dispatcher=spec.dispatcher, force_balance=spec.force_load_balancing)  # fmt: skip
    g = moe_kernel_gaps(spec.model.moe, spec.ep, fp8, spec.cuda_graph_scope, dispatcher=spec.dispatcher,
                        force_balance=spec.force_load_balancing)  # fmt: skip
    return replace(e, forward_s=e.forward_s + g.forward_s, backward_s=e.backward_s + 2 * g.forward_s,
                   router_forward_s=e.router_forward_s + g.pre_sync_s, expert_forward_s=e.expert_forward_s + g.experts_s,
                   act_forward_s=e.act_forward_s + g.act_s, dispatch_forward_s=e.dispatch_forward_s + g.dispatch_s)  # fmt: skip


def ep_exposed(spec: RunSpec, share: RankShare) -> float:
    """Exposed seconds of one micro-batch's dispatch and combine all-to-alls ([Note: expert
    parallelism]): two forward, two backward and two per recomputed forward, per MoE layer."""
    moe_layers = sum(spec.model.is_moe_layer(i) for i in spec.rank_layers(share))
    if spec.ep == 1 or not moe_layers:
        return 0.0
    gpu, node = accelerator(spec.gpu), node_spec(spec.node)
    nvlink = Link(f"nvlink ({gpu.name})", node.alpha_intra_s, gpu.nvlink_gbps * NVLINK_SHARE, gpu.source)
    rail = Link(f"{node.rail_gbit:g}G rail", node.alpha_inter_s, node.rail_gbps(), node.source)
    # the EP group's ranks are consecutive in the expert layout (ETP innermost)
    per_domain = node.nvlink_domain // spec.etp
    tokens = spec.micro_batch * spec.seq_len / spec.cp
    recomputed = RECOMPUTED_FORWARDS[spec.ac] or float("moe" in spec.recompute_modules)
    count = moe_layers * (4 + 2 * recomputed)
    if spec.dispatcher == "flex":  # [Note: flex kernels' achieved bandwidth] in moe_flex.py
        routed = tokens / (spec.tp // spec.etp)
        # the busiest rank's copies ([Note: forced-balance skew] in moe_skew.py)
        routed *= routing_skew(spec.model.moe, spec.ep, routed, force_balance=spec.force_load_balancing,
                               capacity_factor=spec.capacity_factor)  # fmt: skip
        dispatch, combine = flex_call_s(routed * spec.model.hidden * ACT_BYTES, spec.model.moe, spec.ep, per_domain,
                                        backend=spec.flex_backend, gpu=spec.gpu, nvlink_max_gbps=gpu.nvlink_gbps,
                                        rail_gbit=node.rail_gbit, nvlink=nvlink, rail=rail)  # fmt: skip
        return count * (dispatch + combine) / 2
    e = moe_layer_seconds(spec, tokens)
    return count * all_to_all_s(e.dispatch_bytes, spec.ep, per_domain, nvlink, rail)


def ep_overlap_hides(spec: RunSpec) -> bool:
    """[Note: overlap on GB200] Megatron-Core's 1F1B all-to-all overlap hides the dispatch and
    combine behind the other micro-batch's compute, except where the host issues too slowly for it.

    The overlap splits each layer's forward and backward into stages it schedules against the
    other micro-batch's, "and there is some synchronization between different stages, which
    aggravates the CPU overhead, so the overall benefit is negative on the GB200" (Megatron-Core's
    DeepSeek-V3 GB200 guide, section 3.2,
    https://github.com/NVIDIA/Megatron-LM/blob/dev/docs/discussions/deepseek-v3-gb200-optimization/deepseek-v3-gb200-optimization.md).
    On a Grace-hosted card the overlap is priced as hiding nothing: the all-to-alls
    stay exposed (the measured net loss beyond that is not priced)."""
    return spec.ep_overlap and host_cpu(spec.gpu) != "grace"


def expert_group(spec: RunSpec) -> tuple[int, Link]:
    """The expert data-parallel group and its link: EDP ranks strided by ETP x EP."""
    per_node = max(1, node_spec(spec.node).gpus_per_node // (spec.ep * spec.etp))
    return spec.edp, group_link(spec, spec.edp, per_node)


def expert_wire_share(spec: RunSpec, size: int, link: Link) -> float:
    """Routed-expert bytes as the data-parallel group's bytes of the same ring time: the experts
    gather and reduce over the expert data-parallel group instead ([Note: a run's step])."""
    edp, elink = expert_group(spec)
    if edp == 1 or size == 1:
        return 0.0
    return ((edp - 1) / edp / elink.busbw_gbps) / ((size - 1) / size / link.busbw_gbps)


def moe_layer_s(spec: RunSpec, tokens: float, forward: float, backward: float, a2a_layer: float) -> tuple[float, float]:
    """(forward, backward) seconds of a MoE layer on the compute stream: its block's `forward` and
    `backward` with the MoE part's, its recomputation, and the host's pace ([Note: MoE host work],
    [Note: the dispatcher's sync] in overlap/step_model/moe_host.py); `a2a_layer` is one direction's
    exposed all-to-alls, during which the host issues too."""
    fp8 = spec.precision == "fp8"
    e = moe_layer_seconds(spec, tokens)
    forward += e.forward_s
    backward += e.backward_s + RECOMPUTED_FORWARDS[spec.ac] * e.forward_s
    backward += module_recompute_moe_s(spec, e)
    # the GPU waits on the host once per MoE layer ([Note: MoE host work], [Note: the
    # dispatcher's sync]); the host issues while exposed all-to-alls run too
    cpu = host_cpu(spec.gpu)
    host_pre, host_post = moe_host_split(spec.model.moe, spec.ep, fp8, spec.cuda_graph_scope, host=cpu,
                                         dispatcher=spec.dispatcher,
                                         force_balance=spec.force_load_balancing)  # fmt: skip
    if spec.capacity_factor is None:
        post = e.expert_forward_s + e.act_forward_s + e.dispatch_forward_s
        post += e.shared_forward_s if "moe_router" not in spec.cuda_graph_scope else 0.0
        forward = synced_forward_s(forward - post, post, host_pre, host_post, a2a_layer, cpu)
    else:
        forward = max(forward, host_pre + host_post - a2a_layer)
    backward = max(backward, 2 * (host_pre + host_post) - a2a_layer)
    return forward, backward
