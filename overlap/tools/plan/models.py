"""What the planner knows about a model and a GPU: presets with their sources, and module paths.

A model reaches the planner as a `ModelProfile`: parameter counts per repeated block (the unit
candidates) and of the root (embeddings, final norm, head), forward FLOPs per token, the FLOPs
that activation checkpointing recomputes, and an estimate of activation bytes. Presets are
`TransformerShape`s (Llama-3 style: RMSNorm, grouped-query attention, SwiGLU MLP, untied head);
any other model comes as `module.path:factory`, built on the meta device and measured.

[Note: FLOPs convention]
Model FLOPs per token follow PaLM (Chowdhery et al. 2022, Appendix B): 6·N + 12·L·h·T, with N
the parameters that multiply (the embedding lookup excluded, the untied head included), L layers,
h the model width and T the sequence length; forward is a third of it (2·N + 4·L·h·T), backward
two thirds. Attention is counted in full although a causal kernel skips half of it, as PaLM
and torchtitan count it; MFU is computed from these model FLOPs. Recomputation by activation
checkpointing costs time but is not model FLOPs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from overlap.step_model.hardware import ACCELERATORS
from overlap.step_model.moe import MoeShape
from overlap.tools.plan.run_spec import ModelShape

AcPolicy = Literal["none", "selective", "full"]
AC_POLICIES: tuple[AcPolicy, ...] = ("none", "selective", "full")

SELECTIVE_RECOMPUTE_SHARE = 0.5
"""Share of a block's matmul forward FLOPs that selective (op-level) checkpointing recomputes.
torchtitan's op-level policy (torchtitan/distributed/activation_checkpoint.py, "selective_ac_option
= 'op'") saves the output of every compute-intensive op except every second `mm`, so about half of
the matmuls run twice; attention outputs are saved, norms and activations (cheap) are recomputed.
Its mm counter runs on across steps and a Llama block has seven matmuls, so the recomputed set
alternates (wk, wo, w3 one step; wq, wv, w1, w2 the next): half of the matmul FLOPs on average."""

BF16_BYTES = 2


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """A model as the planner sees it, for one sequence length and checkpointing policy."""

    name: str
    description: str
    block_numels: tuple[int, ...]
    """Parameters of each repeated block, in execution order: the units before merging."""
    root_numel: int
    """Parameters outside every block (embeddings, final norm, head): the root unit."""
    block_forward_flops: tuple[float, ...]
    """Model FLOPs per token of each block's forward (matmuls and attention)."""
    block_recompute_flops: tuple[float, ...]
    """FLOPs per token each block's backward recomputes under the checkpointing policy."""
    root_forward_flops: float
    """Model FLOPs per token of the root's forward (the head; a lookup costs none)."""
    activation_bytes_per_token: float | None
    """Estimated bytes of activations saved for backward per token (all blocks, logits, one
    block's recompute workspace); None when the planner cannot estimate it (module paths)."""
    seq_len: int
    local_batch: int
    ac: AcPolicy
    source: str = ""
    hidden: int | None = None
    """Model width (activation elements per token between blocks), what tensor and pipeline
    parallelism move; None when unknown (module paths)."""
    shape: TransformerShape | None = None
    """The preset's shape, from which the kernel model (overlap/step_model/kernels.py) prices
    each block; None for module paths (their compute comes from FLOPs at --mfu)."""
    tensor_parallel: int = 1
    """Ranks each block's matmuls are split over (a stage profile's TP degree)."""

    @property
    def num_params(self) -> int:
        return sum(self.block_numels) + self.root_numel

    @property
    def model_flops_per_token(self) -> float:
        """Forward + backward model FLOPs per token (see [Note: FLOPs convention])."""
        return 3.0 * (sum(self.block_forward_flops) + self.root_forward_flops)

    @property
    def executed_flops_per_token(self) -> float:
        """What the GPU runs per token: model FLOPs plus recomputation."""
        return self.model_flops_per_token + sum(self.block_recompute_flops)


