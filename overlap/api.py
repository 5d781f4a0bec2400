"""Functions over a wrapped model: gradient clipping, full state dicts, no_sync, step stats."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from overlap.memory import MemoryStats
from overlap.stats import StepStats
from overlap.wrap import state_of


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the sharded gradients by their global norm, as `torch.nn.utils.clip_grad_norm_` would
    on the unsharded model. One all-reduce of a scalar; returns the total norm (a plain tensor,
    the same on every rank)."""
    state = state_of(model)
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    device = state.units[0].shard.device
    norm_type = float(norm_type)
    if grads:
        norms = torch._foreach_norm(grads, norm_type)
        local = torch.stack([n.float() for n in norms])
    else:
        local = torch.zeros(1, device=device)
    if math.isinf(norm_type):
        total = local.max()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=state.group)
    else:
        total = local.pow(norm_type).sum()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=state.group)
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of gradients is non-finite")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict under the original names, on CPU: what the unwrapped model's
    `load_state_dict` accepts. Collective: every rank must call it. With `rank0_only`, ranks
    other than 0 get an empty dict."""
    state = state_of(model)
    keep = not rank0_only or (state.rank == 0 and state.replica_rank == 0)
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            out[name] = value.detach().cpu().clone()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
    """Load an unsharded state dict (every rank passes the same one) into the sharded model."""
    state = state_of(model)
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    for name, target in own.items():
        if name not in state_dict:
            continue
        source = state_dict[name]
        if tuple(source.shape) != tuple(target.shape):
            raise ValueError(
                f"load_full_state_dict: {name!r} has shape {tuple(source.shape)}, "
                f"the model expects {tuple(target.shape)}"
            )
        if isinstance(target, DTensor):
            local = target.to_local()
            rows = math.ceil(target.shape[0] / state.world_size)  # the shard dim of the mesh
            start = state.rank * rows
            local.copy_(source[start : start + local.shape[0]])
        else:
            target.copy_(source)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (unsharded) without reduce-scatter, for gradient
    accumulation: the backward after leaving the context reduces everything accumulated."""
    schedule = state_of(model).schedule
    previous = schedule.sync_grads
    schedule.sync_grads = False
    try:
        yield
    finally:
        schedule.sync_grads = previous


def step_stats(model: nn.Module) -> StepStats | None:
    """What the last completed step did (exposed communication, bytes, counts); None before one."""
    return state_of(model).stats.last


def memory_stats(model: nn.Module, reset_peak: bool = False) -> MemoryStats:
    """Bytes this rank's library buffers hold now, by kind, and their high-water marks since the
    step began (or the last reset): sharded parameters, gradient shards, unsharded units, gather
    buffers, reduce-scatter inputs and outputs, error-feedback residuals, hpZ secondary copies.
    See [Note: memory accounting] in memory.py for what it does not include."""
    account = state_of(model).runtime.memory
    stats = account.snapshot()
    if reset_peak:
        account.reset_peak()
    return stats
