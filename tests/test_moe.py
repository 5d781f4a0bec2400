"""A small mixture of experts under overlap: some rank routes no token to some expert.

Two gloo ranks; a router picks one of four experts per token (argmax), and rank 0 has so few
tokens that some expert gets none there. Each expert is a unit of its own (unit_policy "auto":
four blocks of one class in a ModuleList), so a rank that skipped an expert would skip its
all-gather: ZeRO-3's known hang.

- Experts called with an empty batch (what grouped-expert kernels do): every unit runs on every
  rank, an expert without tokens gives zero gradients there; losses and parameters equal DDP's bit
  for bit every step (two ranks: [Note: what is bitwise] in tolerance.py).
- Experts skipped when empty: the ranks' unit orders differ and every rank raises at the first
  forward (overlap checks the order of the first step), instead of hanging in a collective.

Experts on a mesh dimension of their own (expert parallelism) are not covered here.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap

DIM, EXPERTS = 16, 4


class MoE(nn.Module):
    def __init__(self, skip_empty: bool) -> None:
        super().__init__()
        self.skip_empty = skip_empty
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM)) for _ in range(EXPERTS)
        )
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        gate = self.router(x).softmax(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(-1)
            if self.skip_empty and rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(x[rows]) * gate[rows, index : index + 1])
        return self.head(out + x)


def _batch(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(2 if rank == 0 else 16, DIM, generator=gen)  # 2 tokens: 2 experts at most


def check_empty_experts(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    base = MoE(skip_empty=False)
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, idle = [], []
    for step in range(3):
        x = _batch(rank, step)
        with torch.no_grad():
            idle.append(EXPERTS - len(set(ref.module.router(x).argmax(-1).tolist())) if rank == 0 else 0)
        loss, ref_loss = ours(x).pow(2).mean(), ref(x).pow(2).mean()
        loss.backward()
        ref_loss.backward()
        losses.append((loss.item(), ref_loss.item()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    theirs = dict(ref.module.named_parameters())
    differ = [n for n, p in ours.named_parameters() if not torch.equal(p.full_tensor(), theirs[n].detach())]
    return {"losses": losses, "differ": differ, "idle": idle}


def check_skipped_experts(rank: int, world_size: int) -> str | None:
    torch.manual_seed(0)
    model = overlap.wrap(MoE(skip_empty=True))
    try:
        for step in range(2):
            model(_batch(rank, step)).pow(2).mean().backward()
    except ValueError as error:
        return str(error)
    return None


def test_experts_without_tokens_train_as_ddp(world2):
    results = world2.run(check_empty_experts, timeout_s=120)
    assert sum(results[0]["idle"]) > 0, "rank 0 must leave some expert without tokens"
    for rank, result in enumerate(results):
        assert all(a == b for a, b in result["losses"]), (rank, result["losses"])
        assert not result["differ"], (rank, result["differ"])


def test_skipped_experts_raise_on_every_rank_instead_of_hanging(world2):
    messages = world2.run(check_skipped_experts, timeout_s=120)
    assert all(m is not None and "order of units differs" in m for m in messages), messages