@dataclass(frozen=True, kw_only=True)
class TransformerShape(ModelShape):
    """A Llama-3-style decoder: RMSNorm, grouped-query attention, SwiGLU MLP, untied head; the
    shape (`ModelShape`, whose parameter counts it shares) with the planner's defaults."""

    name: str
    seq_len: int
    """Default training sequence length (--seq-len overrides)."""
    local_batch: int
    """Default sequences per GPU per step (--local-batch overrides)."""
    ac: AcPolicy
    """Default activation checkpointing (--ac overrides): what fits the GPU at this batch."""
    source: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: hidden={self.hidden} must divide by num_heads={self.num_heads}, "
                f"which must divide by num_kv_heads={self.num_kv_heads}"
            )

    @property
    def kv_dim(self) -> int:
        return self.block().kv_dim

    def layer_matmul_numel(self, index: int | None = None) -> int:
        """Weights one token multiplies in layer `index` (None: a dense layer): the attention's
        and the MLP's (wq, wk, wv, wo and the SwiGLU w1, w3, w2), or in a MoE layer the router,
        the shared experts and its top-k routed experts."""
        if index is None or not self.is_moe_layer(index):
            return sum(k * n for k, n in self.block().gemms())
        assert self.moe is not None
        attention = sum(k * n for k, n in self.block(moe_layer=True).gemms())
        return attention + self.moe.dense_numel(self.hidden) + self.moe.top_k * self.moe.expert_numel(self.hidden)

    def _mlp_width(self, index: int) -> int:
        """Hidden activations per token of layer `index`'s MLP (a MoE layer's: top-k routed
        experts and the shared ones)."""
        if not self.is_moe_layer(index):
            return self.ffn_hidden
        assert self.moe is not None
        return self.moe.top_k * self.moe.expert_ffn_hidden + self.moe.shared_ffn_hidden

    def layer_activation_elems(self, ac: AcPolicy, index: int | None = None) -> int:
        """Elements per token one block keeps for backward (an estimate, see below).

        Without checkpointing: block input, norm output, q/k/v, attention output (flash attention
        keeps no score matrix), MLP input and norm output, w1 and w3 outputs, SiLU output and the
        product fed to w2: 6h + 2·kv + 4f. Selective (op-level): the block input and attention
        output plus every second matmul output (half of q, k, v, wo, w1, w3, w2 outputs). Full: the
        block input only.
        """
        h, kv, f = self.hidden, self.kv_dim, self.ffn_hidden if index is None else self._mlp_width(index)
        if ac == "none":
            return 6 * h + 2 * kv + 4 * f
        if ac == "selective":
            return 2 * h + (3 * h + 2 * kv + 2 * f) // 2
        return h

    def profile(
        self, seq_len: int | None = None, local_batch: int | None = None, ac: AcPolicy | None = None
    ) -> ModelProfile:
        """The planner's view at a sequence length, batch and checkpointing policy (None: the
        shape's defaults)."""
        seq = self.seq_len if seq_len is None else seq_len
        batch = self.local_batch if local_batch is None else local_batch
        ac = self.ac if ac is None else ac
        _check_positive(seq=seq, local_batch=batch)
        if ac not in AC_POLICIES:
            raise ValueError(f"ac must be one of {AC_POLICIES}, got {ac!r}")
        layers = range(self.num_layers)
        attention = [4.0 * self.block().attention_width * seq] * self.num_layers  # QK^T and AV per token
        matmul = [2.0 * self.layer_matmul_numel(i) for i in layers]
        recompute = [{"none": 0.0, "selective": SELECTIVE_RECOMPUTE_SHARE * mm, "full": mm + at}[ac]
                     for mm, at in zip(matmul, attention, strict=True)]  # fmt: skip
        logits_bytes = self.vocab_size * (BF16_BYTES + 4)  # bf16 logits + their fp32 copy for the loss
        workspace = max(self.layer_activation_elems("none", i) for i in layers) if ac != "none" else 0
        act_elems = sum(self.layer_activation_elems(ac, i) for i in layers) + workspace
        moe = self.moe
        experts = f", {moe.num_experts} experts top {moe.top_k} of width {moe.expert_ffn_hidden}" if moe else ""
        return ModelProfile(
            name=self.name,
            description=(
                f"{self.num_layers} layers, hidden {self.hidden}, ffn {self.ffn_hidden}, "
                f"{self.num_heads} heads / {self.num_kv_heads} kv, vocab {self.vocab_size}{experts}"
            ),
            block_numels=tuple(self.layer_numel(i) for i in layers),
            root_numel=self.root_numel(),
            block_forward_flops=tuple(mm + at for mm, at in zip(matmul, attention, strict=True)),
            block_recompute_flops=tuple(recompute),
            root_forward_flops=2.0 * self.vocab_size * self.hidden,
            activation_bytes_per_token=act_elems * BF16_BYTES + logits_bytes,
            seq_len=seq,
            local_batch=batch,
            ac=ac,
            source=self.source,
            hidden=self.hidden,
            shape=self,
        )


