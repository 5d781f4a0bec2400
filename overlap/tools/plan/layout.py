"""Tensor and pipeline parallelism as the planner sees them: the layout of the three groups on
the nodes, the link each group's traffic crosses, and the closed-form costs the FSDP simulator
does not replay (tensor-parallel collectives, pipeline sends, the pipeline bubble).

`overlap plan --tp T --pp P` splits `--gpus N` into P pipeline stages of T·D GPUs, D = N/(T·P)
data-parallel ranks each. overlap shards over D; the FSDP step of one rank (its stage's layers,
1/T of their parameters, one micro-batch) still runs through the simulator
(overlap/tools/plan/parallel.py puts the pieces together).

[Note: 3-D layout]
Ranks are numbered as torchtitan's mesh ["pp", "dp", "tp"] numbers them (tp innermost):
    rank = pp_index·(D·T) + dp_index·T + tp_index
so a tensor-parallel group is T consecutive ranks, inside one node (T must divide the GPUs per
node: a tensor-parallel all-gather per layer over the inter-node link is refused, not planned).
A data-parallel group takes every T-th rank over D·T consecutive ranks: it stays inside a node
while D·T <= GPUs per node (NVLink) and crosses nodes otherwise, each GPU's ring on its own NIC
(one NIC per GPU, as the link presets assume), with GPUs-per-node/T of its ranks per node. Pipeline
neighbours sit D·T ranks apart: on the inter-node link as soon as the world spans nodes.

[Note: tensor-parallel collectives]
We model torchtitan's plan: Megatron-style column/row-parallel attention and MLP with sequence
parallelism on the norms. Per transformer block and micro-batch, forward: an all-gather of the
sequence-sharded activations before attention and before the MLP, a reduce-scatter after `wo` and
after `w2`; backward: the transposes (2 reduce-scatters + 2 all-gathers). Each moves the full
activation, S = micro-batch · seq · hidden · 2 bytes (bf16), costed as a ring over T ranks on the
intra-node link; the same bytes as Megatron's 2 + 2 all-reduces without sequence parallelism.
Recomputation replays the forward's collectives: all four under full AC, the two all-gathers under
selective AC (torchtitan's op-level policy saves reduce-scatter outputs). The root adds one
collective each way at the embedding and one at the head (loss parallel). They are exposed: the
default TP issues them inline, between the matmuls that need them. `--async-tp` counts them as
hidden behind the matmuls (their busy time stays in the report); torchtitan measured +5.7% from
async TP on 70B (Table 4 of docs/performance.md), so fully hidden is the optimistic bound.

[Note: pipeline step]
With M micro-batches and P stages, v stages per rank (interleaved; 1 for 1F1B and GPipe), a
rank's step is
    (M + (P-1)/v) · t_mb + reduce tail + optimizer
t_mb: one micro-batch through the rank's layers (the simulator's FSDP forward and backward
without reduction, plus exposed TP collectives, plus the activation send and the gradient send
of each of its v stages). The bubble is (P-1)/v of those slots: a share (P-1)/v / (M + (P-1)/v)
of the step, (P-1)/(M+P-1) for 1F1B and GPipe (Narayanan et al. 2021, arXiv:2104.04473). The
reduce tail is the extra time of the one micro-batch that reduces: our PipelineStage reduces once
per step ([Note: gradients reduced once per pipeline step] in overlap/integrations/pipelining.py)
and keeps its units gathered from the first micro-batch to the last ([Note: retained across
micro-batches] in overlap/engine/unit_state.py) when all of them fit
`max_inflight_allgather_bytes` (always without a cap): then only the first micro-batch gathers,
t_mb is the mean of that micro-batch and M-1 that only compute, and every unit of the stage is
held. Past the cap every micro-batch gathers (each forward and, with reshard_after_forward, each
backward), as FSDP2's stages with reshard_after_forward=True do.
The bottleneck rank is planned: ceil(layers / (P·v)) layers per stage, and the root's compute
and parameters (embeddings and head, which sit on the first and last stages) counted on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from overlap.step_model.cost import Link, Topology, ring_time_s
from overlap.tools.plan.models import AcPolicy, ModelProfile

PpSchedule = Literal["1f1b", "gpipe", "interleaved"]
PP_SCHEDULES: tuple[PpSchedule, ...] = ("1f1b", "gpipe", "interleaved")
ACTIVATION_BYTES = 2  # bf16 activations on the wire
BLOCK_TP_COLLECTIVES = {"forward": 4, "backward": 4}
"""Per block and micro-batch, sequence parallel: 2 all-gathers + 2 reduce-scatters each way."""
RECOMPUTED_TP_COLLECTIVES: dict[AcPolicy, int] = {"none": 0, "selective": 2, "full": 4}
ROOT_TP_COLLECTIVES = 4
"""Embedding output (reduce-scatter forward, all-gather backward) and head input (all-gather
forward, reduce-scatter backward, loss parallel)."""


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Tensor and pipeline parallel degrees of a plan (both 1: plain FSDP over every GPU)."""

    tp: int = 1
    """Tensor-parallel degree: GPUs of one node that split every matmul."""
    pp: int = 1
    """Pipeline-parallel degree: ranks along a pipeline, each holding `virtual_stages` stages."""
    microbatches: int | None = None
    """Micro-batches per step with pp > 1; None: pp (torchtitan's default). They split the
    local batch, which must divide by them."""
    pp_schedule: PpSchedule = "1f1b"
    virtual_stages: int = 1
    """Stages per rank: 1 for 1f1b and gpipe, >= 2 for interleaved."""
    async_tp: bool = False
    """Count the tensor-parallel collectives as hidden behind the matmuls ([Note: tensor-parallel
    collectives]); False: exposed, as torchtitan's default TP runs them."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        if self.microbatches is not None:
            if not isinstance(self.microbatches, int) or self.microbatches < 1:
                raise ValueError(f"--microbatches must be an int >= 1, got {self.microbatches!r}")
            if self.pp == 1:
                raise ValueError("--microbatches splits the batch between pipeline stages: give --pp > 1")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"--pp-schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        if self.pp_schedule == "interleaved" and self.virtual_stages < 2:
            raise ValueError("--pp-schedule interleaved needs --virtual-stages >= 2 (stages per rank)")
        if self.pp_schedule != "interleaved" and self.virtual_stages != 1:
            raise ValueError(f"--virtual-stages {self.virtual_stages} needs --pp-schedule interleaved")

    @property
    def enabled(self) -> bool:
        return self.tp > 1 or self.pp > 1

    @property
    def num_microbatches(self) -> int:
        return self.pp if self.microbatches is None else self.microbatches

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Share of a pipeline step the bubble takes ([Note: pipeline step])."""
    fill = (pp - 1) / virtual_stages
    return fill / (microbatches + fill)


