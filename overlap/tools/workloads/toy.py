"""The small models of the overhead and FSDP x TP benchmarks, declared once.

tiny_blocks(units, dim)      `units` x (Linear(dim, dim) + GELU): almost no compute, so a
                             step is the wrappers' per-unit cost (`overlap bench overhead`)
ResidualMlp(layers, dim, ff) `layers` residual MLP blocks (dim -> ff -> dim, ReLU) and a
                             plain head; `tensor_parallel` makes each block ColwiseParallel
                             up, RowwiseParallel down (`overlap bench mesh`)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TinyBlock(nn.Module):
    """Linear + GELU: the unit of sharding (overlap's unit, FSDP2's fully_shard)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


def tiny_blocks(units: int, dim: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)  # same init on every rank and for every contender
    return nn.Sequential(*[TinyBlock(dim) for _ in range(units)])


class MlpBlock(nn.Module):
    def __init__(self, dim: int, ff: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, ff), nn.Linear(ff, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class ResidualMlp(nn.Module):
    def __init__(self, layers: int, dim: int, ff: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MlpBlock(dim, ff) for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tensor_parallel(model: ResidualMlp, tp_mesh: Any) -> ResidualMlp:
    """Each block's `up` column-wise and `down` row-wise over `tp_mesh` (in place)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.layers:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model
