"""Optimizers over overlap's CPU parameters step with their foreach kernels ([Note: foreach on
CPU] in overlap/foreach.py), which must give the single-tensor step's bits."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap
from harness import World
from models import batch, loss_of, tiny_lm
from overlap.foreach import BITWISE_FOREACH

SETTINGS = {
    torch.optim.SGD: [{"lr": 0.1}, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}],
    torch.optim.Adam: [{"lr": 1e-2}, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}],
    torch.optim.AdamW: [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 1e-2, "maximize": True}],
}


@pytest.mark.parametrize("opt_class", BITWISE_FOREACH, ids=lambda c: c.__name__)
def test_foreach_equals_single_tensor_on_cpu(opt_class):
    """What makes the switch safe: on CPU the two implementations agree to the bit for fp32
    parameters (several settings, ten steps); bf16 shows why lower precisions keep theirs."""
    assert set(SETTINGS) == set(BITWISE_FOREACH)
    different = []
    for kwargs in SETTINGS[opt_class]:
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            init = [torch.randn(37, 19, generator=gen).to(dtype) for _ in range(4)]
            single = [p.clone().requires_grad_() for p in init]
            multi = [p.clone().requires_grad_() for p in init]
            opt_single = opt_class(single, foreach=False, **kwargs)
            opt_multi = opt_class(multi, foreach=True, **kwargs)
            for _ in range(10):
                for a, b in zip(single, multi):
                    grad = torch.randn(a.shape, generator=gen).to(dtype)
                    a.grad, b.grad = grad.clone(), grad.clone()
                opt_single.step()
                opt_multi.step()
            same = all(torch.equal(a, b) for a, b in zip(single, multi))
            if dtype == torch.float32:
                assert same, (opt_class.__name__, kwargs)
            elif not same:
                different.append((opt_class.__name__, kwargs))
    if opt_class is torch.optim.SGD:  # momentum in bf16: not the same bits, hence fp32 only
        assert any(kw.get("momentum") for _, kw in different), different


@pytest.fixture(scope="module")
def world2():
    world = World(2)
    yield world
    world.close()


def foreach_choices(rank: int, world: int) -> dict:
    from overlap import foreach

    model = overlap.wrap(tiny_lm())
    big = overlap.wrap(tiny_lm(layers=8))
    cap = foreach.FOREACH_MAX_GROUP_BYTES
    foreach.FOREACH_MAX_GROUP_BYTES = sum(p.to_local().nbytes for p in model.parameters())
    ref = DDP(copy.deepcopy(tiny_lm()))
    plain = torch.nn.Parameter(torch.zeros(3))
    optimizers = {
        "default": torch.optim.AdamW(model.parameters(), lr=1e-2),
        "explicit_false": torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False),
        "mixed_group": torch.optim.SGD([*model.parameters(), plain], lr=0.1),
        "other_optimizer": torch.optim.RMSprop(model.parameters(), lr=1e-2),
        "not_ours": torch.optim.AdamW(ref.parameters(), lr=1e-2),
        "over_the_cap": torch.optim.AdamW(big.parameters(), lr=1e-2),  # its temporaries would be large
    }
    for m in (model, ref, big):
        loss_of(m(batch(model, rank, 0))).backward()
    try:
        for opt in optimizers.values():
            opt.step()
    finally:
        foreach.FOREACH_MAX_GROUP_BYTES = cap
    return {name: [g["foreach"] for g in opt.param_groups] for name, opt in optimizers.items()}


def test_only_unset_groups_of_our_parameters_switch(world2):
    for choices in world2.run(foreach_choices):
        assert choices == {
            "default": [True],
            "explicit_false": [False],
            "mixed_group": [None],
            "other_optimizer": [None],
            "not_ours": [None],
            "over_the_cap": [None],
        }, choices
