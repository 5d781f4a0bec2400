"""`overlap bench step`'s workload: its config, the models (W1, gpt), their units, batch and loss.

Split out of overlap/tools/bench/step.py, whose docstring describes the benchmark as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from overlap.tools.bench import peers
from overlap.tools.bench.link import LinkSpec
from overlap.tools.bench.peers import parse_overrides
from overlap.tools.models.gpt import GPT, GPTConfig

ModelName = Literal["w1", "gpt"]
MODELS: tuple[ModelName, ...] = get_args(ModelName)
DEFAULT_CONTENDERS = ("overlap", "fsdp2", "fsdp2-tuned", "ddp", "floor-compute", "floor-compute||comm")
ALL_CONTENDERS = DEFAULT_CONTENDERS + peers.PEERS


GPT_CORPUS_BYTES = 2**20
"""The gpt batch is cut from this much stdlib text: plenty for a fixed batch, read in a blink."""

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True, kw_only=True)
class StepBenchConfig:
    """One side-by-side comparison. Defaults are W1 on 2 ranks: a few minutes on 2 CPU cores."""

    model: ModelName = "w1"
    contenders: tuple[str, ...] = DEFAULT_CONTENDERS
    overlap_configs: tuple[str, ...] = ()
    """Extra overlap contenders, one per "key=value[,key=value]" of OverlapConfig overrides."""
    rounds: int = 3
    steps: int = 6
    """Timed steps per contender per round."""
    layers: int = 8
    dim: int = 512
    heads: int = 8
    ff: int = 2048
    """W1's feed-forward width (gpt: always 4 x dim)."""
    batch: int = 4
    """Sequences per rank per step."""
    seq: int = 128
    lr: float = 1e-4
    seed: int = 0
    nproc: tuple[int, ...] = (2,)
    """World sizes, one spawned world each, run in this order."""
    threads: int = 1
    """Torch threads per rank."""
    keep_freed_memory: bool = True
    """Apply overlap's CPU allocator setting to every contender (see [Note: one allocator ...] in
    step_protocol.py)."""
    memory: bool = True
    """Measure each contender's peak RSS in a fresh world of its own (see step.py's docstring)."""
    memory_repeats: int = 1
    """Fresh worlds per contender in the memory pass (taken in turn); the medians are reported."""
    timeout_s: float = 300.0
    """Process-group timeout: a hung collective fails after this long."""
    link: str | None = None
    """Emulated link for every world, e.g. "1gbit" or "1gbit,200us" (overlap.tools.bench.link)."""
    json_path: str | None = None

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"StepBenchConfig.model: {self.model!r} is not one of {MODELS}")
        unknown = sorted(set(self.contenders) - set(ALL_CONTENDERS))
        if unknown or not self.contenders:
            raise ValueError(
                f"StepBenchConfig.contenders: unknown {unknown}; choose from {ALL_CONTENDERS}"
            )
        if min(self.rounds, self.steps, self.memory_repeats) < 1:
            raise ValueError("StepBenchConfig: rounds, steps and memory_repeats must be >= 1")
        if min(self.layers, self.dim, self.heads, self.ff, self.batch, self.seq, self.threads) < 1:
            raise ValueError("StepBenchConfig: model sizes, batch, seq and threads must be >= 1")
        if self.dim % self.heads:
            raise ValueError(
                f"StepBenchConfig: dim={self.dim} must be divisible by heads={self.heads}"
            )
        if not self.nproc or min(self.nproc) < 1 or len(set(self.nproc)) != len(self.nproc):
            raise ValueError(
                f"StepBenchConfig.nproc: need distinct world sizes >= 1, got {self.nproc}"
            )
        for spec in self.overlap_configs:
            parse_overrides(spec)
        if self.link is not None:
            LinkSpec.parse(self.link)  # fail here, not in the ranks


def build_model(cfg: StepBenchConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)  # same init on every rank and for every contender
    if cfg.model == "gpt":
        gpt_cfg = GPTConfig(
            n_layer=cfg.layers, n_head=cfg.heads, n_embd=cfg.dim, block_size=cfg.seq
        )
        return GPT(gpt_cfg)
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(
                d_model=cfg.dim,
                nhead=cfg.heads,
                dim_feedforward=cfg.ff,
                batch_first=True,
                dropout=0.0,
            )
            for _ in range(cfg.layers)
        ]
    )


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one (FSDP2's fully_shard, the floor's collectives): the GPT's
    Blocks, W1's layers."""
    return list(model.blocks) if isinstance(model, GPT) else list(model.children())


def root_params(model: nn.Module, units: list[nn.Module]) -> list[nn.Parameter]:
    in_units = {id(p) for unit in units for p in unit.parameters()}
    return [p for p in model.parameters() if id(p) not in in_units]


def make_batch(cfg: StepBenchConfig, rank: int) -> Batch:
    """A fixed batch, different per rank: every step of every contender trains on it."""
    if cfg.model == "gpt":
        from overlap.tools.data import get_batch, load_stdlib_bytes, rank_generator

        data = load_stdlib_bytes(GPT_CORPUS_BYTES)
        return get_batch(data, cfg.batch, cfg.seq, rank_generator(cfg.seed, rank))
    gen = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=gen),)


def compute_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """gpt: its cross-entropy on (inputs, targets); W1: mean(out^2) of its one input."""
    if len(batch) == 2:
        return model(*batch)[1]
    return model(batch[0]).pow(2).mean()


def describe(cfg: StepBenchConfig) -> str:
    if cfg.model == "gpt":
        return f"GPT step: {cfg.layers} x Block(d={cfg.dim}, heads={cfg.heads}) on stdlib bytes"
    return f"W1 step: {cfg.layers} x TransformerEncoderLayer(d={cfg.dim}, ff={cfg.ff})"
