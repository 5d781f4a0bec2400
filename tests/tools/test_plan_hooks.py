"""`measure_hooks` (overlap/tools/plan/hooks.py, [Note: hook cost]): it drives a wrapped model
through unshard / no_sync / reshard and must leave it as it found it; 2 gloo ranks."""

from __future__ import annotations

import torch
import torch.nn as nn

import overlap
from overlap.tools.plan.hooks import measure_hooks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))


def _two_steps(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def hooks_then_train(rank: int, world_size: int) -> dict:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    measured = overlap.wrap(_model(), reshard_after_forward=True)
    costs = measure_hooks(measured, _model(), (x,), reps=2)
    held = measured._overlap_state.schedule.held_units()
    grads = [n for n, p in measured.named_parameters() if p.grad is not None]
    fresh = overlap.wrap(_model(), reshard_after_forward=True)
    after, want = _two_steps(measured, x), _two_steps(fresh, x)
    same = all(torch.equal(a, b) for a, b in zip(after, want)) and all(
        torch.equal(p.to_local(), q.to_local()) for p, q in zip(measured.parameters(), fresh.parameters())
    )
    pending = [i for i, u in enumerate(measured._overlap_state.runtime.units) if u.grad_sums is not None]
    return {"costs": costs, "held": len(held) + len(pending), "grads": grads, "same": same}


def test_measure_hooks_leaves_the_model_as_it_found_it(world2):
    for rank, r in enumerate(world2.run(hooks_then_train)):
        forward, backward = r["costs"]
        assert 0.0 <= forward < 0.1 and 0.0 <= backward < 0.1, (rank, r)
        assert r["held"] == 0, (rank, "units left unsharded", r)
        assert r["grads"] == [], (rank, "gradients left behind", r)
        assert r["same"], (rank, "the measured model trains differently from a fresh one")
