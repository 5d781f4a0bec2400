"""gpu_check's parts beyond data parallelism on one GPU: a 2x2 (dp x tp) world against one
process, autotune within its memory cap, and the memory the worlds allocated against what is
accounted. benchmarks/gpu_check.py lists them with its other parts and runs them the same way
(`--only tp2x2,autotune,memory`); they use its helpers through `gpu_check` (the running script).

  tp2x2     4 ranks on the one GPU over gloo, `init_device_mesh(..., (2, 2), ("dp", "tp"))`: MLP
            blocks made tensor-parallel (ColwiseParallel up, RowwiseParallel down) and a plain
            head, wrapped with `group=mesh["dp"]` (the composition tests/test_compose.py checks
            against FSDP2 on CPU). Configs: fp32; fp16 with the ShardedGradScaler and an overflow
            in one tp rank's shard ([Note: one tp shard overflows]). Each runs twice, the second
            time with delays injected; bar: the two bitwise equal, delays injected, the same
            scale on every rank (and a step skipped where the overflow is), fp32 within fp32
            rounding of a one-process reference (the unsharded model on each dp rank's batch,
            gradients averaged, SGD): rowwise partial sums change the order of a sum.
  autotune  world size 1, AdamW: the peak of 3 steps without autotune (optimizer state
            included), then AUTOTUNE_STEPS steps with `autotune=True` and `autotune_memory_bytes`
            that peak plus half a layer (CPU, whose peak RSS is noisier: 64 MiB), so that keeping
            or prefetching one more layer would cross it. Bar: a baseline decision taken, the
            tuner's limit that cap, the measured peak (CUDA: max_memory_allocated; CPU: peak RSS)
            under it.
  memory    no run of its own: per rank of each world config, the allocator's peak during the
            steps above what the rank held after wrap, against what is accounted for it:
            overlap.memory_stats' peak (the library's buffers) plus what a step of the unwrapped
            model allocates (activations and full gradients). Bar (CUDA): no rank above that.
"""

from __future__ import annotations

import contextlib
import gc
from collections import Counter
from typing import Any

import torch
from torch import nn

import gpu_check as base  # the running script ([Note: one gpu_check module] in gpu_check.py)
import overlap

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
AUTOTUNE_STEPS = 20  # the baseline decision at step 10 on CUDA (6 on CPU), then a first trial
MEMORY_SLACK_BYTES = 2 << 20  # the allocator's rounding and small tensors nothing accounts


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TPNet(nn.Module):
    def __init__(self, d: int, hidden: int, num_blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d, hidden) for _ in range(num_blocks))
        self.head = nn.Linear(d, d)  # plain: sharded over dp only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tp_model(sizes: base.Sizes, device: torch.device) -> TPNet:
    torch.manual_seed(0)
    return TPNet(sizes.d, sizes.ff, sizes.layers).to(device)


def tp_rank(rank: int, nproc: int, spec: dict[str, Any], send: Any) -> None:
    """One rank of the 2x2 (dp, tp) world: the reference, then each config twice."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sizes = base.Sizes(**spec["sizes"])
    impls = base.probe_native(device)
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randn(2, sizes.batch * sizes.seq, sizes.d, generator=gen) for _ in range(base.STEPS)]
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
            runs.append(tp_config_run(model, mesh["dp"], overrides, impls["overrides"], batches, dp, rank, device, delayed))
        (l1, s1, scales1, _), (l2, s2, scales2, counts) = runs
        summary = base.delayed_summary((l1, s1, scales1), (l2, s2, scales2), counts)
        if name == "plain":
            summary["vs_reference"] = base.worst_difference(s1, ref_state)
            summary["close_vs_reference"] = base.close(s1, ref_state) and base.close({"l": l1}, {"l": ref_losses[:, dp]})
        return summary

    base.run_configs(spec["configs"], nproc, send, one)


def tp_reference(sizes: base.Sizes, device: torch.device, batches: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, the unsharded model: both dp ranks' batches, (g0 + g1) / 2, SGD."""
    model = tp_model(sizes, device)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=base.LR, foreach=False)
    losses = torch.empty(len(batches), 2)
    with base.deterministic(device):
        for step, x in enumerate(batches):
            grads = []
            for r in range(2):
                loss = base.loss_of(model(x[r].to(device)))
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
    opt = torch.optim.SGD(model.parameters(), lr=base.LR, foreach=False)
    scaler = overlap.ShardedGradScaler(init_scale=init_scale, model=model) if scaled else None
    counts: Counter = Counter()
    losses, scales = [], []
    with contextlib.ExitStack() as stack:
        stack.enter_context(base.deterministic(device))
        if delayed:
            stack.enter_context(base.injected_delays(device, counts, seed=rank))
        for x in batches:
            loss = base.loss_of(model(x[dp].to(device)))
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    base.synchronize(device)
    state = overlap.full_state_dict(model, rank0_only=False)
    return torch.stack(losses).float().cpu(), {k: v.detach().float().cpu() for k, v in state.items()}, scales, counts