# Llama 3 shapes: "The Llama 3 Herd of Models" (Dubey et al. 2024, arXiv:2407.21783), Table 3
# (layers, model dimension, FFN dimension, attention heads, key/value heads; vocabulary 128K),
# and the released params.json / Hugging Face config.json of meta-llama/Meta-Llama-3-8B and -70B
# (vocab_size 128256, intermediate_size 14336 / 28672). Sequence length 8192 is the pre-training
# context of Llama 3 (same paper, Section 3.4) and torchtitan's llama3 training configs; local
# batch 2 with selective AC is torchtitan's published 8B FSDP benchmark (docs/performance.md);
# 70B at local batch 1 needs full AC to fit 80 GB (torchtitan trains it so, same page); 405B
# (126 layers, 16384, FFN 53248, 128 / 8 heads) is trained with full AC in torchtitan's 3-D runs.
# fmt: off
MODELS: dict[str, TransformerShape] = {
    "llama-8b": TransformerShape(
        name="llama-8b", num_layers=32, hidden=4096, ffn_hidden=14336, num_heads=32,
        num_kv_heads=8, vocab_size=128256, seq_len=8192, local_batch=2, ac="selective",
        source="Llama 3 paper (arXiv:2407.21783) Table 3; meta-llama/Meta-Llama-3-8B config.json",
    ),
    "llama-70b": TransformerShape(
        name="llama-70b", num_layers=80, hidden=8192, ffn_hidden=28672, num_heads=64,
        num_kv_heads=8, vocab_size=128256, seq_len=8192, local_batch=1, ac="full",
        source="Llama 3 paper (arXiv:2407.21783) Table 3; meta-llama/Meta-Llama-3-70B config.json",
    ),
    "llama-405b": TransformerShape(
        name="llama-405b", num_layers=126, hidden=16384, ffn_hidden=53248, num_heads=128,
        num_kv_heads=8, vocab_size=128256, seq_len=8192, local_batch=1, ac="full",
        source="Llama 3 paper (arXiv:2407.21783) Table 3; meta-llama/Llama-3.1-405B config.json",
    ),
    # Mixture-of-experts shapes, each from its released config.json on Hugging Face (layers,
    # hidden_size, the dense layers' intermediate_size, heads / key-value heads and head_dim,
    # vocab_size; experts, experts per token, the experts' moe_intermediate_size, shared experts,
    # first_k_dense_replace / interleave step). Defaults: torchtitan's DeepSeek-V3 and Llama 4
    # training configs (sequence 4096 / 8192, full AC where a layer's experts fill the GPU).
    "deepseek-v3": TransformerShape(
        name="deepseek-v3", num_layers=61, hidden=7168, ffn_hidden=18432, num_heads=128, num_kv_heads=128,
        vocab_size=129280, head_dim=128, q_lora_rank=1536, kv_lora_rank=512, rope_head_dim=64, v_head_dim=128,
        moe=MoeShape(num_experts=256, top_k=8, expert_ffn_hidden=2048, shared_ffn_hidden=2048, dense_layers=3, groups=8,
                     group_topk=4),
        seq_len=4096, local_batch=1, ac="full",
        source="deepseek-ai/DeepSeek-V3 config.json (MLA, 256 routed experts top 8, 1 shared, 3 dense layers first)",
    ),
    "mixtral-8x7b": TransformerShape(
        name="mixtral-8x7b", num_layers=32, hidden=4096, ffn_hidden=14336, num_heads=32, num_kv_heads=8,
        vocab_size=32000, moe=MoeShape(num_experts=8, top_k=2, expert_ffn_hidden=14336),
        seq_len=4096, local_batch=1, ac="full",
        source="mistralai/Mixtral-8x7B-v0.1 config.json (8 experts top 2, width 14336)",
    ),
    "qwen3-30b-a3b": TransformerShape(
        name="qwen3-30b-a3b", num_layers=48, hidden=2048, ffn_hidden=6144, num_heads=32, num_kv_heads=4,
        vocab_size=151936, head_dim=128, moe=MoeShape(num_experts=128, top_k=8, expert_ffn_hidden=768),
        seq_len=4096, local_batch=1, ac="selective",
        source="Qwen/Qwen3-30B-A3B config.json (128 experts top 8, width 768, heads of 128)",
    ),
    "qwen3-235b-a22b": TransformerShape(
        name="qwen3-235b-a22b", num_layers=94, hidden=4096, ffn_hidden=12288, num_heads=64, num_kv_heads=4,
        vocab_size=151936, head_dim=128, moe=MoeShape(num_experts=128, top_k=8, expert_ffn_hidden=1536),
        seq_len=4096, local_batch=1, ac="full",
        source="Qwen/Qwen3-235B-A22B config.json (128 experts top 8, width 1536, heads of 128)",
    ),
    "llama4-scout": TransformerShape(
        name="llama4-scout", num_layers=48, hidden=5120, ffn_hidden=16384, num_heads=40, num_kv_heads=8,
        vocab_size=202048, head_dim=128,
        moe=MoeShape(num_experts=16, top_k=1, expert_ffn_hidden=8192, shared_ffn_hidden=8192),
        seq_len=8192, local_batch=1, ac="full",
        source="meta-llama/Llama-4-Scout-17B-16E config.json (16 experts top 1 + 1 shared, width 8192; "
        "chunked attention of 8192 equals the full context here)",
    ),
    "llama4-maverick": TransformerShape(
        name="llama4-maverick", num_layers=48, hidden=5120, ffn_hidden=16384, num_heads=40, num_kv_heads=8,
        vocab_size=202048, head_dim=128,
        moe=MoeShape(num_experts=128, top_k=1, expert_ffn_hidden=8192, shared_ffn_hidden=8192, every=2),
        seq_len=8192, local_batch=1, ac="full",
        source="meta-llama/Llama-4-Maverick-17B-128E config.json (128 experts top 1 + 1 shared on every "
        "second layer, interleave_moe_layer_step 2)",
    ),
}
# fmt: on


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator: dense bf16 peak, memory and its bandwidth (datasheet figures)."""

    name: str
    peak_tflops: float
    """Dense (no sparsity) bf16 tensor-core TFLOPs: half the datasheet's "with sparsity" figure."""
    hbm_gib: float
    """Memory as the datasheet states it ("80 GB"); nvidia-smi reports about that many GiB."""
    hbm_tbps: float
    source: str
    accelerator: str = ""
    """Its preset in `overlap.step_model.hardware.ACCELERATORS` (GEMM shares, SMs, NVLink), which
    the kernel model prices compute with."""


