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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from overlap.step_model.hardware import ACCELERATORS, NODES
from overlap.step_model.kernels import FP8_RECIPES, STACKS, BlockShape, Fp8Recipe, Mlp, Recompute

DpMode = Literal["ddp", "zero1", "zero2", "zero3", "zero3-keep"]
DP_MODES: tuple[DpMode, ...] = ("ddp", "zero1", "zero2", "zero3", "zero3-keep")
Schedule = Literal["1f1b", "interleaved", "gpipe"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer: what its compute and its bytes depend on."""

    num_layers: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    mlp: Mlp = "swiglu"
    tied_embeddings: bool = False

    def block(self) -> BlockShape:
        return BlockShape(hidden=self.hidden, ffn_hidden=self.ffn_hidden, num_heads=self.num_heads,
                          num_kv_heads=self.num_kv_heads, mlp=self.mlp)  # fmt: skip

    def layer_numel(self) -> int:
        return sum(k * n for k, n in self.block().gemms()) + 2 * self.hidden

    def root_numel(self) -> int:
        return (1 if self.tied_embeddings else 2) * self.vocab_size * self.hidden + self.hidden

    def num_params(self) -> int:
        return self.num_layers * self.layer_numel() + self.root_numel()


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
    """torchao's float8 scaling with fp8 precision: tensorwise or rowwise ([Note: float8 recipes]
    in overlap/step_model/kernels.py)."""
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
    """A preset of `overlap.step_model.kernels.STACKS`: the kernels' rates and fusion."""
    async_tp: bool = False
    """Tensor-parallel collectives overlapped with the GEMMs (async TP, --tp-comm-overlap)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What the configuration does not publish and the row assumes, shown with the prediction."""

    def __post_init__(self) -> None:
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
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"RunSpec.dp_mode must be one of {DP_MODES}, got {self.dp_mode!r}")
        if self.num_gpus % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"RunSpec: {self.num_gpus} GPUs do not split into tp {self.tp} x pp {self.pp} x cp {self.cp}"
            )
        if self.global_batch % self.dp or (self.global_batch // self.dp) % self.micro_batch:
            raise ValueError(f"RunSpec: global batch {self.global_batch} does not split into {self.dp} data-parallel "
                             f"ranks of micro-batches of {self.micro_batch}")  # fmt: skip
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            raise ValueError("RunSpec: the interleaved schedule needs virtual_stages >= 2")
        if self.pp * self.virtual_stages > self.model.num_layers:
            raise ValueError(
                f"RunSpec: {self.pp * self.virtual_stages} pipeline stages for {self.model.num_layers} layers"
            )

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
        out["notes"] = list(self.notes)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        data = dict(data)
        data["model"] = ModelShape(**data["model"])
        data["notes"] = tuple(data.get("notes", ()))
        return cls(**data)
