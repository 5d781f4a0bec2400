"""SGD, Adam and AdamW over overlap's CPU shards step the local tensors ([Note: local optimizer
step] in overlap/engine/local_step.py): the same bits as DDP, no DTensor op inside the step, and the
DTensors everywhere outside it (hooks, state, state_dict)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import batch, loss_of, tiny_lm
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

import overlap
from overlap.engine import local_step

SETTINGS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "maximize": True}),
}


class DTensorOps(TorchFunctionMode):
    """Counts in-place arithmetic (what an optimizer's update is made of: mul_, lerp_,
    addcdiv_, ...) on DTensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("_") and name != "requires_grad_":
            flat = [*args, *kwargs.values()]
            flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
            self.count += any(isinstance(a, DTensor) for a in flat)
        return func(*args, **kwargs)


def _rows(full: torch.Tensor, local: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    rows = -(-full.shape[0] // world)
    return full[rank * rows : rank * rows + local.shape[0]]


def steps_like_ddp(rank: int, world: int, name: str) -> dict:
    opt_class, kwargs = SETTINGS[name]
    ref = DDP(copy.deepcopy(tiny_lm()))
    model = overlap.wrap(tiny_lm())
    opt_ref = opt_class(ref.parameters(), **kwargs)
    opt = opt_class(model.parameters(), **kwargs)
    seen: list[tuple[bool, bool]] = []  # what the user's own hooks see: (params, state) all DTensors

    def user_hook(optimizer, args, kw) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
        seen.append((all(isinstance(p, DTensor) for p in params), all(isinstance(v, DTensor) for v in state)))

    opt.register_step_pre_hook(user_hook)
    opt.register_step_post_hook(user_hook)
    ops = []
    for step in range(3):
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            loss_of(m(batch(model, rank, step))).backward()
        opt_ref.step()
        with DTensorOps() as counter:
            opt.step()
        ops.append(counter.count)
        if step == 0:
            opt.register_step_pre_hook(user_hook)  # registered after ours: ours is moved last again
    named_ref = dict(ref.module.named_parameters())
    bitwise = all(
        torch.equal(_rows(named_ref[n].detach(), p.to_local(), rank, world), p.to_local())
        for n, p in model.named_parameters()
    )
    states = [(p, s) for p, s in opt.state.items()]
    state_ok = all(
        isinstance(v, DTensor) and v.placements == p.placements and v.shape == p.shape
        for p, s in states
        for k, v in s.items()
        if k != "step"
    )
    saved = opt.state_dict()
    return {
        "bitwise": bitwise,
        "hooks_saw_dtensors": all(a and b for a, b in seen) and len(seen) == 3 * 2 + 2,
        "no_dtensor_op_in_step": ops,
        "state_is_dtensor": state_ok and len(states) == len(list(model.parameters())),
        "group_holds_params": all(p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters())),
        "state_dict_dtensor": all(
            isinstance(v, DTensor) for s in saved["state"].values() for k, v in s.items() if k != "step"
        ),
    }


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_local_step_equals_ddp_and_hides_itself(world2, name):
    for r in world2.run(steps_like_ddp, name=name):
        assert r.pop("no_dtensor_op_in_step") == [0, 0, 0], r
        assert all(r.values()), r


def left_alone(rank: int, world: int) -> dict:
    model = overlap.wrap(tiny_lm())
    plain = torch.nn.Parameter(torch.zeros(3))
    plain.grad = torch.ones(3)
    optimizers = {
        "mixed_group": torch.optim.SGD([*model.parameters(), plain], lr=0.1),
        "other_optimizer": torch.optim.RMSprop(model.parameters(), lr=1e-2),
        "eligible": torch.optim.AdamW(model.parameters(), lr=1e-2),
    }
    loss_of(model(batch(model, rank, 0))).backward()
    counts = {}
    for name, opt in optimizers.items():
        with DTensorOps() as counter:
            opt.step()
        counts[name] = counter.count
    return counts


def test_other_groups_keep_the_dtensor_step(world2):
    for counts in world2.run(left_alone):
        assert counts["mixed_group"] > 0 and counts["other_optimizer"] > 0 and counts["eligible"] == 0, counts


def with_closure(rank: int, world: int) -> dict:
    """A closure that recomputes the gradients inside step(): the step must use them (it is not
    swapped), as DDP's step does."""
    ref = DDP(copy.deepcopy(tiny_lm()))
    model = overlap.wrap(tiny_lm())
    results = {}
    for name, m in (("ddp", ref), ("ours", model)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        loss_of(m(batch(model, rank, 0))).backward()  # stale gradients, from another batch

        def closure(m=m, opt=opt):
            opt.zero_grad()
            loss = loss_of(m(batch(model, rank, 1)))
            loss.backward()
            return loss

        opt.step(closure)
        results[name] = m
    named_ref = dict(ref.module.named_parameters())
    return {
        "bitwise": all(
            torch.equal(_rows(named_ref[n].detach(), p.to_local(), rank, world), p.to_local())
            for n, p in model.named_parameters()
        )
    }


def test_a_step_with_a_closure_uses_its_gradients(world2):
    for r in world2.run(with_closure):
        assert all(r.values()), r


def raises_inside_step(rank: int, world: int) -> dict:
    model = overlap.wrap(tiny_lm())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loss_of(model(batch(model, rank, 0))).backward()
    opt.step()  # state exists
    opt.param_groups[0]["lr"] = "not a number"  # the step raises after the swap
    try:
        opt.step()
        raised = False
    except TypeError:
        raised = True
    swapped_while_failed = not isinstance(opt.param_groups[0]["params"][0], DTensor)
    local_step.restore(opt)
    params = list(model.parameters())
    return {
        "raised": raised,
        "swapped_while_failed": swapped_while_failed,
        "params_back": all(p is q for p, q in zip(opt.param_groups[0]["params"], params)),
        "state_back": set(opt.state) == set(params)
        and all(isinstance(s["exp_avg"], DTensor) for s in opt.state.values()),
    }


def test_a_step_that_raised_is_undone(world2):
    for r in world2.run(raises_inside_step):
        assert all(r.values()), r
