"""The tp2x2 world: 4 ranks on the one device as a 2x2 mesh (dp x tp), against one process.

MLP blocks made tensor-parallel (ColwiseParallel up, RowwiseParallel down) and a plain head,
wrapped with `group=mesh["dp"]` (the composition tests/parity/test_compose.py checks against FSDP2 on
CPU). Configs: fp32; fp16 with the ShardedGradScaler and an overflow in one tp rank's shard
([Note: one tp shard overflows]). Each runs twice, the second time with delays injected.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

import overlap
from overlap.tools.workloads.toy import ResidualMlp

from .common import (
    LR,
    STEPS,
    WORLD_SIZES,
    Sizes,
    close,
    deterministic,
    loss_of,
    optimizer_step,
    synchronize,
    worst_difference,
)
from .delays import injected_delays
from .worlds import Send, delayed_summary, judge, rank_setup, run_configs, run_world

TP_CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    # an overflow in one tp rank's shard only ([Note: one tp shard overflows]): every rank skips
    "fp16_scaler": {"param_dtype": "float16", "scaler": True, "overflow_one_shard": True},
}
OVERFLOW_INIT_SCALE = 2.0**10
OVERFLOW_WEIGHT = 64.0

# [Note: one tp shard overflows]
# The fp16 config sets one column of the first block's rowwise `down` weight to OVERFLOW_WEIGHT:
# the gradient reaching that hidden unit is large, and so, scaled by OVERFLOW_INIT_SCALE, are the
# gradients of its row of the colwise `up` weight and of its bias, which one tp rank holds (and
# of that, one dp shard): an fp16 inf in one tp rank's shards, while the other tp rank's stay
# finite (the first block's input needs no gradient, so nothing carries the overflow further).
# The scaler's found-inf must reach every rank over the dp and tp groups: every rank skips that
# step and halves its scale. With the tp group left out of it, the tp ranks take different steps
# (their scales differ after the first step) and hold different weights for good.


def tp_model(sizes: Sizes, device: torch.device) -> ResidualMlp:
    """Residual MLP blocks (the units) and a plain head, sharded over dp only."""
    torch.manual_seed(0)
    return ResidualMlp(sizes.layers, sizes.d, sizes.ff).to(device)


def tp_rank(rank: int, nproc: int, spec: dict[str, Any], send: Send) -> None:
    """One rank of the 2x2 (dp, tp) world: the reference, then each config twice."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    device, sizes, impls = rank_setup(spec)
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randn(2, sizes.batch * sizes.seq, sizes.d, generator=gen) for _ in range(STEPS)]
    ref_losses, ref_state = tp_reference(sizes, device, batches)

    def one(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
        runs = []
        for delayed in (False, True):
            model = tp_model(sizes, device)
            if overrides.get("overflow_one_shard"):
                with torch.no_grad():
                    model.layers[0].down.weight[:, -1] = OVERFLOW_WEIGHT
            for block in model.layers:
                parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            runs.append(
                tp_config_run(model, mesh["dp"], overrides, impls["overrides"], batches, dp, rank, device, delayed)
            )
        (l1, s1, scales1, _), (l2, s2, scales2, counts) = runs
        summary = delayed_summary((l1, s1, scales1), (l2, s2, scales2), counts)
        if name == "plain":
            summary["vs_reference"] = worst_difference(s1, ref_state)
            summary["close_vs_reference"] = close(s1, ref_state) and close({"l": l1}, {"l": ref_losses[:, dp]})
        return summary

    run_configs(spec["configs"], nproc, send, one)


def tp_reference(
    sizes: Sizes, device: torch.device, batches: list[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, the unsharded model: both dp ranks' batches, (g0 + g1) / 2, SGD."""
    model = tp_model(sizes, device)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, foreach=False)
    losses = torch.empty(len(batches), 2)
    with deterministic(device):
        for step, x in enumerate(batches):
            grads = []
            for r in range(2):
                loss = loss_of(model(x[r].to(device)))
                grads.append(torch.autograd.grad(loss, params))
                losses[step, r] = loss.detach().cpu()
            for p, a, b in zip(params, *grads):
                p.grad = (a + b).div_(2)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def tp_config_run(
    model: nn.Module, group: Any, overrides: dict[str, Any], impls: dict[str, str], batches: list[torch.Tensor],
    dp: int, rank: int, device: torch.device, delayed: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[float], Counter]:  # fmt: skip
    """(losses, full state dict on CPU, the scale after each step, delays injected)."""
    options = dict(overrides)
    scaled = options.pop("scaler", False)
    init_scale = OVERFLOW_INIT_SCALE if options.pop("overflow_one_shard", False) else 2.0**16
    if "param_dtype" in options:
        options["param_dtype"] = getattr(torch, options["param_dtype"])
    model = overlap.wrap(model, group=group, keep_for_backward_bytes=0, **impls, **options)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    scaler = overlap.ShardedGradScaler(init_scale=init_scale, model=model) if scaled else None
    counts: Counter = Counter()
    losses, scales = [], []
    with contextlib.ExitStack() as stack:
        stack.enter_context(deterministic(device))
        if delayed:
            stack.enter_context(injected_delays(device, counts, seed=rank))
        for x in batches:
            loss = loss_of(model(x[dp].to(device)))
            (loss if scaler is None else scaler.scale(loss)).backward()
            optimizer_step(opt, scaler, scales)
            losses.append(loss.detach())
    synchronize(device)
    state = overlap.full_state_dict(model, rank0_only=False)
    return torch.stack(losses).float().cpu(), {k: v.detach().float().cpu() for k, v in state.items()}, scales, counts


def measure_tp(device: torch.device, progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The tp2x2 world's measurements, each config judged as its ranks report it."""
    kind = device.type
    spec = {"device": kind, "sizes": asdict(WORLD_SIZES[kind]), "configs": TP_CONFIGS, "target": tp_rank}
    measured: dict[str, Any] = {
        "world": f"4 ranks as a 2x2 mesh (dp x tp), gloo, {kind} tensors" + (" on one GPU" if kind == "cuda" else ""),
        "sizes": spec["sizes"], "steps": STEPS, "optimizer": f"SGD(lr={LR}, foreach=False)", "configs": {},
    }  # fmt: skip

    def on_message(rank: int, kind: str, payload: Any) -> None:
        if kind == "config":
            name = payload.pop("name")
            entry = measured["configs"].setdefault(name, {"ranks": {}})
            entry["ranks"][str(rank)] = payload
            skip_below = OVERFLOW_INIT_SCALE if TP_CONFIGS[name].get("overflow_one_shard") else None
            judge(entry, name, 4, exact=False, skip_below=skip_below)  # rowwise partial sums: another order
        progress(measured)

    run_world(4, spec, on_message)
    return measured
