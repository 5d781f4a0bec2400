"""Units over one rank alias their shard ([Note: aliased units] in overlap/engine/unit_tensors.py).

World size 1 (and HSDP with a shard group of one) without cast or codec: the unsharded
parameters are views of the shard, so training equals the plain model bitwise, holds no unsharded
memory, and the sharded DTensors still stand in the modules outside forward and backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import batch, loss_of, tiny_lm
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap
from overlap.engine.state import state_of


def _optim(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _step_both(ref, model, opt_ref, opt, x: torch.Tensor) -> bool:
    """One training step of the reference and of the wrapped model: equal loss and parameters?"""
    losses = [loss_of(m(x)) for m in (ref, model)]
    for loss in losses:
        loss.backward()
    for o in (opt_ref, opt):
        o.step()
        o.zero_grad()
    return torch.equal(*losses) and all(
        torch.equal(a.detach().to_local(), b.detach()) for a, b in zip(model.parameters(), ref.parameters())
    )


def one_rank_vs_plain(rank: int, world: int, optim: str, config: dict) -> dict:
    base = tiny_lm()
    ref = copy.deepcopy(base)
    model = overlap.wrap(base, **config)
    units = state_of(model).units
    opt_ref, opt = _optim(optim, ref.parameters()), _optim(optim, model.parameters())
    equal, aliased = [], [u.aliased for u in units]
    shares = all(
        p.untyped_storage().data_ptr() == u.shard.untyped_storage().data_ptr()
        for u in units
        for p in u.unsharded_params
    )
    for step in range(4):
        equal.append(_step_both(ref, model, opt_ref, opt, batch(ref, rank, step)))
    stats = overlap.memory_stats(model)
    return {
        "aliased": aliased,
        "shares": shares,
        "equal": equal,
        "unsharded_peak": stats.peak["unsharded"],
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
    }


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_one_rank_aliases_and_trains_like_the_plain_model(world1, optim):
    (r,) = world1.run(one_rank_vs_plain, optim=optim, config={}, timeout_s=180)
    assert all(r["aliased"]) and r["shares"], r
    assert r["equal"] == [True] * 4, r
    assert r["unsharded_peak"] == 0, r  # no unsharded copy is ever held
    assert r["dtensors"], r  # the optimizer-facing parameters are back after every step


def test_a_cast_is_not_aliased(world1):
    (r,) = world1.run(one_rank_vs_plain, optim="sgd", config={"param_dtype": torch.bfloat16}, timeout_s=180)
    assert not any(r["aliased"]) and not r["shares"], r
    assert r["unsharded_peak"] > 0, r


def replicas_vs_ddp(rank: int, world: int) -> dict:
    """HSDP over (world replicas x 1 shard): aliased units, gradients all-reduced across
    replicas; bitwise DDP at two ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    base = tiny_lm()
    ref = DDP(copy.deepcopy(base))
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = overlap.wrap(base, group=mesh)
    opt_ref, opt = _optim("adamw", ref.parameters()), _optim("adamw", model.parameters())
    equal = []
    for step in range(3):
        equal.append(_step_both(ref, model, opt_ref, opt, batch(base, rank, step)))
    return {"aliased": [u.aliased for u in state_of(model).units], "equal": equal}


def test_replicas_of_one_shard_alias_and_match_ddp(world2):
    results = world2.run(replicas_vs_ddp, timeout_s=240)
    for r in results:
        assert all(r["aliased"]) and r["equal"] == [True] * 3, results
