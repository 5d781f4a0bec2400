"""The training step the benchmarks, the tuner and the planner's calibration share: W1 or the
byte-level GPT, its units, a fixed batch per rank, its loss and one plain step.

    w1   a stack of `layers` nn.TransformerEncoderLayer(d=`dim`, ff=`ff`, dropout 0) on a fixed
         random input (`batch`, `seq`, `dim`), loss mean(out^2); a layer is a unit
    gpt  overlap.tools.workloads.gpt.GPT on a fixed batch of the stdlib's bytes with its own
         cross-entropy (its MLP is 4 x dim, `ff` unused); a Block is a unit, the embeddings,
         final norm and head are the root's
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from overlap.tools.workloads.data import get_batch, load_stdlib_bytes, rank_generator
from overlap.tools.workloads.gpt import GPT, GPTConfig

ModelName = Literal["w1", "gpt"]
MODELS: tuple[ModelName, ...] = get_args(ModelName)

GPT_CORPUS_BYTES = 2**20
"""The gpt batch is cut from this much stdlib text: plenty for a fixed batch, read in a blink."""

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a stack of layers and of its batch, and the learning rate: the fields
    `Workload` (bench step, tune) and bench mesh share, with the same flags. Defaults are W1's."""

    layers: int = 8
    """Layers (W1), Blocks (gpt) or MLP blocks (bench mesh): the units of sharding."""
    dim: int = 512
    """Model width."""
    ff: int = 2048
    """W1's feed-forward width (gpt: always 4 x dim; bench mesh: each MLP block's hidden width)."""
    batch: int = 4
    """Sequences per (data-parallel) rank per step."""
    seq: int = 128
    """Tokens per sequence."""
    lr: float = 1e-4
    """AdamW's learning rate."""

    def __post_init__(self) -> None:
        if min(self.layers, self.dim, self.ff, self.batch, self.seq) < 1:
            raise ValueError(f"{type(self).__name__}: model sizes, batch and seq must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Workload(ModelShape):
    """A model and its batch. Defaults are W1: a few minutes per benchmark on 2 CPU cores."""

    model: ModelName = "w1"
    """W1 (transformer encoder layers on random input) or the byte-level GPT on stdlib bytes."""
    heads: int = 8
    seed: int = 0
    """Model initialization (the same on every rank) and the batches (different per rank)."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.model not in MODELS:
            raise ValueError(f"{name}.model: {self.model!r} is not one of {MODELS}")
        super().__post_init__()
        if self.heads < 1:
            raise ValueError(f"{name}: model sizes, batch and seq must be >= 1")
        if self.dim % self.heads:
            raise ValueError(f"{name}: dim={self.dim} must be divisible by heads={self.heads}")


def build_model(cfg: Workload) -> nn.Module:
    torch.manual_seed(cfg.seed)  # same init on every rank and for every contender
    if cfg.model == "gpt":
        gpt_cfg = GPTConfig(n_layer=cfg.layers, n_head=cfg.heads, n_embd=cfg.dim, block_size=cfg.seq)
        return GPT(gpt_cfg)
    layers = [
        nn.TransformerEncoderLayer(
            d_model=cfg.dim, nhead=cfg.heads, dim_feedforward=cfg.ff, batch_first=True, dropout=0.0
        )
        for _ in range(cfg.layers)
    ]
    return nn.Sequential(*layers)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one (FSDP2's fully_shard, the floor's collectives): the GPT's
    Blocks, W1's layers."""
    return list(model.blocks) if isinstance(model, GPT) else list(model.children())


def root_params(model: nn.Module, units: list[nn.Module]) -> list[nn.Parameter]:
    in_units = {id(p) for unit in units for p in unit.parameters()}
    return [p for p in model.parameters() if id(p) not in in_units]


def make_batch(cfg: Workload, rank: int) -> Batch:
    """A fixed batch, different per rank: every step of every contender trains on it."""
    if cfg.model == "gpt":
        data = load_stdlib_bytes(GPT_CORPUS_BYTES)
        return get_batch(data, cfg.batch, cfg.seq, rank_generator(cfg.seed, rank))
    gen = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=gen),)


def compute_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """gpt: its cross-entropy on (inputs, targets); W1: mean(out^2) of its one input."""
    if len(batch) == 2:
        return model(*batch)[1]
    return model(batch[0]).pow(2).mean()


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Batch,
    on_stepped: Callable[[], None] | None = None,
    marks: list[float] | None = None,
) -> torch.Tensor:
    """One step; `marks`, if given, gets `time.perf_counter()` at the end of the forward (the
    loss computed), of the backward and of the optimizer step (benchmarks/plan_validate.py's
    phases)."""
    loss = compute_loss(model, batch)
    if marks is not None:
        marks.append(time.perf_counter())
    loss.backward()
    if marks is not None:
        marks.append(time.perf_counter())
    opt.step()
    if on_stepped is not None:  # gradients still alive here: the accounting hook
        on_stepped()
    opt.zero_grad(set_to_none=True)
    if marks is not None:
        marks.append(time.perf_counter())
    return loss.detach()


def describe(cfg: Workload) -> str:
    if cfg.model == "gpt":
        return f"GPT step: {cfg.layers} x Block(d={cfg.dim}, heads={cfg.heads}) on stdlib bytes"
    return f"W1 step: {cfg.layers} x TransformerEncoderLayer(d={cfg.dim}, ff={cfg.ff})"
