"""`requires_grad` changed after wrap takes effect at the next forward, as under DDP
([Note: requires_grad after wrap] in engine/state.py): gradual unfreezing and frozen-layer schedules.

Against DDP (find_unused_parameters=True), every step at two ranks: one whole unit and part of
another are frozen after two steps and unfrozen three steps later. While frozen a parameter
gets no gradient, does not change, takes nothing in the reduce-scatter and no gradient memory.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import batch, encoder_stack, loss_of
from torch.nn.parallel import DistributedDataParallel as DDP


def _frozen(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Layer 1 whole (one unit) and layer 2's attention (part of another unit)."""
    return list(model[1].parameters()) + list(model[2].self_attn.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def freeze_unfreeze(rank: int, world: int, config: dict) -> dict:
    import overlap

    base = encoder_stack(layers=4, dim=16)
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = overlap.wrap(base, **config)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    out: dict = {"loss_diff": [], "reduce_bytes": [], "grad_shards": [], "frozen_moved": [], "frozen_grads": []}
    for step in range(8):
        if step in (2, 5):
            flag = step == 5
            for p in _frozen(ref.module) + _frozen(ours):
                p.requires_grad_(flag)
        x = batch(base, rank, step)
        before = [_local(p).detach().clone() for p in _frozen(ours)]
        ref_loss, loss = loss_of(ref(x)), loss_of(ours(x))
        ref_loss.backward()
        loss.backward()
        out["loss_diff"].append(abs(ref_loss.item() - loss.item()) / max(abs(ref_loss.item()), 1e-12))
        out["frozen_grads"].append(sum(p.grad is not None for p in _frozen(ours)))
        out["grad_shards"].append(overlap.memory_stats(ours).peak["reduce_outputs"])
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        out["reduce_bytes"].append(overlap.step_stats(ours).reduce_scatter_bytes)
        out["frozen_moved"].append(any(not torch.equal(b, _local(p).detach()) for b, p in zip(before, _frozen(ours))))

    # the parameters themselves, every one, against DDP's
    def rows(full: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        return full[rank * -(-full.shape[0] // world) :][: local.shape[0]]

    out["param_diff"] = max(
        (rows(r.detach(), _local(o).detach()) - _local(o).detach()).abs().max().item()
        for r, o in zip(ref.module.parameters(), ours.parameters())
        if o.dim() > 0
    )
    return out


@pytest.mark.parametrize("config", [{}, {"reduce_scatter_bucket_bytes": 1 << 20}], ids=["per_unit", "bucketed"])
def test_freeze_and_unfreeze_like_ddp(world2, config):
    for r in world2.run(freeze_unfreeze, config=config, timeout_s=300):
        assert max(r["loss_diff"]) == 0.0, r["loss_diff"]  # two ranks, fp32: bitwise
        assert r["param_diff"] == 0.0, r["param_diff"]
        frozen_steps, live_steps = [2, 3, 4], [0, 1, 5, 6, 7]
        assert all(r["frozen_grads"][s] == 0 for s in frozen_steps), r["frozen_grads"]
        assert all(r["frozen_grads"][s] > 0 for s in live_steps), r["frozen_grads"]
        assert not any(r["frozen_moved"][s] for s in frozen_steps), r["frozen_moved"]
        assert all(r["frozen_moved"][s] for s in (0, 1, 5, 6)), r["frozen_moved"]
        # nothing is reduced, and no gradient memory is held, for what is frozen
        assert all(r["reduce_bytes"][s] < r["reduce_bytes"][1] for s in frozen_steps), r["reduce_bytes"]
        assert r["reduce_bytes"][6] == r["reduce_bytes"][1], r["reduce_bytes"]
        assert all(r["grad_shards"][s] < r["grad_shards"][1] for s in frozen_steps), r["grad_shards"]