def in_flight_microbatches(dims: ParallelDims) -> float:
    """Micro-batches whose activations the first stage holds at its peak, in units of one
    stage's activations: all M under GPipe, min(M, P) under 1F1B, and under interleaved 1F1B that
    times 1 + (P-1)/(P·v) (Korthikanti et al. 2022, arXiv:2205.05198)."""
    m, p, v = dims.num_microbatches, dims.pp, dims.virtual_stages
    if dims.pp == 1:
        return 1.0
    if dims.pp_schedule == "gpipe":
        return float(m)
    held = float(min(m, p))
    return held * (1 + (p - 1) / (p * v)) if dims.pp_schedule == "interleaved" else held


@dataclass(frozen=True)
class Layout:
    """Where the groups of one plan sit ([Note: 3-D layout])."""

    dims: ParallelDims
    num_gpus: int
    gpus_per_node: int
    dp: int
    """Data-parallel degree: the ranks overlap shards over."""
    dp_ranks_per_node: int
    """Ranks of one data-parallel group inside one node."""
    dp_link: Link
    tp_link: Link
    pp_link: Link

    @property
    def dp_crosses_nodes(self) -> bool:
        return self.dp > self.dp_ranks_per_node


def data_parallel_degree(dims: ParallelDims, num_gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(D, data-parallel ranks per node) of `dims` on `num_gpus`; ValueError naming the fix when
    the GPUs cannot be laid out so."""
    tp, pp = dims.tp, dims.pp
    if num_gpus % (tp * pp):
        raise ValueError(
            f"--gpus {num_gpus} is not divisible by --tp {tp} x --pp {pp} = {tp * pp}: the data-parallel "
            "degree is gpus / (tp x pp)"
        )
    if tp > gpus_per_node or gpus_per_node % tp:
        raise ValueError(
            f"--tp {tp} must divide --gpus-per-node {gpus_per_node}: tensor-parallel collectives run "
            "every layer and are planned on the intra-node link only"
        )
    dp = num_gpus // (tp * pp)
    per_node = min(dp, gpus_per_node // tp)
    if dp > per_node and dp % per_node:
        raise ValueError(
            f"data-parallel degree {dp} (--gpus {num_gpus} / (tp {tp} x pp {pp})) does not fill whole "
            f"nodes of {per_node} data-parallel ranks (gpus-per-node {gpus_per_node} / tp {tp}); "
            "choose counts that do"
        )
    return dp, per_node


def fits_layout(dims: ParallelDims, num_gpus: int, gpus_per_node: int) -> bool:
    try:
        data_parallel_degree(dims, num_gpus, gpus_per_node)
    except ValueError:
        return False
    return True


def make_layout(dims: ParallelDims, num_gpus: int, gpus_per_node: int, intra: Link, inter: Link) -> Layout:
    """The layout of `dims` on `num_gpus` GPUs ([Note: 3-D layout])."""
    dp, per_node = data_parallel_degree(dims, num_gpus, gpus_per_node)
    dp_link = inter if dp > per_node else intra
    pp_link = inter if num_gpus > gpus_per_node else intra
    return Layout(dims, num_gpus, gpus_per_node, dp, per_node, dp_link, intra, pp_link)


def layers_per_rank(num_layers: int, dims: ParallelDims) -> int:
    """Blocks on the bottleneck rank: its v stages of ceil(layers / (P·v)) each."""
    if dims.num_stages > num_layers:
        raise ValueError(f"--pp {dims.pp} x --virtual-stages {dims.virtual_stages} stages for {num_layers} layers: "
                         "every stage needs at least one layer")  # fmt: skip
    return math.ceil(num_layers / dims.num_stages) * dims.virtual_stages


def microbatch_size(local_batch: int, dims: ParallelDims) -> int:
    m = dims.num_microbatches
    if local_batch % m:
        raise ValueError(
            f"--local-batch {local_batch} (sequences per data-parallel rank) does not split into "
            f"--microbatches {m}; give a local batch divisible by it"
        )
    return local_batch // m


def stage_profile(profile: ModelProfile, dims: ParallelDims) -> ModelProfile:
    """The bottleneck rank's share of `profile` for one micro-batch: its layers, 1/T of every
    parameter and FLOP (blocks rounded up, so that merging k of them still reaches k global
    blocks' min_unit_numel / T), the root kept ([Note: pipeline step]). Activations: see
    `parallel.py`."""
    k = layers_per_rank(len(profile.block_numels), dims)
    tp = dims.tp
    return replace(
        profile,
        name=f"{profile.name} (tp {tp}, pp {dims.pp}: one rank)",
        block_numels=tuple(math.ceil(n / tp) for n in profile.block_numels[:k]),
        root_numel=math.ceil(profile.root_numel / tp),
        block_forward_flops=tuple(f / tp for f in profile.block_forward_flops[:k]),
        block_recompute_flops=tuple(f / tp for f in profile.block_recompute_flops[:k]),
        root_forward_flops=profile.root_forward_flops / tp,
        local_batch=microbatch_size(profile.local_batch, dims),
        tensor_parallel=tp,
    )


@dataclass(frozen=True)
class TpCost:
    """Tensor-parallel collectives of one micro-batch on one rank."""

    num_collectives: int
    busy_s: float
    exposed_s: float
    bytes_each: float


def tp_cost(profile: ModelProfile, dims: ParallelDims, layout: Layout, num_layers: int, microbatch: int) -> TpCost:
    """[Note: tensor-parallel collectives] for `num_layers` blocks and the root."""
    if dims.tp == 1:
        return TpCost(0, 0.0, 0.0, 0.0)
    if profile.hidden is None:
        raise ValueError(f"--tp needs the model's hidden size: {profile.name} is a module path; use a preset "
                         "or a TransformerShape")  # fmt: skip
    size = microbatch * profile.seq_len * profile.hidden * ACTIVATION_BYTES
    per_block = (
        BLOCK_TP_COLLECTIVES["forward"] + BLOCK_TP_COLLECTIVES["backward"] + RECOMPUTED_TP_COLLECTIVES[profile.ac]
    )
    count = num_layers * per_block + ROOT_TP_COLLECTIVES
    topo = Topology(dims.tp, dims.tp, layout.tp_link, layout.tp_link)
    busy = count * ring_time_s("all_gather", size, topo)  # a reduce-scatter costs the same
    return TpCost(count, busy, 0.0 if dims.async_tp else busy, size)


def p2p_s(profile: ModelProfile, dims: ParallelDims, layout: Layout, microbatch: int) -> float:
    """Exposed seconds of one micro-batch's pipeline sends on one rank: per stage it holds, the
    activations forward and their gradient backward, each 1/T of micro-batch · seq · hidden (the
    sequence-parallel shard), alpha + bytes / busbw on the link between stages."""
    if dims.pp == 1:
        return 0.0
    if profile.hidden is None:
        raise ValueError(f"--pp needs the model's hidden size: {profile.name} is a module path; use a preset "
                         "or a TransformerShape")  # fmt: skip
    size = microbatch * profile.seq_len * profile.hidden * ACTIVATION_BYTES / dims.tp
    link = layout.pp_link
    return 2 * dims.virtual_stages * (link.alpha_s + link.seconds(size))


@dataclass(frozen=True)
class ParallelBreakdown:
    """The tensor/pipeline terms of a planned step ([Note: pipeline step]); seconds per step
    unless the name says per micro-batch."""

    layout: Layout
    layers_per_rank: int
    microbatch_size: int
    """Sequences per micro-batch (the local batch of a data-parallel rank / micro-batches)."""
    microbatch_s: float
    """t_mb: one micro-batch on the bottleneck rank (FSDP forward+backward without reduction,
    exposed TP collectives, pipeline sends)."""
    fsdp_microbatch_s: float
    """The simulator's forward+backward of one micro-batch that does not reduce, averaged over
    the micro-batches (only the first gathers when the stage keeps its units)."""
    reduce_tail_s: float
    """What the micro-batch that reduces adds (its reduce-scatters' exposed part)."""
    tp: TpCost
    """Per micro-batch."""
    p2p_microbatch_s: float
    bubble_s: float

    @property
    def bubble_fraction(self) -> float:
        d = self.layout.dims
        return bubble_fraction(d.pp, d.num_microbatches, d.virtual_stages)
