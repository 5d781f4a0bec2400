"""Small models for the multi-rank tests. Dimensions are chosen so that dim 0 of several
parameters does not divide by 2 or 4 (padding), and so that the root unit has parameters."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn

STRICT_ZERO3 = {"keep_for_backward_bytes": 0}
"""Overrides for strict ZeRO-3: only the last unit kept from forward to backward, every other unit
gathered again for its backward ([Note: units kept for backward] in overlap/engine/schedule.py)."""


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding + repeated blocks + head: the shape of a causal LM, a few thousand parameters."""

    def __init__(
        self, vocab: int = 37, dim: int = 24, hidden: int = 30, layers: int = 4, block: type[nn.Module] = Block
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([block(dim, hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tiny_lm(seed: int = 0, **kwargs: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def encoder_stack(seed: int = 0, layers: int = 3, dim: int = 16) -> nn.Sequential:
    """W1's shape in miniature: a Sequential of TransformerEncoderLayers, no root parameters."""
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.TransformerEncoderLayer(dim, 2, 2 * dim + 3, batch_first=True, dropout=0.0) for _ in range(layers)]
    )


def batch(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """A per-rank, per-step input for either model."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if isinstance(model, TinyLM) or hasattr(model, "embed"):
        return torch.randint(0, model.embed.num_embeddings, (2, 5), generator=g)
    dim = model[0].self_attn.embed_dim
    return torch.randn(2, 5, dim, generator=g)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def backward_both(ref: nn.Module, ours: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`loss_of` the reference and of our model on `x`, each backward: (reference loss, ours)."""
    ref_loss = loss_of(ref(x))
    ref_loss.backward()
    loss = loss_of(ours(x))
    loss.backward()
    return ref_loss, loss


def step_both(ref_opt: torch.optim.Optimizer, opt: torch.optim.Optimizer) -> None:
    """Step the reference's optimizer and ours, then zero both gradients (to None)."""
    ref_opt.step()
    opt.step()
    ref_opt.zero_grad(set_to_none=True)
    opt.zero_grad(set_to_none=True)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> Iterator[tuple[int, float]]:
    """`steps` steps of `opt` on `loss_of` the model's `batch`es for this rank, yielding (step,
    loss) after each."""
    for step in range(steps):
        loss = loss_of(model(batch(model, rank, step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield step, loss.item()


def sgd_steps(model: nn.Module, rank: int, steps: int = 3, lr: float = 0.1) -> None:
    """`steps` steps of SGD (`train_steps`)."""
    for _ in train_steps(model, torch.optim.SGD(model.parameters(), lr=lr), rank, steps):
        pass
