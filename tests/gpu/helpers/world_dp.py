"""The data-parallel worlds (world2, hsdp2x2, world3): every config run twice on every rank,
the second time with delays injected, against a one-process reference."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

import overlap
import overlap.kernels as okernels

from .common import (
    LR,
    SHORT,
    STEPS,
    WORLD_SIZES,
    build_world_model,
    close,
    deterministic,
    loss_of,
    optimizer_step,
    patched,
    same_bits,
    synchronize,
    worst_difference,
)
from .copies import CopyJob, runtime_copy_in_layout, runtime_copy_out_layout
from .delays import DELAYS_MS, injected_delays
from .internals import CHUNK_ALIGN_NUMEL, ParamInfo, make_layout
from .worlds import Send, delayed_summary, judge, rank_setup, run_configs, run_world

WORLD_CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "bf16_no_sync": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "micro_batches": 2},
    "int8_grads_ef": {"grad_compression": "int8", "error_feedback": True},
    "int8_params": {"param_compression": "int8"},
    # reduce in fp16 too; an overflow in one rank's shard ([Note: one shard overflows] in common.py): every rank skips
    "fp16_scaler": {"param_dtype": "float16", "scaler": True, "overflow_one_shard": True},
}
WORLD3_CONFIGS = {k: WORLD_CONFIGS[k] for k in ("plain", "int8_grads_ef", "fp16_scaler")}  # a middle rank
BAR = ("every config on every rank: the delayed run bitwise equal to the plain run, delays injected "
       "(before collectives and after their waits), plain fp32 bitwise equal to the one-process reference")  # fmt: skip


def measure_world(device: torch.device, nproc: int, hsdp: bool, configs: dict[str, dict[str, Any]],
                  progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:  # fmt: skip
    """The world's measurements, each config judged as its ranks report it (`progress` gets them
    as they come); `configs[name]["ok"]` is the verdict."""
    kind = device.type
    cuda = kind == "cuda"
    spec = {"device": kind, "hsdp": hsdp, "sizes": asdict(WORLD_SIZES[kind]), "configs": configs, "target": world_rank}
    measured: dict[str, Any] = {
        "world": f"{nproc} ranks" + (" as a 2x2 mesh (replicate x shard)" if hsdp else "")
        + f", gloo, {kind} tensors" + (" on one GPU" if cuda else ""),
        "sizes": spec["sizes"], "steps": STEPS, "optimizer": f"SGD(lr={LR}, foreach=False)",
        "delays_ms": DELAYS_MS if cuda else f"time.sleep of {DELAYS_MS} ms", "configs": {},
    }  # fmt: skip

    def on_message(rank: int, kind: str, payload: Any) -> None:
        if kind in ("probe", "plain_step"):
            measured[kind] = payload
        elif kind == "config":
            name = payload.pop("name")
            measured["configs"].setdefault(name, {"ranks": {}})["ranks"][str(rank)] = payload
            skip_below = 2.0**16 if configs[name].get("overflow_one_shard") else None  # the scaler's default
            judge(measured["configs"][name], name, nproc, exact=nproc != 3, skip_below=skip_below)
        progress(measured)

    run_world(nproc, spec, on_message)
    return measured


def world_rank(rank: int, nproc: int, spec: dict[str, Any], send: Send) -> None:
    """One rank of a spawned world (gloo; CUDA tensors on the one GPU, or CPU tensors): the
    reference, then each config twice, results sent to the parent config by config."""
    device, sizes, impls = rank_setup(spec)
    if rank == 0:
        send("probe", impls)
    group: Any = None
    if spec["hsdp"]:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh(device.type, (2, nproc // 2), mesh_dim_names=("replicate", "shard"))
    base = build_world_model(sizes, device)
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randn(nproc, sizes.batch, sizes.seq, sizes.d, generator=gen) for _ in range(STEPS)]
    if rank == 0 and device.type == "cuda":
        send("plain_step", plain_step_bytes(base, batches[0][0].to(device), device))
    with deterministic(device):
        ref_losses, ref_state = reference_run(base, batches, nproc, spec["hsdp"], device)

    def one(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
        runs = []
        for delayed in (False, True):
            plans: list[dict[str, Any]] | None = [] if (name == "plain" and not delayed and rank == 0) else None
            runs.append(config_run(base, group, overrides, impls["overrides"], batches, rank, device, delayed, plans))
        (l1, s1, _, stats, plans_seen, rest), (l2, s2, counts, _, _, rest2) = runs
        summary = delayed_summary((l1, s1, rest["scales"]), (l2, s2, rest2["scales"]), counts)
        summary.update(stats=stats, memory=rest["memory"])
        if plans_seen is not None:
            summary["copy_plans"] = plans_seen
            summary["layout_mirror"] = layout_mirror(base, 2 if spec["hsdp"] else nproc, plans_seen)
        if name == "plain":
            summary["vs_reference"] = worst_difference(s1, ref_state)
            summary["losses_vs_reference"] = same_bits(l1, ref_losses[:, rank].contiguous())
            summary["bitwise_vs_reference"] = summary["vs_reference"]["bitwise"] and summary["losses_vs_reference"]
            summary["close_vs_reference"] = close(s1, ref_state) and close({"l": l1}, {"l": ref_losses[:, rank]})
        return summary

    run_configs(spec["configs"], nproc, send, one)


def plain_step_bytes(base: nn.Module, x: torch.Tensor, device: torch.device) -> dict[str, int]:
    """What one rank's step allocates on the unwrapped model, above its parameters: activations
    and the full gradients at their peak (the memory part's yardstick)."""
    model = copy.deepcopy(base)
    model.uses_spare = True
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    grads = torch.autograd.grad(loss_of(model(x)), list(model.parameters()), allow_unused=True)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del grads, model
    return {"step_peak_bytes": peak, "param_bytes": sum(p.numel() * p.element_size() for p in base.parameters())}


def layout_mirror(base: nn.Module, n: int, plans: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the copies the runtime issued have the row strides that runtime_copy_out_layout /
    runtime_copy_in_layout (which the numerics and bandwidth parts use) give for a layer's unit
    and the root's (`spare`, `unused`) over `n` ranks: the mirror of the runtime's layout checked
    against the runtime itself."""
    expected: dict[str, list[int]] = {"copy_out": [], "copy_in": []}
    root = [(name, p) for name, p in base.named_parameters() if not name.startswith("layers.")]
    for unit in (list(base.layers[0].named_parameters()), root):
        params = [ParamInfo(name, ((name, "w"),), p.shape, True) for name, p in unit]
        layout = make_layout(0, "unit", ("unit",), params, n, CHUNK_ALIGN_NUMEL)
        expected["copy_out"].append(sum(runtime_copy_out_layout(layout, n)[0]) // n)
        expected["copy_in"].append(sum(runtime_copy_in_layout(layout, n)[0]) // n)
    seen = sorted({(p["kind"], p["row_stride"]) for p in plans if "row_stride" in p})
    layer_seen = {(kind, strides[0]) for kind, strides in expected.items()} <= set(seen)
    matches = layer_seen and all(stride in expected.get(kind, []) for kind, stride in seen)
    return {"expected_row_strides": expected, "seen": seen, "matches": matches}


def reference_run(
    base: nn.Module, batches: list[torch.Tensor], nproc: int, hsdp: bool, device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, the unsharded model: every rank's half-batch, gradients summed in the order the
    collectives sum them (at 2 ranks a + b; HSDP (g0 + g1) + (g2 + g3)), divided by the ranks, SGD."""
    model = copy.deepcopy(base)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, foreach=False)
    losses = torch.empty(len(batches), nproc)
    used: list[bool] = []
    for step, x in enumerate(batches):
        grads = []
        for r in range(nproc):
            model.uses_spare = r == 0
            loss = loss_of(model(x[r].to(device)))
            got = torch.autograd.grad(loss, params, allow_unused=True)  # a parameter a rank left: zeros
            used = [u or g is not None for u, g in zip(used, got)] if grads else [g is not None for g in got]
            grads.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, got)])
            losses[step, r] = loss.detach().cpu()
        if hsdp:
            pairs = [[a + b for a, b in zip(grads[i], grads[i + 1])] for i in range(0, nproc, 2)]
            total = [sum_in_order(p) for p in zip(*pairs)]
        else:
            total = [sum_in_order(g) for g in zip(*grads)]
        for p, g, u in zip(params, total, used):
            p.grad = g.div_(nproc) if u else None  # no rank used it: no gradient
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def sum_in_order(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    """Left to right, in a new tensor."""
    total = tensors[0] + tensors[1] if len(tensors) > 1 else tensors[0].clone()
    for t in tensors[2:]:
        total = total + t
    return total


def config_run(
    base: nn.Module, group: Any, overrides: dict[str, Any], impls: dict[str, str], batches: list[torch.Tensor],
    rank: int, device: torch.device, delayed: bool, plans: list[dict[str, Any]] | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Counter, dict[str, Any], list[dict[str, Any]] | None, dict[str, Any]]:  # fmt: skip
    """One config's steps: (losses, full state dict on CPU, delays injected, step counts, copy
    plans, and the rest: the scaler's scale after each step, the memory measured)."""
    options = dict(overrides)
    micro = options.pop("micro_batches", 1)
    scaled = options.pop("scaler", False)
    overflows = options.pop("overflow_one_shard", False)
    for key in ("param_dtype", "reduce_dtype"):
        if key in options:
            options[key] = getattr(torch, options[key])
    local = copy.deepcopy(base)
    local.uses_spare = rank == 0
    local.overflows = overflows
    if device.type == "cuda":
        synchronize(device)
        before_wrap = torch.cuda.memory_allocated(device)
    model = overlap.wrap(local, group=group, keep_for_backward_bytes=0, **impls, **options)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    scaler = overlap.ShardedGradScaler(model=model) if scaled else None
    counts: Counter = Counter()
    losses, scales = [], []
    if device.type == "cuda":
        synchronize(device)
        after_wrap = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    overlap.memory_stats(model, reset_peak=True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(deterministic(device))
        if delayed:
            stack.enter_context(injected_delays(device, counts, seed=rank))
        for step, x in enumerate(batches):
            x = x[rank].to(device)
            capture = plans is not None and step == 0
            with captured_copy_plans(plans) if capture else contextlib.nullcontext():  # type: ignore[arg-type]
                for part in x.chunk(micro)[:-1]:
                    with overlap.no_sync(model):
                        loss_of(model(part)).backward()
                loss = loss_of(model(x.chunk(micro)[-1]))
                (loss if scaler is None else scaler.scale(loss)).backward()
            optimizer_step(opt, scaler, scales)
            losses.append(loss.detach())
    synchronize(device)
    library = overlap.memory_stats(model)
    memory: dict[str, Any] = {"library_peak_bytes": library.peak_total_bytes, "library_peak": library.peak,
                              "sharded_param_bytes": library.bytes["sharded_params"]}  # fmt: skip
    if device.type == "cuda":
        memory.update(before_wrap_bytes=before_wrap, after_wrap_bytes=after_wrap,
                      steps_peak_bytes=torch.cuda.max_memory_allocated(device))  # fmt: skip
    stats = overlap.step_stats(model)
    counted = {
        k: getattr(stats, k) for k in ("num_allgathers", "num_reduce_scatters", "num_allreduces") if hasattr(stats, k)
    }
    state = overlap.full_state_dict(model, rank0_only=False)
    del model, opt
    rest = {"scales": scales, "memory": memory}
    return torch.stack(losses).cpu(), {k: v.detach().cpu() for k, v in state.items()}, counts, counted, plans, rest


@contextlib.contextmanager
def captured_copy_plans(plans: list[dict[str, Any]]) -> Iterator[None]:
    """The copy layouts the runtime really issues (through overlap.kernels.copy_out / copy_in,
    before it binds them) and the Triton launches each gets."""

    def record(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(a: Any, b: Any, *, sizes: Any = None, num_rows: int = 1, data_cols: Any = None, **k: Any) -> Any:
                flat, tensors = (a, list(b)) if kind == "out" else (b, list(a))
                try:
                    if len(plans) < 8 and sizes is not None and data_cols is not None:
                        job = CopyJob(kind, flat.contiguous().view(-1), tensors, list(sizes), list(data_cols), num_rows)
                        dtypes = sorted({SHORT.get(t.dtype, str(t.dtype)) for t in tensors if t is not None})
                        entry = {"kind": f"copy_{kind}", "num_rows": num_rows, "flat": SHORT.get(flat.dtype, str(flat.dtype)),
                                 "tensors": dtypes, **job.plan()}  # fmt: skip
                        if entry not in plans:
                            plans.append(entry)
                except Exception as e:
                    plans.append({"kind": f"copy_{kind}", "error": f"{type(e).__name__}: {e}"})
                return fn(a, b, sizes=sizes, num_rows=num_rows, data_cols=data_cols, **k)

            return call

        return wrap

    with patched([(okernels, "copy_out", record("out")), (okernels, "copy_in", record("in"))]):
        yield