def part_tp(c: Any, _budget_s: float) -> base.PartResult:
    kind = c.device.type
    spec = {"device": kind, "sizes": base.asdict(base.WORLD_SIZES[kind]), "configs": TP_CONFIGS, "target": tp_rank}
    measured: dict[str, Any] = {
        "world": f"4 ranks as a 2x2 mesh (dp x tp), gloo, {kind} tensors" + (" on one GPU" if c.cuda else ""),
        "sizes": spec["sizes"], "steps": base.STEPS, "optimizer": f"SGD(lr={base.LR}, foreach=False)", "configs": {},
    }  # fmt: skip

    def on_message(rank: int, kind: str, payload: Any) -> None:
        if kind == "config":
            name = payload.pop("name")
            entry = measured["configs"].setdefault(name, {"ranks": {}})
            entry["ranks"][str(rank)] = payload
            skip_below = OVERFLOW_INIT_SCALE if TP_CONFIGS[name].get("overflow_one_shard") else None
            base.judge(entry, name, 4, exact=False, skip_below=skip_below)  # rowwise partial sums: another order
        c.progress(measured)

    base.run_world(4, spec, on_message)
    ok = all(measured["configs"].get(name, {}).get("ok", False) for name in TP_CONFIGS)
    bar = ("every config on every rank: the delayed run bitwise equal to the plain run, delays injected, the same "
           "scale on every rank; fp32 within fp32 rounding of the one-process reference")  # fmt: skip
    return ("passed" if ok else "failed"), bar, measured


def part_autotune(c: Any, _budget_s: float) -> base.PartResult:
    """A tight cap: the measured peak of the untuned run plus half a layer's parameters (CUDA; CPU,
    whose peak RSS is noisier, 64 MiB), so that a move keeping or prefetching one more layer
    would cross it. AUTOTUNE_STEPS steps with autotune on under that cap; the peak stays under it."""
    from overlap.engine.autotune_memory import measured_peak_bytes

    if c.cuda:
        torch.cuda.reset_peak_memory_stats(c.device)
    x = base.make_input(c.sizes, c.device)
    untuned = overlap.wrap(base.build_plain(c.sizes, c.device))
    opt = torch.optim.AdamW(untuned.parameters(), lr=1e-4)  # state the cap must hold
    for _ in range(3):
        base.train_step(untuned, opt, x)
    base.synchronize(c.device)
    layer_bytes = sum(p.numel() * p.element_size() for p in next(iter(untuned.children())).parameters())
    untuned_peak = measured_peak_bytes(c.device)
    del untuned, opt
    gc.collect()  # the untuned model's memory back before the tuned one allocates
    cap = untuned_peak + (layer_bytes // 2 + (1 << 20) if c.cuda else 64 << 20)
    model = overlap.wrap(base.build_plain(c.sizes, c.device), autotune=True, autotune_memory_bytes=cap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(AUTOTUNE_STEPS):
        base.train_step(model, opt, x)
    base.synchronize(c.device)
    tuner = model._overlap_state.autotuner
    budget = tuner.memory
    peak = measured_peak_bytes(c.device)
    decisions = [{k: str(v)[:200] for k, v in vars(d).items()} for d in tuner.policy.decisions]
    measured: dict[str, Any] = {
        "steps": AUTOTUNE_STEPS, "cap_bytes": cap, "untuned_peak_bytes": untuned_peak, "layer_bytes": layer_bytes,
        "peak_bytes": peak, "decisions": decisions[-10:],
        "actions": dict(Counter(d["action"] for d in decisions)),
    }  # fmt: skip
    if budget is None:
        return "failed", "the tuner took its memory budget", measured
    measured.update(limit_bytes=budget.limit_bytes, baseline_peak_bytes=budget.baseline_peak_bytes, budget_step=budget.step)
    ok = peak <= budget.limit_bytes == cap and any(d["action"] == "baseline" for d in decisions)
    bar = ("a baseline decision taken, the tuner's limit the cap given, and the measured peak (CUDA: "
           "max_memory_allocated; CPU: peak RSS) <= that cap after its trials")  # fmt: skip
    return ("passed" if ok else "failed"), bar, measured


def part_memory(c: Any, _budget_s: float) -> base.PartResult:
    """The world parts' memory per rank and config, against what is accounted for it."""
    rows = []
    for entry in c.report["parts"]:
        measured = entry.get("measured") or {}
        plain_step = measured.get("plain_step", {})
        for name, config in (measured.get("configs") or {}).items():
            for rank, r in config.get("ranks", {}).items():
                m = r.get("memory")
                if not m:
                    continue
                row = {"world": entry["part"], "config": name, "rank": rank, **{k: v for k, v in m.items() if k != "library_peak"}}
                if "steps_peak_bytes" in m and plain_step:
                    used = m["steps_peak_bytes"] - m["after_wrap_bytes"]
                    accounted = m["library_peak_bytes"] - m["sharded_param_bytes"] + plain_step["step_peak_bytes"]
                    row.update(steps_bytes=used, accounted_bytes=accounted, over_bytes=max(0, used - accounted))
                rows.append(row)
    measured_out = {"rows": rows, "slack_bytes": MEMORY_SLACK_BYTES}
    if not rows:
        return "skipped: no world part ran", "", measured_out
    bar = ("per rank and config: the allocator's peak during the steps above what the rank held after wrap <= the "
           "library's accounted peak + one unwrapped step's activations and gradients + slack")  # fmt: skip
    if not c.cuda:
        return "measured", bar + " (CUDA only)", measured_out
    judged = [r for r in rows if "over_bytes" in r]
    ok = bool(judged) and all(r["over_bytes"] <= MEMORY_SLACK_BYTES for r in judged)
    return ("passed" if ok else "failed"), bar, measured_out
