"""One published-style run predicted: a `RunSpec` (run_spec.py) to its step time and tokens/s/GPU.

[Note: a run's step]
Compute per micro-batch on the bottleneck rank comes from the kernel model
(overlap/step_model/kernels.py): its pipeline stage's blocks (1/T of each matmul, its C-th of
the sequence), the head and loss, recomputation by the checkpointing policy. Communication:
    data parallel   [Note: data-parallel modes] in run_spec.py. ZeRO-3 and ZeRO-2 replay the
                    runtime's own Schedule on the simulator's clock, one micro-batch at a time:
                    without pipelining each micro-batch gathers and reduces (as FSDP does under
                    gradient accumulation); under pipelining each gathers (FSDP2 with
                    reshard_after_forward=True) and the stage reduces once per step; overlap's
                    PipelineStage keeps its units for the step (zero3-keep). DDP, ZeRO-1 and a
                    kept ZeRO-3 exchange once per step, hidden behind one micro-batch's
                    backward (forward) when `dp_overlap`, else exposed. While a
                    collective overlaps compute it slows it ([Note: compute beside a
                    collective] in hardware.py, `collective_share_lost`).
    tensor          4 collectives forward and 4 backward per block (sequence parallel), plus
                    those recomputation replays; rings over T ranks on NVLink; exposed unless
                    overlapped (async TP: the forward's; Transformer Engine: all)
    context         ring attention ([Note: ring attention] in ring_attention.py): K/V passes
                    around the C ranks beyond what the attention kernels hide, and PyTorch's
                    per-step merges on the compute stream
    pipeline        (M + (P-1)/v) micro-batch slots per step ([Note: pipeline step] in
                    layout.py) and the stage-to-stage sends, one rail each
    expert          per MoE layer the dispatch and combine all-to-alls forward and backward (and
                    again for a recomputed forward) over the EP group, exposed unless `ep_overlap`; the routed
                    experts' parameters are sharded (reduced) over the expert data-parallel
                    group (dp x cp [x tp] / ep), the rest over dp ([Note: expert parallelism]
                    in overlap/step_model/moe.py)
The bottleneck rank of a pipeline holds the model's last layers (with dense layers first, the
MoE layers; with sliding-window layers, its share of them).
[Note: multi-token prediction]
Megatron-Core's MTP (mtp_num_layers, https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/
transformer/multi_token_prediction.py and docs/user-guide/features/multi_token_prediction.md) runs,
per depth and on the pipeline stage that holds the loss (its default placement, "all MTP layers
sit on the last pipeline stage"): the shared embedding of the tokens shifted by the depth
(GPTModel builds a copy of the embedding on that stage, `mtp_process`), enorm and hnorm, the
concatenation through eh_proj (2h -> h, a column-parallel linear), one transformer layer built
from the decoder's last layer spec (`get_gpt_mtp_block_spec`: a MoE layer for DeepSeek-V3, with
its dispatch, combine and host work), its final_layernorm, the shared output layer and a loss.
Priced as one more layer of the decoder's last kind, the projection's GEMMs, three norms' passes
and one more output layer and loss, forward and backward; its parameters (the layer, eh_proj,
the norms and the embedding copy) are reduced and stepped with the stage's.
[Note: weight passes]
Some work scales with the weights, not the tokens, and runs on the compute stream: fp32
parameters under autocast are cast to bf16 at each forward use (read 4, write 2 bytes; again for
a recomputed forward), their bf16 weight gradients cast back (6 bytes) and, with a bf16
reduction, cast down again (6); FSDP2 copies every all-gather's output into the parameters (read
and write the gathered bytes) and every gradient into its reduce-scatter input, cast to the
reduce dtype (`foreach_reduce_scatter_copy_in`, https://github.com/pytorch/pytorch/blob/main/
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py; on the reduce-scatter stream, but on
the same HBM); FSDP1 gathers into a flat parameter whose views the modules use, so autograd
concatenates the parameters' gradients into the flat gradient (read and write the gradient's
bytes), then casts it to the reduce dtype and pre-divides it in place before its reduce-scatter
(`KernelStack.flat_param_reduce`). Per micro-batch, at HBM bandwidth. Large micro-batches hide
it; small ones do not.
[Note: FSDP1's schedule]
FSDP1 (torch/distributed/fsdp at v2.1.0, the llm-foundry sweep's pin) issues its collectives on
one NCCL stream in the order overlap's Schedule does at prefetch depth 1: the next unit's
all-gather before the current unit's reduce-scatter, under BACKWARD_PRE (issued in the
pre-backward hook) and BACKWARD_POST alike (`_post_backward_reshard` prefetches before
`_reduce_grad`,
https://github.com/pytorch/pytorch/blob/v2.1.0/torch/distributed/fsdp/_runtime_utils.py). The
all-gather waits on no compute (the unshard stream waits on the pre-unshard cast only), and
`limit_all_gathers` holds the CPU, not the GPU: it synchronizes on the free of the unit two
frees back, leaving one unit computing and one gathering, which depth 1 never exceeds. Without
`forward_prefetch` the CPU running ahead issues the next forward all-gather while the current
unit computes. So the replay is FSDP1's schedule; what differs is that FSDP1 reshards every unit
but the root after forward (the Schedule keeps the last unit; one more all-gather a micro-batch
in FSDP1, 0.1 points on the llm-foundry rows) and its weight passes above.

Every collective's ring runs on the link `ring_link` gives its group ([Note: rails] in
hardware.py). The optimizer streams the bytes per parameter it owns that the stack's optimizer
step and clipping move through HBM (28 for a fused AdamW; `KernelStack.optimizer_bytes_per_param`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from overlap.config import OverlapConfig
from overlap.step_model.calibration import default_calibration
from overlap.step_model.cost import Link, Topology, UnitCost, ring_time_s
from overlap.step_model.fitting import solve_increasing
from overlap.step_model.hardware import HBM_SHARE, accelerator, collective_share_lost, node_spec
from overlap.step_model.kernels import ACT_BYTES, block_seconds, gemm_backward_seconds, gemm_seconds, head_seconds
from overlap.step_model.stacks import stack
from overlap.tools.plan import ring_attention
from overlap.tools.plan.fsdp import OPTIMIZER_BYTES_PER_PARAM
from overlap.tools.plan.run_experts import (
    RECOMPUTED_FORWARDS,
    ep_exposed,
    ep_overlap_hides,
    expert_group,
    expert_wire_share,
    group_link,
    moe_layer_s,
)
from overlap.tools.plan.run_spec import RankShare, RunSpec

MTP_NORMS = 3
"""Norms of one multi-token-prediction depth: enorm, hnorm and its final_layernorm."""
TP_COLLECTIVES = {"none": 8, "selective": 10, "attention": 8, "full": 12, "layer2": 10}
"""Per block and micro-batch: 2 all-gathers + 2 reduce-scatters forward, the same backward, and
the forward's again when the whole block is recomputed. torchtitan's per-op policy ("selective")
saves reduce_scatter_tensor outputs but not all-gathers (its `_save_list`,
https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/torchtitan/models/llama3/parallelize_llama.py):
the backward re-gathers the two block inputs its weight gradients need (as layout.py's
RECOMPUTED_TP_COLLECTIVES)."""
ROWWISE_REGATHERS = {"none": 0, "selective": 2, "attention": 0, "full": 2, "layer2": 1}
"""Per block and micro-batch: all-gathers a recomputation repeats (torchtitan's selective policy
re-gathers the two block inputs; a whole-block recompute replays the forward's two; layer2 does so
for half the blocks), which rowwise float8's async TP leaves exposed."""