# fmt: off
_SXM_SHEET = "NVIDIA {} Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity, {}"
GPUS: dict[str, GpuSpec] = {
    "h100-sxm":  GpuSpec(name="H100 SXM",          peak_tflops=989.4, hbm_gib=80,  hbm_tbps=3.35,  accelerator="h100-sxm",       source=_SXM_SHEET.format("H100", "80 GB HBM3, 3.35 TB/s")),
    "h100-96gb": GpuSpec(name="H100 96GB (500 W)", peak_tflops=989.4, hbm_gib=96,  hbm_tbps=2.4,   accelerator="h100-96gb-500w", source="torchtitan docs/performance.md (Grand Teton hosts): H100 with 96 GB HBM2e at 2.4 TB/s, 500 W power limit; peak taken from the H100 SXM datasheet (the power limit may lower sustained clocks)"),
    "h200":      GpuSpec(name="H200 SXM",          peak_tflops=989.4, hbm_gib=141, hbm_tbps=4.8,   accelerator="h200",           source=_SXM_SHEET.format("H200", "141 GB HBM3e, 4.8 TB/s")),
    "a100-80gb": GpuSpec(name="A100 SXM 80GB",     peak_tflops=312.0, hbm_gib=80,  hbm_tbps=2.039, accelerator="a100-80gb",      source="NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense, 80 GB HBM2e, 2,039 GB/s"),
    **{key: GpuSpec(name=a.name, peak_tflops=a.bf16_tflops, hbm_gib=a.hbm_gib, hbm_tbps=a.hbm_tbps, accelerator=key, source=a.source)
       for key, a in ACCELERATORS.items() if key in ("a100-40gb", "b200", "gb200")},
}
# fmt: on

