"""Training with overlap.wrap equals DDP, every step: losses, gradient shards, parameters.

World size 2 in fp32: bitwise (gloo's two-rank sum is commutative and dividing by 2 is exact, so
sum-then-divide equals DDP's divide-then-sum). World size 4: the reduce-scatter adds the four
contributions in another order than DDP's all-reduce, so results agree to rounding (within
`reordered_rtol` of a 4-term sum: [Note: what is bitwise] in tolerance.py); SGD with momentum is used there because Adam divides by sqrt(v) and turns rounding
noise in near-zero gradients into visible parameter differences.
"""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch
import torch.nn as nn
from helpers.models import STRICT_ZERO3, batch, encoder_stack, loss_of, step_both, tiny_lm
from helpers.tolerance import max_rel_diff, reordered_rtol, shard_rows
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap
from overlap.engine.runtime import Runtime

MODELS = {"tiny_lm": tiny_lm, "encoder": encoder_stack}


def _make_optim(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _install_delays(rank: int, seed: int) -> None:
    """Random sleeps before every all-gather and reduce-scatter, different on each rank."""
    rng = random.Random(seed * 10 + rank)
    for verb in ("gather", "reduce"):
        original = getattr(Runtime, verb)

        def delayed(self, *args, _original=original, **kwargs):
            time.sleep(rng.uniform(0, 0.004))
            return _original(self, *args, **kwargs)

        setattr(Runtime, verb, delayed)


def train_vs_ddp(
    rank: int,
    world: int,
    model: str,
    config: dict,
    optim: str = "adamw",
    steps: int = 3,
    delays: bool = False,
    clip: float | None = None,
) -> dict:
    base = MODELS[model]()
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base, **config)
    ref_opt, opt = _make_optim(optim, ref.parameters()), _make_optim(optim, ours.parameters())
    rng = random.Random(rank)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    bitwise = True
    for step in range(steps):
        x = batch(base, rank, step)
        ref_loss = loss_of(ref(x))
        ref_loss.backward()
        loss = loss_of(ours(x))
        if delays:
            time.sleep(rng.uniform(0, 0.004))  # after forward
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            overlap.clip_grad_norm_(ours, clip)
        bitwise &= bool(torch.equal(loss, ref_loss))
        worst["loss"] = max(worst["loss"], max_rel_diff(ref_loss.detach(), loss.detach()))
        named_ref = dict(ref.module.named_parameters())
        for name, p in ours.named_parameters():
            assert isinstance(p, torch.distributed.tensor.DTensor), name
            assert p.shape == named_ref[name].shape and p.dim() == named_ref[name].dim(), name
            g_ref = shard_rows(named_ref[name].grad, p.grad.to_local(), rank, world)
            bitwise &= bool(torch.equal(g_ref, p.grad.to_local()))
            worst["grad"] = max(worst["grad"], max_rel_diff(g_ref, p.grad.to_local()))
        if delays:
            time.sleep(rng.uniform(0, 0.004))  # before the optimizer
        step_both(ref_opt, opt)
        for name, p in ours.named_parameters():
            p_ref = shard_rows(named_ref[name].detach(), p.to_local(), rank, world)
            bitwise &= bool(torch.equal(p_ref, p.to_local()))
            worst["param"] = max(worst["param"], max_rel_diff(p_ref, p.detach().to_local()))
    stats = overlap.step_stats(ours)
    kept = len(ours._overlap_state.schedule.kept_units())  # [Note: units kept for backward]
    return {"bitwise": bitwise, **worst, "max_unsharded": stats.max_unsharded_units, "kept": kept}


CONFIGS_2 = [
    pytest.param({}, id="default"),
    pytest.param(STRICT_ZERO3, id="strict-zero3"),
    pytest.param({"keep_for_backward_bytes": 3000}, id="keep-some"),
    pytest.param({"prefetch_depth": 0}, id="no-prefetch"),
    pytest.param({"prefetch_depth": 3, "reduce_scatter_bucket_bytes": 4000}, id="deep-bucketed"),
    pytest.param({"reshard_after_forward": False}, id="zero2"),
    pytest.param({"min_unit_numel": 3000}, id="merged-units"),
    pytest.param({"max_inflight_allgather_bytes": 4000, "prefetch_depth": 4}, id="byte-cap"),
    pytest.param({"unit_policy": {nn.LayerNorm}}, id="class-policy"),
    pytest.param({"reduce_scatter_impl": "native"}, id="native-reduce-scatter"),
    # default on gloo: gathers through all-to-all, backward gathers fused into reductions
    pytest.param({"all_gather_impl": "native"}, id="native-all-gather"),
    pytest.param({"all_gather_impl": "all_to_all", "prefetch_depth": 2}, id="a2a-gather-deep"),
]