@dataclass(frozen=True)
class RunPrediction:
    """A run's predicted step, with the terms it is made of (seconds per step)."""

    spec: RunSpec
    step_s: float
    compute_s: float
    dp_exposed_s: float
    tp_exposed_s: float
    cp_exposed_s: float
    pp_bubble_s: float
    p2p_s: float
    optimizer_s: float
    ep_exposed_s: float = 0.0
    lacks: list[str] = field(default_factory=list)
    """What the model does not represent for this run (shown beside the prediction)."""

    @property
    def tokens_per_s_per_gpu(self) -> float:
        s = self.spec
        return s.global_batch * s.seq_len / (self.step_s * s.num_gpus)


def _head_seconds(spec: RunSpec, share: RankShare, tokens: float) -> tuple[float, float]:
    """(forward, backward) seconds of the output layer and its loss on the rank that holds them,
    and of each multi-token-prediction depth's projection, norms and second pass through the
    shared output layer and a loss ([Note: multi-token prediction])."""
    if not share.head:
        return 0.0, 0.0
    m, gpu, fp8 = spec.model, accelerator(spec.gpu), spec.precision == "fp8"
    forward, backward = head_seconds(tokens, m.hidden, m.vocab_size, gpu, spec.tp)
    if not spec.mtp_layers:
        return forward, backward
    h = m.hidden
    proj_fwd = gemm_seconds(tokens, 2 * h, h // spec.tp, gpu, fp8, spec.fp8_recipe)
    proj_bwd = gemm_backward_seconds(tokens, 2 * h, h // spec.tp, gpu, fp8, spec.fp8_recipe)
    norms = tokens * MTP_NORMS * stack(spec.stack).norm_passes * h * ACT_BYTES / (gpu.hbm_tbps * 1e12 * HBM_SHARE)
    depth = spec.mtp_layers
    return forward * (1 + depth) + depth * (proj_fwd + norms), backward * (1 + depth) + depth * (proj_bwd + 2 * norms)


def _root_numel(spec: RunSpec, share: RankShare) -> float:
    """Parameters outside the transformer layers on a rank, 1/T of them: the embedding, the
    output layer and final norm, and per MTP depth its projection and three norms, with a copy of
    the embedding where the first rank's is not ([Note: multi-token prediction])."""
    m = spec.model
    table = m.vocab_size * m.hidden
    if share.embedding and share.head:
        out = float(m.root_numel())
    else:
        out = float(share.embedding * table + share.head * (table + m.hidden))
    if share.head and spec.mtp_layers:
        out += spec.mtp_layers * (2 * m.hidden * m.hidden + MTP_NORMS * m.hidden) + (0 if share.embedding else table)
    return out / spec.tp


def _layer_numel(spec: RunSpec, index: int) -> tuple[float, float]:
    """(dense, routed-expert) parameters of layer `index` on one rank: 1/T of the dense ones,
    the rank's E/EP experts split over ETP."""
    m = spec.model
    expert = m.expert_layer_numel(index)
    return (m.layer_numel(index) - expert) / spec.tp, expert / (spec.ep * spec.etp)


def _weight_pass_s(spec: RunSpec, index: int) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of the passes over layer `index`'s weights on
    the compute stream ([Note: weight passes])."""
    gpu, kernels = accelerator(spec.gpu), stack(spec.stack)
    numel = sum(_layer_numel(spec, index))
    forward = backward = 0.0
    if spec.param_bytes == 4:  # fp32 parameters under autocast
        forward += 6 * (1 + RECOMPUTED_FORWARDS[spec.ac])
        backward += 6 + (6 if spec.reduce_bytes < 4 else 0)
    if kernels.gather_copy_out and spec.dp_mode in ("zero3", "zero3-keep", "zero2") and spec.pp == 1:
        gather = 1 if spec.fp8_all_gather else spec.param_bytes
        forward += 2 * gather
        backward += 2 * gather if spec.dp_mode == "zero3" else 0
        # FSDP2's foreach_reduce copies the bf16 gradients into the reduce-scatter input in the
        # reduce dtype (_chunk_cat: read 2, write reduce_bytes)
        backward += 2 + spec.reduce_bytes if spec.dp_mode in ("zero3", "zero2") else 0
    if kernels.flat_param_reduce and spec.dp_mode in ("zero3", "zero2") and spec.dp * spec.cp > 1:
        # FSDP1's modules compute with views of the unsharded flat parameter (torch.split, then
        # view: FlatParamHandle._get_unflat_views_aligned, https://github.com/pytorch/pytorch/blob/
        # v2.1.0/torch/distributed/fsdp/flat_param.py), so autograd builds the flat gradient by
        # split_with_sizes' backward, a cat of the parameters' gradients (tools/autograd/
        # derivatives.yaml; read and write the gradient's bytes); then FSDP1 casts the bf16
        # gradient to the reduce dtype (read 2, write reduce_bytes) where they differ, and
        # pre-divides it in place (read and write reduce_bytes)
        backward += 2 * spec.param_bytes
        backward += (2 + spec.reduce_bytes if spec.reduce_bytes != 2 else 0) + 2 * spec.reduce_bytes
    rate = gpu.hbm_tbps * 1e12 * HBM_SHARE
    return numel * forward / rate, numel * backward / rate


def _microbatch_compute(spec: RunSpec, share: RankShare) -> tuple[list[tuple[float, float]], tuple[float, float]]:
    """(forward, backward + recompute) seconds of each block on a pipeline rank, and of the
    head and loss, for one micro-batch."""
    gpu, kernels, m = accelerator(spec.gpu), stack(spec.stack), spec.model
    tokens = spec.micro_batch * spec.seq_len / spec.cp
    fp8 = spec.precision == "fp8"
    ring_fwd, ring_bwd = ring_attention.compute_s(spec)
    blocks = []
    moe_layers = sum(m.is_moe_layer(i) for i in spec.rank_layers(share))
    # one direction's share of a MoE layer's exposed all-to-alls (none when overlapped)
    a2a_layer = 0.0 if ep_overlap_hides(spec) or not moe_layers else ep_exposed(spec, share) / moe_layers / 2
    # the rank's first recompute_num_layers layers recompute their whole forward
    full = replace(spec, ac="full", recompute_num_layers=0) if spec.recompute_num_layers else spec
    for position, index in enumerate(spec.rank_layers(share)):
        layer_spec = full if position < spec.recompute_num_layers else spec
        moe_layer = m.is_moe_layer(index)
        b = block_seconds(m.block(moe_layer=moe_layer), tokens, spec.seq_len, gpu, kernels, tp=spec.tp, fp8=fp8,
                          fp8_recipe=spec.fp8_recipe, recompute=layer_spec.ac,
                          window=m.sliding_window if m.is_sliding_layer(index) else 0)  # fmt: skip
        weights_fwd, weights_bwd = _weight_pass_s(layer_spec, index)
        forward = b.forward_s + weights_fwd + ring_fwd
        backward = b.backward_s + b.recompute_s + weights_bwd + ring_bwd
        backward += _recomputed_modules_s(layer_spec, index, tokens, b)
        if moe_layer:
            forward, backward = moe_layer_s(spec, tokens, forward, backward, a2a_layer)
        blocks.append((forward, backward))
    return blocks, _head_seconds(spec, share, tokens)


def _recomputed_modules_s(spec: RunSpec, index: int, tokens: float, b) -> float:
    """[Note: recomputed modules] Seconds the backward of layer `index` spends recomputing the
    modules in `spec.recompute_modules` outside its MoE part (under full recomputation: none
    more). Megatron-Core (TransformerConfig.recompute_modules): core_attn recomputes the
    attention kernel; layernorm the input and pre-MLP norms; mla_up_proj the MLA query and
    key/value up-projections (and their rotary); mlp the dense MLP of a dense layer; moe_act,
    moe and shared_experts the MoE parts (`_module_recompute_moe_s`)."""
    modules = spec.recompute_modules
    if not modules or spec.ac == "full":
        return 0.0
    m, gpu, fp8 = spec.model, accelerator(spec.gpu), spec.precision == "fp8"
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    out = b.attention_forward_s if "core_attn" in modules else 0.0
    if "layernorm" in modules:
        out += tokens * 2 * stack(spec.stack).norm_passes * m.hidden * ACT_BYTES / hbm
    if "mla_up_proj" in modules and m.kv_lora_rank:
        block = m.block(moe_layer=True)
        ups = [(k, n) for k, n, _ in block.attention_gemms() if k in (m.q_lora_rank, m.kv_lora_rank)]
        out += sum(gemm_seconds(tokens, k, n // spec.tp, gpu, fp8, spec.fp8_recipe, amax_fused=True) for k, n in ups)
    if "mlp" in modules and not m.is_moe_layer(index):
        block = m.block()
        mlp = [(k, n // spec.tp if not row else n, block.norm_fused_input(k, row)) for k, n, row in block.mlp_gemms()]
        out += sum(gemm_seconds(tokens, k, n, gpu, fp8, spec.fp8_recipe, amax_fused=fused) for k, n, fused in mlp)
    return out


def _stage_numel(spec: RunSpec, share: RankShare) -> tuple[float, float, float]:
    """(dense block, routed-expert, root) parameters on a pipeline rank ([Note: a run's step]):
    1/T of the dense ones, the rank's experts."""
    layers = [_layer_numel(spec, i) for i in spec.rank_layers(share)]
    return sum(d for d, _ in layers), sum(e for _, e in layers), _root_numel(spec, share)


def _tp_exposed(spec: RunSpec, share: RankShare) -> float:
    """Exposed seconds of one micro-batch's tensor-parallel collectives: all of them, or with
    async TP those the stack does not overlap (`KernelStack.tp_overlap_backward`). Half of them
    are all-gathers (the forward's of the block inputs, the backward's of the output gradients),
    which float8 tensor parallelism runs in fp8 (`KernelStack.float8_tp_all_gather`)."""
    if spec.tp == 1:
        return 0.0
    size = spec.micro_batch * spec.seq_len / spec.cp * spec.model.hidden * 2
    link = group_link(spec, spec.tp, spec.tp)
    topo = Topology(spec.tp, spec.tp, link, link)
    layers = len(spec.rank_layers(share))
    full = min(spec.recompute_num_layers, layers)
    count = (layers - full) * TP_COLLECTIVES[spec.ac] + full * TP_COLLECTIVES["full"] + 4
    if spec.async_tp:
        count = 0 if stack(spec.stack).tp_overlap_backward else layers * 4 + 2
        if count and spec.precision == "fp8" and spec.fp8_recipe == "rowwise":
            # torch's micro-pipeline TP fuses rowwise-scaled matmul + reduce-scatters but not the
            # all-gather + matmuls ("the all-gather-matmul patterns were NOT being fused properly",
            # https://github.com/pytorch/pytorch/issues/149990; rowwise support went to the
            # reduce-scatter fusion, pytorch/pytorch#149247): the forward's two all-gathers a block
            # and those a recomputation repeats stay exposed, in bf16 (rowwise casts after the gather)
            count += (layers - full) * (2 + ROWWISE_REGATHERS[spec.ac]) + full * (2 + ROWWISE_REGATHERS["full"])
    if spec.precision == "fp8" and spec.fp8_recipe == "tensorwise" and stack(spec.stack).float8_tp_all_gather:
        return count / 2 * (ring_time_s("all_gather", size, topo) + ring_time_s("all_gather", size / 2, topo))
    return count * ring_time_s("all_gather", size, topo)


def _dp_group(spec: RunSpec) -> tuple[int, Link]:
    """The ranks the data-parallel collectives span (ZeRO shards over dp x cp, as torchtitan's
    dp_shard_cp mesh) and their link."""
    size = spec.dp * spec.cp // spec.replicas if spec.dp_mode in ("zero3", "zero3-keep") else spec.dp * spec.cp
    per_node = max(1, node_spec(spec.node).gpus_per_node // spec.tp)
    return size, group_link(spec, size, per_node)


def _simulated_fsdp(spec: RunSpec, share: RankShare, blocks: list[tuple[float, float]], head: tuple[float, float],
                    *, reduce: bool = True) -> tuple[float, float]:  # fmt: skip
    """(seconds, of which exposed) of one micro-batch replayed on the simulator with the
    runtime's Schedule: gathers, and with `reduce` the gradients' reduce-scatter."""
    size, link = _dp_group(spec)
    root_numel = _stage_numel(spec, share)[2]
    gather_bytes = 1 if spec.fp8_all_gather else spec.param_bytes
    cal = replace(
        default_calibration("nccl", size, link), compute_share_lost=collective_share_lost(accelerator(spec.gpu))
    )
    grad_bytes = spec.reduce_bytes if reduce else 0
    wire = expert_wire_share(spec, size, link)
    units: list[UnitCost] = [cal.unit("root", int(root_numel * spec.param_bytes), int(root_numel * grad_bytes), *head,
                                      gather_wire_bytes=int(root_numel * spec.param_bytes))]  # fmt: skip
    for i, ((f, b), index) in enumerate(zip(blocks, spec.rank_layers(share), strict=True)):
        dense, expert = _layer_numel(spec, index)
        numel = int(dense + expert)
        units.append(cal.unit(f"blocks.{i}", numel * spec.param_bytes, numel * grad_bytes, f, b,
                              gather_wire_bytes=int((dense + wire * expert) * gather_bytes),
                              reduce_wire_bytes=int((dense + wire * expert) * grad_bytes)))  # fmt: skip
    config = OverlapConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                           reshard_after_forward=spec.dp_mode == "zero3")  # fmt: skip
    replicas = spec.replicas if spec.dp_mode == "zero3" else 1
    topo = Topology(size, size, link, link, num_replicas=replicas,
                    replica_link=group_link(spec, replicas, 1) if replicas > 1 else None)  # fmt: skip
    p = cal.predict(units, config, topology=topo, root=0)
    return p.step_s, p.exposed_s


def _once_per_step(spec: RunSpec, share: RankShare, mb_forward_s: float, mb_backward_s: float) -> float:
    """Exposed seconds of a data-parallel exchange that happens once per step ([Note: a run's
    step]): the stage's reduction behind one micro-batch's backward, ZeRO-1's and a kept ZeRO-3's
    gather behind one micro-batch's forward."""
    dense, expert, root = _stage_numel(spec, share)
    reduce_op = "all_reduce" if spec.dp_mode == "ddp" else "reduce_scatter"
    gather_bytes = 1 if spec.fp8_all_gather else spec.param_bytes
    reduce_s = gather_s = 0.0
    for group, link, numel in ((*_dp_group(spec), dense + root), (*expert_group(spec), expert)):
        if group == 1 or not numel:
            continue
        topo = Topology(group, group, link, link)
        reduce_s += ring_time_s(reduce_op, numel * spec.reduce_bytes, topo)
        if spec.dp_mode in ("zero1", "zero3-keep"):
            gather_s += ring_time_s("all_gather", numel * gather_bytes, topo)
    if not spec.dp_overlap:
        return reduce_s + gather_s
    # what hides still slows the compute beside it ([Note: compute beside a collective])
    hidden = min(reduce_s, mb_backward_s) + min(gather_s, mb_forward_s)
    share = collective_share_lost(accelerator(spec.gpu))
    return max(0.0, reduce_s - mb_backward_s) + max(0.0, gather_s - mb_forward_s) + hidden * share


def _lacks(spec: RunSpec) -> list[str]:
    out = list(spec.notes)
    gpu = accelerator(spec.gpu)
    if gpu.generation == "blackwell":
        measured = {
            "megatron-te": "cuDNN 9.18's measured GB200",
            "megatron-te-cudnn9.20": "cuDNN 9.18's measured GB200",
            "megatron-te-cudnn9.13": "cuDNN 9.13's measured B200",
        }
        attention = (
            f"Blackwell attention at {measured[spec.stack]} rates (4096 and 8192 tokens)"
            if spec.stack in measured
            else "Blackwell attention share taken from Hopper (FA3-class)"
        )
        out.append(f"{attention}; GEMM shares from its MAMF")
    if spec.precision == "fp8" and gpu.fp8_tflops is None:
        out.append(f"fp8 on {gpu.name}: no fp8 tensor cores, planned at bf16")
    if spec.cp > 1:
        out.append(
            "ring attention's steps priced as one flash kernel over the rank's causal share"
            + ("" if stack(spec.stack).torch_ring else "; its merges as fused into the kernels")
        )
    if spec.model.moe is not None:
        overlap = "overlapped with another micro-batch" if ep_overlap_hides(spec) else "exposed"
        if spec.ep_overlap and not ep_overlap_hides(spec):
            overlap += " (the 1F1B all-to-all overlap hides nothing behind a Grace host: [Note: overlap on GB200])"
        graphs = f" (CUDA graphs: {', '.join(spec.cuda_graph_scope)})" if spec.cuda_graph_scope else ""
        kernels = f" ({spec.flex_backend} at its published bandwidths)" if spec.dispatcher == "flex" else ""
        out.append(
            f"{'random routing at its busiest rank' if spec.force_load_balancing else 'routing balanced'}; "
            f"{spec.dispatcher} dispatch and combine{kernels} {overlap}; "
            f"host work per MoE layer from eager operator and launch costs{graphs}"
        )
    if spec.precision == "fp8" and spec.fp8_recipe == "mxfp8":
        out.append("MXFP8 weights quantized once per step (cached across micro-batches): not priced")
    if spec.precision == "fp8" and spec.fp8_recipe == "rowwise":
        out.append("rowwise fp8 backward GEMMs at the fast-accumulation rate (torchao's slow accumulation unpriced)")
    return out


def predict_run(spec: RunSpec, *, compute_scale: float = 1.0) -> RunPrediction:
    """[Note: a run's step] for `spec`, paced by its slowest pipeline rank ([Note: pipeline
    ranks] in run_spec.py); `compute_scale` multiplies every kernel's seconds (what
    `calibrate_compute` finds from one measured run; 1: the kernel model's defaults)."""
    if not compute_scale > 0:
        raise ValueError(f"compute_scale must be > 0, got {compute_scale!r}")
    return max((_predict_rank(spec, share, compute_scale) for share in spec.rank_shares()), key=lambda p: p.step_s)


def _predict_rank(spec: RunSpec, share: RankShare, compute_scale: float) -> RunPrediction:
    """[Note: a run's step] with the pipeline paced by the rank that holds `share`."""
    blocks, head = _microbatch_compute(spec, share)
    blocks = [(f * compute_scale, b * compute_scale) for f, b in blocks]
    head = (head[0] * compute_scale, head[1] * compute_scale)
    gpu = accelerator(spec.gpu)
    attention_s = compute_scale * block_seconds(spec.model.block(), spec.micro_batch * spec.seq_len / spec.cp,
                                                spec.seq_len, gpu, stack(spec.stack), tp=spec.tp).attention_forward_s  # fmt: skip
    mb_forward = sum(f for f, _ in blocks) + head[0]
    mb_backward = sum(b for _, b in blocks) + head[1]
    m, p, v = spec.num_microbatches, spec.pp, spec.virtual_stages
    dense, expert, root = _stage_numel(spec, share)
    owned = dense + root + expert
    if spec.dp_mode != "ddp":
        owned = (dense + root) / (
            spec.dp * spec.cp // (spec.replicas if spec.dp_mode in ("zero3", "zero3-keep") else 1)
        )
        owned += expert / spec.edp
    optimizer_bytes = stack(spec.stack).optimizer_bytes_per_param or OPTIMIZER_BYTES_PER_PARAM
    optimizer_s = optimizer_bytes * owned / (gpu.hbm_tbps * 1e12 * HBM_SHARE)
    tp_mb = _tp_exposed(spec, share)
    ep_mb = ep_exposed(spec, share)
    if ep_overlap_hides(spec):  # hidden behind the other micro-batch, slowing it
        compute = mb_forward + mb_backward
        ep_mb = max(0.0, ep_mb - compute) + min(ep_mb, compute) * collective_share_lost(gpu)
    cp_mb = ring_attention.exposed_s(spec, share, attention_s)
    p2p_mb = 0.0
    if p > 1:
        link = group_link(spec, 2, 1)
        size = spec.micro_batch * spec.seq_len / spec.cp * spec.model.hidden * 2 / spec.tp
        p2p_mb = 2 * v * (link.alpha_s + link.seconds(size))
    compute_mb = mb_forward + mb_backward
    if p == 1 and spec.dp_mode in ("zero3", "zero2"):
        mb_s, mb_exposed = _simulated_fsdp(spec, share, blocks, head)
        step = m * (mb_s + tp_mb + cp_mb + ep_mb) + optimizer_s
        bubble, dp_exposed = 0.0, m * mb_exposed
    else:
        # ZeRO-3 and ZeRO-2 under pipelining gather every micro-batch, as FSDP2's stages with
        # reshard_after_forward=True do (overlap's PipelineStage keeps its units: zero3-keep);
        # their reduction (and every other mode's exchange) is once per step
        gathers_mb = 0.0
        if spec.dp_mode in ("zero3", "zero2"):
            gathers_mb = max(0.0, _simulated_fsdp(spec, share, blocks, head, reduce=False)[0] - compute_mb)
        slot = compute_mb + gathers_mb + tp_mb + cp_mb + ep_mb + p2p_mb
        fill = (p - 1) / v
        bubble = fill * slot
        dp_exposed = m * gathers_mb + _once_per_step(spec, share, mb_forward, mb_backward)
        step = (m + fill) * slot + (dp_exposed - m * gathers_mb) + optimizer_s
    return RunPrediction(spec=spec, step_s=step, compute_s=m * compute_mb, dp_exposed_s=dp_exposed,
                         tp_exposed_s=m * tp_mb, cp_exposed_s=m * cp_mb, pp_bubble_s=bubble, p2p_s=m * p2p_mb,
                         optimizer_s=optimizer_s, ep_exposed_s=m * ep_mb, lacks=_lacks(spec))  # fmt: skip


def calibrate_compute(spec: RunSpec, measured_tokens_per_s_per_gpu: float) -> float:
    """The `compute_scale` under which `spec` predicts what was measured on it (one node, or
    the smallest size of a configuration): the kernels' seconds are scaled, the links and the
    schedule stay the model's, so other sizes and layouts keep their communication terms."""
    if not measured_tokens_per_s_per_gpu > 0:
        raise ValueError(f"measured tokens/s must be > 0, got {measured_tokens_per_s_per_gpu!r}")

    def step_s(scale: float) -> float:
        return predict_run(spec, compute_scale=scale).step_s

    target = spec.global_batch * spec.seq_len / (measured_tokens_per_s_per_gpu * spec.num_gpus)
    return solve_increasing(step_s, target, 0.05, 20.0, log=True)


def format_run(pred: RunPrediction) -> str:
    """The prediction as `overlap plan --run` prints it."""
    s, gpu = pred.spec, accelerator(pred.spec.gpu)
    m = s.model
    lines = [
        f"run        {m.num_layers} layers x {m.hidden} ({m.num_params() / 1e9:.1f} B parameters), seq {s.seq_len}, "
        f"global batch {s.global_batch}, micro-batch {s.micro_batch} ({s.num_microbatches} per step)",
        f"cluster    {s.num_gpus} x {gpu.name} on {node_spec(s.node).name}; tp {s.tp}, pp {s.pp}"
        f"{f' x {s.virtual_stages} ({s.schedule})' if s.pp > 1 else ''}, cp {s.cp}, dp {s.dp} ({s.dp_mode})"
        f"{f', ep {s.ep} (etp {s.etp}, expert dp {s.edp})' if m.moe is not None else ''}",
        f"compute    {stack(s.stack).name}, {s.precision}, activation checkpointing {s.ac}",
        f"step       {pred.step_s:.3f} s: compute {pred.compute_s:.3f} + data-parallel exposed {pred.dp_exposed_s:.3f} + "
        f"tensor {pred.tp_exposed_s:.3f} + context {pred.cp_exposed_s:.3f} + bubble {pred.pp_bubble_s:.3f} + "
        f"sends {pred.p2p_s:.3f} + experts {pred.ep_exposed_s:.3f} + optimizer {pred.optimizer_s:.3f}",
        f"tokens/s   {pred.tokens_per_s_per_gpu:,.0f} per GPU",
    ]
    lines += [f"assumes    {note}" for note in pred.lacks]
    return "\n".join(lines)


__all__ = ["RunPrediction", "calibrate_compute", "format_run", "predict_run"]
