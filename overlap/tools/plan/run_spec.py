"""A training run as it is published: model shape, hardware, every parallel degree, batch,
precision, checkpointing and software stack (`RunSpec`), the input of `run_step.predict_run`.

Every field is something a run's configuration or its hardware's datasheet states; nothing is
fitted. `overlap plan --run FILE` predicts one from JSON, and benchmarks/plan_published.py holds
the published runs as rows of this shape.

[Note: data-parallel modes]
    ddp         parameters and optimizer replicated; gradients all-reduced once per step
    zero1       optimizer state sharded (Megatron's distributed optimizer): gradients
                reduce-scattered once per step, updated parameters all-gathered once per step
    zero2       gradients sharded too; parameters gathered before each forward and kept for the
                backward (FSDP's SHARD_GRAD_OP, reshard_after_forward=False)
    zero3       parameters sharded and gathered for every forward and again for every backward
                (FSDP FULL_SHARD / FSDP2 reshard_after_forward=True): what `overlap.wrap` does
    zero3-keep  ZeRO-3 whose gathered parameters stay for the step's remaining micro-batches
                (torchtitan under pipeline parallelism: gathered once per step, reduced once)
HSDP is zero3 over a shard group with an all-reduce across replicas (`replicas`).

[Note: pipeline ranks]
A pipeline's step is paced by its slowest rank. Without a published layout every virtual stage
holds ceil(layers / (pp x v)) layers and one rank is planned, holding the last layers, the
embedding and the loss (an upper bound). With one (`pipeline_layout`, as Megatron-Bridge's
DeepSeek-V3 recipes set pipeline_model_parallel_layout, e.g. "Et*4|(t*4|)*14tmL": four decoder
layers per stage, the last stage one layer, the MTP depth and the loss) each rank holds its
stages' layers, the first the embedding, the last the output layer, its loss and the MTP depths,
and every rank is planned: the slowest sets the step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from overlap.step_model.fp8 import FP8_RECIPES, Fp8Recipe
from overlap.step_model.hardware import ACCELERATORS, NODES
from overlap.step_model.kernels import STACKS, BlockShape, Mlp, PositionEmbedding, Recompute
from overlap.step_model.moe import MoeShape
from overlap.step_model.moe_flex import FLEX_BACKENDS, FlexBackend

DpMode = Literal["ddp", "zero1", "zero2", "zero3", "zero3-keep"]
DP_MODES: tuple[DpMode, ...] = ("ddp", "zero1", "zero2", "zero3", "zero3-keep")
Schedule = Literal["1f1b", "interleaved", "gpipe"]
Dispatcher = Literal["alltoall", "flex"]
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""Megatron-Core's recompute_modules the run model prices (TransformerConfig.recompute_modules)."""
GRAPH_SCOPES = ("attn", "moe_router", "moe_preprocess")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer: what its compute and its bytes depend on. The attention
    fields after `tied_embeddings` are `BlockShape`'s (overlap/step_model/kernels.py); `moe`
    makes the MLP of its layers a mixture of experts ([Note: expert parallelism] in
    overlap/step_model/moe.py), `ffn_hidden` then being the width of its dense layers' MLP."""

    num_layers: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    mlp: Mlp = "swiglu"
    tied_embeddings: bool = False
    head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    """Tokens a sliding-window layer attends to (0: every layer attends to the whole context)."""
    sliding_layers: int = 0
    """How many of the layers use the sliding window, spread evenly (GPT-OSS: every second)."""
    position_embedding: PositionEmbedding = "rope"
    """rope, yarn (GPT-OSS: rotary with YaRN scaling, which Megatron-Bridge does not fuse) or alibi."""
    moe: MoeShape | None = None

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from JSON (RunSpec.from_dict, the published-runs file)
            object.__setattr__(self, "moe", MoeShape(**self.moe))
        if not 0 <= self.sliding_layers <= self.num_layers:
            raise ValueError(f"ModelShape.sliding_layers must be in [0, {self.num_layers}], got {self.sliding_layers}")

    def block(self, *, moe_layer: bool = False) -> BlockShape:
        """A dense layer's block, or with `moe_layer` a MoE layer's attention (no dense MLP)."""
        return BlockShape(hidden=self.hidden, ffn_hidden=0 if moe_layer else self.ffn_hidden,
                          num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, mlp=self.mlp,
                          head_dim=self.head_dim, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                          rope_head_dim=self.rope_head_dim, v_head_dim=self.v_head_dim,
                          position_embedding=self.position_embedding)  # fmt: skip

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index)

    def is_sliding_layer(self, index: int) -> bool:
        """Layer `index` attends through the sliding window (the first of every
        num_layers / sliding_layers layers)."""
        return bool(self.sliding_layers) and index % (self.num_layers // self.sliding_layers) == 0

    def layer_numel(self, index: int | None = None) -> int:
        """Parameters of layer `index` (None: a dense layer), its routed experts included."""
        if index is not None and self.is_moe_layer(index):
            assert self.moe is not None
            attention = sum(k * n for k, n in self.block(moe_layer=True).gemms())
            return attention + self.moe.dense_numel(self.hidden) + self.moe.num_experts * self.moe.expert_numel(
                self.hidden) + 2 * self.hidden  # fmt: skip
        return sum(k * n for k, n in self.block().gemms()) + 2 * self.hidden

    def expert_layer_numel(self, index: int) -> int:
        """Parameters of layer `index`'s routed experts (0 for a dense layer)."""
        if not self.is_moe_layer(index):
            return 0
        assert self.moe is not None
        return self.moe.num_experts * self.moe.expert_numel(self.hidden)

    def root_numel(self) -> int:
        return (1 if self.tied_embeddings else 2) * self.vocab_size * self.hidden + self.hidden

    def num_params(self) -> int:
        return sum(self.layer_numel(i) for i in range(self.num_layers)) + self.root_numel()


@dataclass(frozen=True, kw_only=True)
class RankShare:
    """What one pipeline rank holds ([Note: pipeline ranks])."""

    layers: tuple[int, ...]
    """Indices of its decoder layers."""
    embedding: bool
    """The input embedding sits on it (the first rank)."""
    head: bool
    """The output layer, the loss and the multi-token-prediction depths sit on it (the last rank)."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One training run, every input from its published configuration or a datasheet."""

    model: ModelShape
    gpu: str
    """A preset of `overlap.step_model.hardware.ACCELERATORS`."""
    node: str
    """A preset of `overlap.step_model.hardware.NODES` (GPUs per host, NVLink domain, rails)."""
    num_gpus: int
    seq_len: int
    global_batch: int
    """Sequences per optimizer step, all data-parallel ranks together."""
    micro_batch: int
    """Sequences one rank runs through forward and backward at once."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    replicas: int = 1
    """HSDP: replicas of the ZeRO-3 shard group (1: none)."""
    dp_mode: DpMode = "zero3"
    dp_overlap: bool = True
    """The gradient reduction (and ZeRO-1's parameter gather) overlaps the backward (forward):
    bucketed as DDP, FSDP and Megatron's --overlap-grad-reduce do. False: it runs after."""
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    precision: Literal["bf16", "fp8"] = "bf16"
    """Matmul precision: fp8 runs the blocks' GEMMs at the fp8 rate (attention stays bf16)."""
    fp8_recipe: Fp8Recipe = "tensorwise"
    """The fp8 scaling with fp8 precision: tensorwise, rowwise (torchao's, [Note: float8 recipes]
    in overlap/step_model/fp8.py), mxfp8 (Transformer Engine's MXFP8 block scaling on
    Blackwell, [Note: MXFP8] there) or current (Transformer Engine's Float8CurrentScaling,
    Megatron-Core's "tensorwise": [Note: FP8 current scaling] there)."""
    fp8_all_gather: bool = False
    """ZeRO-3 gathers fp8 weights (torchtitan's enable_fsdp_float8_all_gather)."""
    param_bytes: int = 2
    """Bytes per element of the gathered parameters (4 where FSDP gathers fp32 masters)."""
    reduce_bytes: int = 4
    """Bytes per element of the reduced gradients (fp32 in torchtitan's, Megatron's defaults)."""
    ac: Recompute = "none"
    """Activation checkpointing: none, selective (torchtitan op-level), full, or attention
    (Megatron's selective: core attention only)."""
    stack: str = "torch-eager"
    """A preset of `overlap.step_model.stacks.STACKS`: the kernels' rates and fusion."""
    async_tp: bool = False
    """Tensor-parallel collectives overlapped with the GEMMs (async TP, --tp-comm-overlap)."""
    ep: int = 1
    """Expert parallel degree: each MoE layer's routed experts split over this many ranks of the
    data-parallel (x context x, with `etp` 1, tensor) ranks, as Megatron-Core and torchtitan
    lay out their expert mesh."""
    etp: int = 1
    """Expert tensor parallel degree: 1 (experts whole on each rank, tokens from the sequence-
    parallel shard) or `tp` (experts split as the dense MLP)."""
    ep_overlap: bool = False
    """The dispatch and combine of one micro-batch run behind another's compute (Megatron-Core's
    overlap_moe_expert_parallel_comm, which merges the forward and backward of two micro-batches
    in the 1F1B steady state); False: exposed."""
    capacity_factor: float | None = None
    """Token dropping with each expert padded to capacity_factor x its balanced share; None:
    dropless (what the published MoE benchmarks run)."""
    dispatcher: Dispatcher = "alltoall"
    """Megatron-Core's moe_token_dispatcher_type: alltoall (a copy per routed expert) or flex
    (DeepEP / HybridEP: once per destination rank and node, [Note: flex dispatch] in
    overlap/step_model/moe.py)."""
    flex_backend: FlexBackend = "deepep"
    """The flex dispatcher's kernels (Megatron-Core's moe_flex_dispatcher_backend, default deepep):
    hybridep or deepep, each priced at the bandwidths its authors publish ([Note: flex kernels'
    achieved bandwidth] in overlap/step_model/moe_flex.py); ignored with the alltoall dispatcher."""
    force_load_balancing: bool = False
    """Megatron-Core's moe_router_force_load_balancing: the router draws random logits each
    forward, as every Megatron-Bridge MoE performance recipe sets ([Note: forced load balancing]
    in overlap/step_model/moe.py); ignored without experts."""
    cuda_graph_scope: tuple[str, ...] = ()
    """Parts of each layer run as CUDA graphs (Transformer Engine's cuda_graph_scope: attn,
    moe_router, moe_preprocess); the rest is launched op by op ([Note: MoE host work])."""
    recompute_num_layers: int = 0
    """Megatron-Core's recompute_num_layers with recompute_method "block": the first this many
    layers of each pipeline rank recompute their whole forward (as `ac` "full"), the others run
    `ac`. Priced for dense models without context parallelism or interleaved stages."""
    recompute_modules: tuple[str, ...] = ()
    """Megatron-Core's selective recompute_modules ([Note: recomputed modules] in run_step.py)."""
    mtp_layers: int = 0
    """Multi-token-prediction depths (Megatron-Core's mtp_num_layers), on the rank that holds the
    loss ([Note: multi-token prediction] in run_step.py)."""
    pipeline_layout: tuple[int, ...] = ()
    """Decoder layers of each virtual pipeline stage in order (Megatron-Core's
    pipeline_model_parallel_layout; the embedding on the first, the loss and the MTP depths on
    the last, rank r holding stages r, r + pp, ...). Empty: ceil(layers / (pp x v)) per stage and
    the bottleneck rank holding the last layers, the embedding and the loss ([Note: pipeline
    ranks])."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What the configuration does not publish and the row assumes, shown with the prediction."""

    def __post_init__(self) -> None:
        for name in ("cuda_graph_scope", "recompute_modules", "pipeline_layout"):  # lists from JSON
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name, allowed in (("cuda_graph_scope", GRAPH_SCOPES), ("recompute_modules", RECOMPUTE_MODULES)):
            unknown = set(getattr(self, name)) - set(allowed)
            if unknown:
                raise ValueError(f"RunSpec.{name}: unknown {sorted(unknown)}; use of {allowed}")
        if self.dispatcher not in ("alltoall", "flex"):
            raise ValueError(f"RunSpec.dispatcher must be alltoall or flex, got {self.dispatcher!r}")
        if self.flex_backend not in FLEX_BACKENDS:
            raise ValueError(f"RunSpec.flex_backend must be one of {FLEX_BACKENDS}, got {self.flex_backend!r}")
        for name in (
            "num_gpus",
            "seq_len",
            "global_batch",
            "micro_batch",
            "tp",
            "pp",
            "cp",
            "replicas",
            "virtual_stages",
            "ep",
            "etp",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RunSpec.{name} must be an int >= 1, got {value!r}")
        if self.gpu not in ACCELERATORS:
            raise ValueError(f"RunSpec.gpu: unknown {self.gpu!r}; use one of {sorted(ACCELERATORS)}")
        if self.node not in NODES:
            raise ValueError(f"RunSpec.node: unknown {self.node!r}; use one of {sorted(NODES)}")
        if self.stack not in STACKS:
            raise ValueError(f"RunSpec.stack: unknown {self.stack!r}; use one of {sorted(STACKS)}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"RunSpec.fp8_recipe must be one of {FP8_RECIPES}, got {self.fp8_recipe!r}")
        if self.fp8_recipe == "mxfp8" and ACCELERATORS[self.gpu].generation != "blackwell":
            raise ValueError(f"RunSpec.fp8_recipe mxfp8 runs on Blackwell tensor cores (SM 10.x); {self.gpu} has none")
        if self.fp8_recipe == "current" and STACKS[self.stack].fp8_casts is not None:
            raise ValueError(
                f"RunSpec.fp8_recipe current is Transformer Engine's; stack {self.stack!r} runs torchao's casts: "
                "use fp8_recipe tensorwise"
            )
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"RunSpec.dp_mode must be one of {DP_MODES}, got {self.dp_mode!r}")
        if self.num_gpus % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"RunSpec: {self.num_gpus} GPUs do not split into tp {self.tp} x pp {self.pp} x cp {self.cp}"
            )
        if self.global_batch % self.dp or (self.global_batch // self.dp) % self.micro_batch:
            raise ValueError(f"RunSpec: global batch {self.global_batch} does not split into {self.dp} data-parallel "
                             f"ranks of micro-batches of {self.micro_batch}")  # fmt: skip
        self._check_experts()
        self._check_layout()
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            raise ValueError("RunSpec: the interleaved schedule needs virtual_stages >= 2")
        if self.pp * self.virtual_stages > self.model.num_layers:
            raise ValueError(
                f"RunSpec: {self.pp * self.virtual_stages} pipeline stages for {self.model.num_layers} layers"
            )

    def _check_experts(self) -> None:
        moe = self.model.moe
        if moe is None:
            if self.ep > 1:
                raise ValueError("RunSpec: ep > 1 needs a model with MoE layers (ModelShape.moe)")
            return
        if self.etp not in (1, self.tp):
            raise ValueError(f"RunSpec.etp must be 1 or tp ({self.tp}), got {self.etp}")
        if moe.num_experts % self.ep:
            raise ValueError(f"RunSpec: {moe.num_experts} experts do not split over ep {self.ep}")
        if self.expert_ranks % self.ep:
            raise ValueError(f"RunSpec: ep {self.ep} does not divide the {self.expert_ranks} ranks the experts "
                             f"span (dp x cp{' x tp' if self.etp == 1 else ''})")  # fmt: skip
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"RunSpec.capacity_factor must be > 0 or None, got {self.capacity_factor!r}")

    def _check_layout(self) -> None:
        if not isinstance(self.mtp_layers, int) or isinstance(self.mtp_layers, bool) or self.mtp_layers < 0:
            raise ValueError(f"RunSpec.mtp_layers must be an int >= 0, got {self.mtp_layers!r}")
        n = self.recompute_num_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"RunSpec.recompute_num_layers must be an int >= 0, got {n!r}")
        if n and (self.model.moe is not None or self.cp > 1 or self.virtual_stages > 1 or self.ac == "full"):
            raise ValueError("RunSpec.recompute_num_layers is priced for dense models without context parallelism, "
                             "interleaved stages or ac 'full' (where every layer recomputes)")  # fmt: skip
        layout = self.pipeline_layout
        if not layout:
            return
        stages = self.pp * self.virtual_stages
        if len(layout) != stages or sum(layout) != self.model.num_layers or min(layout) < 0:
            raise ValueError(f"RunSpec.pipeline_layout {list(layout)} must give each of the {stages} virtual stages "
                             f"(pp x virtual_stages) its decoder layers, {self.model.num_layers} in all")  # fmt: skip

    def rank_shares(self) -> tuple[RankShare, ...]:
        """What each pipeline rank holds ([Note: pipeline ranks]); without a layout, only the
        bottleneck rank's share."""
        n = self.model.num_layers
        if not self.pipeline_layout:
            return (RankShare(layers=tuple(range(max(0, n - self.layers_per_rank), n)), embedding=True, head=True),)
        starts = [sum(self.pipeline_layout[:i]) for i in range(len(self.pipeline_layout))]
        shares = []
        for rank in range(self.pp):
            stages = range(rank, self.pp * self.virtual_stages, self.pp)
            layers = [i for s in stages for i in range(starts[s], starts[s] + self.pipeline_layout[s])]
            shares.append(RankShare(layers=tuple(layers), embedding=rank == 0, head=rank == self.pp - 1))
        return tuple(shares)

    def rank_layers(self, share: RankShare) -> tuple[int, ...]:
        """Indices of the transformer layers a rank runs ([Note: pipeline ranks]): its decoder
        layers, and on the rank of the loss one per multi-token-prediction depth, built as the
        last decoder layer is ([Note: multi-token prediction] in run_step.py). Every per-layer
        cost of a rank (blocks, collectives, context parallelism's ring) counts these."""
        return share.layers + ((self.model.num_layers - 1,) * self.mtp_layers if share.head else ())

    @property
    def expert_ranks(self) -> int:
        """Ranks of one pipeline stage the expert layout splits into ep x expert data parallel
        (Megatron-Core: ETP x EP x EDP = TP x CP x DP)."""
        return self.dp * self.cp * self.tp // self.etp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: the ranks each expert's parameters are sharded or
        replicated over (torchtitan's efsdp = dp_shard x cp / ep)."""
        return self.expert_ranks // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas included; context parallel ranks excluded)."""
        return self.num_gpus // (self.tp * self.pp * self.cp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.dp // self.micro_batch

    @property
    def layers_per_rank(self) -> int:
        stages = self.pp * self.virtual_stages
        return math.ceil(self.model.num_layers / stages) * self.virtual_stages

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("notes", "cuda_graph_scope", "recompute_modules", "pipeline_layout"):
            out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        data = dict(data)
        data["model"] = ModelShape(**data["model"])
        data["notes"] = tuple(data.get("notes", ()))
        return cls(**data)