DEFAULT_MFU = 0.40
"""Achieved share of peak for the compute kernels of a model the kernel model cannot price (a
module path: no shape), when neither --mfu nor --tflops is given; preset models are priced by
overlap/step_model/kernels.py instead. Source: "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4: 38-43% BF16 MFU
training Llama 3 405B on 8K-16K H100s; 0.40 is the middle of that range. It is an independent
figure: nothing here is fitted to a throughput we compare against."""


def gpu_spec(name: str) -> GpuSpec:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; use one of {sorted(GPUS)}") from None


def load_model(
    name: str, seq_len: int | None = None, local_batch: int | None = None, ac: AcPolicy | None = None
) -> ModelProfile:
    """A preset name (see `MODELS`) or `package.module:attr`, where attr is a TransformerShape,
    an nn.Module, or a callable taking no arguments that returns either (built on meta)."""
    if name in MODELS:
        return MODELS[name].profile(seq_len, local_batch, ac)
    if ":" not in name:
        raise ValueError(
            f"unknown model {name!r}; use a preset ({', '.join(sorted(MODELS))}) or a module path "
            "'package.module:factory' whose factory returns an nn.Module"
        )
    module_name, _, attr = name.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {name!r}: cannot import {attr!r} from {module_name!r} ({exc})") from exc
    if callable(obj) and not isinstance(obj, nn.Module):
        try:
            with torch.device("meta"):  # shapes only: no memory, no initialization cost
                obj = obj()
        except TypeError as exc:
            raise ValueError(
                f"--model {name!r}: {attr} must take no arguments (wrap it in a factory "
                f"function that builds the model) ({exc})"
            ) from exc
    if isinstance(obj, TransformerShape):
        return obj.profile(seq_len, local_batch, ac)
    if isinstance(obj, nn.Module):
        if seq_len is None or local_batch is None:
            raise ValueError(f"--model {name!r} is a module path: give --seq-len and --local-batch")
        return profile_module(obj, name, seq_len, local_batch, "selective" if ac is None else ac)
    raise ValueError(f"--model {name!r}: expected an nn.Module or a TransformerShape, got {type(obj).__name__}")


def profile_module(
    model: nn.Module, name: str, seq_len: int, local_batch: int, ac: AcPolicy = "selective"
) -> ModelProfile:
    """Profile an arbitrary module: its units as the "auto" policy finds them (the repeated
    blocks), 2 FLOPs per weight per token for everything but embedding lookups. Attention FLOPs
    and activations are unknown without shapes and are left out (stated in the output)."""
    from overlap.engine.units import find_unit_modules

    _check_positive(seq=seq_len, local_batch=local_batch)
    if ac not in AC_POLICIES:
        raise ValueError(f"ac must be one of {AC_POLICIES}, got {ac!r}")
    blocks = find_unit_modules(model, "auto")
    if not blocks:
        raise ValueError(
            f"--model {name!r}: no repeated blocks found (a ModuleList/Sequential of two or more "
            "modules of one class); the planner needs them as units"
        )
    modules = dict(model.named_modules())
    block_numels = tuple(sum(p.numel() for p in modules[fqn].parameters()) for fqn in blocks)
    total = sum(p.numel() for p in model.parameters())
    lookups = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    root = total - sum(block_numels)
    recompute_share = {"none": 0.0, "selective": SELECTIVE_RECOMPUTE_SHARE, "full": 1.0}[ac]
    return ModelProfile(
        name=name,
        description=f"{len(blocks)} blocks of {block_numels[0]:,} parameters (module path; "
        "attention FLOPs and activations not estimated)",
        block_numels=block_numels,
        root_numel=root,
        block_forward_flops=tuple(2.0 * n for n in block_numels),
        block_recompute_flops=tuple(recompute_share * 2.0 * n for n in block_numels),
        root_forward_flops=2.0 * max(root - lookups, 0),
        activation_bytes_per_token=None,
        seq_len=seq_len,
        local_batch=local_batch,
        ac=ac,
        source=f"measured from {name} on the meta device",
    )


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