@pytest.mark.parametrize("model", ["tiny_lm", "encoder"])
@pytest.mark.parametrize("config", CONFIGS_2)
def test_bitwise_parity_world2(world2, model, config):
    results = world2.run(train_vs_ddp, model=model, config=config)
    for rank, r in enumerate(results):
        assert r["bitwise"], f"rank {rank}: not bitwise equal to DDP: {r}"
        depth = config.get("prefetch_depth", overlap.OverlapConfig().prefetch_depth)
        if config.get("reshard_after_forward", True):
            # the prefetch budget (the last unit, kept, included) plus the other kept units
            assert r["max_unsharded"] <= depth + max(r["kept"], 1), r
            if config.get("keep_for_backward_bytes") == 0:
                assert r["kept"] == 1, r


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="default"),
        pytest.param({"prefetch_depth": 2, "reduce_scatter_bucket_bytes": 6000}, id="bucketed"),
        pytest.param({"reshard_after_forward": False, "min_unit_numel": 2000}, id="zero2-merged"),
    ],
)
def test_parity_world4(world4, config):
    results = world4.run(train_vs_ddp, model="tiny_lm", config=config, optim="sgd")
    rtol = reordered_rtol(4, steps=3)  # 4 contributions per element, 3 steps
    for rank, r in enumerate(results):
        assert r["loss"] <= rtol and r["grad"] <= rtol and r["param"] <= rtol, (rank, r)


def test_injected_delays_change_nothing(world2):
    config = {"prefetch_depth": 2, "reduce_scatter_bucket_bytes": 3000}
    results = world2.run(train_vs_ddp, model="tiny_lm", config=config, delays=True, steps=4)
    assert all(r["bitwise"] for r in results), results


def test_clipping_matches_ddp(world2):
    results = world2.run(train_vs_ddp, model="tiny_lm", config={}, clip=0.05, optim="sgd")
    # the global norm is summed in another order ([Note: what is bitwise]): within its tolerance
    rtol = reordered_rtol(sum(p.numel() for p in tiny_lm().parameters()), steps=3)
    for rank, r in enumerate(results):
        assert r["grad"] <= rtol and r["param"] <= rtol, (rank, r)


def mixed_precision_vs_reference(rank: int, world: int, steps: int = 3) -> dict:
    """param_dtype=bf16, reduce_dtype=fp32 against a plain model that reproduces that path:
    bf16 copy of the fp32 master weights for forward/backward, fp32 all-reduce of the bf16
    gradients, AdamW on the fp32 master."""
    return bf16_compute_vs_reference(rank, world, tiny_lm(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), steps)


def bf16_compute_vs_reference(rank: int, world: int, base: nn.Module, make_optim, steps: int) -> dict:
    """`base` wrapped with param_dtype=bf16, reduce_dtype=fp32 against the same path by hand:
    a bf16 copy of the master weights computes, its gradients are all-reduced in fp32 and
    divided by the world size, and `make_optim` steps the master, whose parameters keep their
    own dtypes. Loss, gradient shards and parameter shards compared bitwise every step."""
    import torch.distributed as dist

    master = copy.deepcopy(base)
    ours = overlap.wrap(base, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref_opt, opt = make_optim(master.parameters()), make_optim(ours.parameters())
    bitwise = True
    for step in range(steps):
        x = batch(base, rank, step)
        low = copy.deepcopy(master).to(torch.bfloat16)
        ref_loss = loss_of(low(x))
        ref_loss.backward()
        for p_master, p_low in zip(master.parameters(), low.parameters()):
            g = p_low.grad.float()
            dist.all_reduce(g)
            p_master.grad = (g / world).to(p_master.dtype)
        loss = loss_of(ours(x))
        loss.backward()
        bitwise &= bool(torch.equal(loss, ref_loss))
        for (name, p), p_ref in zip(ours.named_parameters(), master.parameters()):
            assert p.dtype == p_ref.dtype and p.grad.dtype == p_ref.dtype, name
            bitwise &= bool(torch.equal(shard_rows(p_ref.grad, p.grad.to_local(), rank, world), p.grad.to_local()))
        step_both(ref_opt, opt)
        for p, p_ref in zip(ours.parameters(), master.parameters()):
            bitwise &= bool(torch.equal(shard_rows(p_ref.detach(), p.to_local(), rank, world), p.to_local()))
    return {"bitwise": bitwise}


def test_mixed_precision_matches_low_precision_reference(world2):
    results = world2.run(mixed_precision_vs_reference)
    assert all(r["bitwise"] for r in results), results
