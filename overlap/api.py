"""Functions over a wrapped model: gradient clipping, full state dicts, no_sync, step stats."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.config import OverlapConfig
from overlap.engine.lazy_torch import is_dtensor
from overlap.engine.state import OverlapState, state_of
from overlap.observe.memory import MemoryStats
from overlap.observe.stats import StepStats
from overlap.state_dict import full_state_dict as full_state_dict  # re-exported: overlap.full_state_dict
from overlap.state_dict import load_full_state_dict as load_full_state_dict


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _counted_here(state: OverlapState, param: torch.Tensor) -> bool:
    """Whether this rank's part of `param`'s gradient enters the global norm: each element on
    exactly one rank of the shard group and, with tensor parallelism, of the tp group."""
    if state.tensor_group is not None and dist.get_rank(state.tensor_group) != 0:
        # a parameter replicated over tp (a plain one, or Replicate() there) counts on tp rank 0
        over_tp = is_dtensor(param) and param.device_mesh.ndim > state.mesh.ndim
        if not (over_tp and param.placements[-1].is_shard()):
            return False
    # [Note: replicated parameters]: whole on every rank of the group, so counted on one
    return state.rank == 0 or not state.replicated.holds(param)


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the sharded gradients by their global norm, as `torch.nn.utils.clip_grad_norm_` would
    on the unsharded model. One all-reduce of a scalar; returns the total norm (a plain tensor,
    the same on every rank)."""
    state = state_of(model)
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [_local(p.grad) for p in params]
    counted = [g for p, g in zip(params, grads) if _counted_here(state, p)]
    device = state.units[0].shard.device
    norm_type = float(norm_type)
    if counted:
        norms = torch._foreach_norm(counted, norm_type)
        local = torch.stack([n.float() for n in norms])
    else:
        local = torch.zeros(1, device=device)
    groups = [state.group] if state.tensor_group is None else [state.group, state.tensor_group]
    if math.isinf(norm_type):
        total = local.max()
        for group in groups:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = local.pow(norm_type).sum()
        for group in groups:  # over dp, then over tp: every element once ([Note: tensor-parallel parameters])
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of gradients is non-finite")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef)  # a 0-dim fp32 factor: each gradient keeps its dtype
    return total


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (unsharded) without reduce-scatter, for gradient
    accumulation: the backward after leaving the context reduces everything accumulated."""
    with state_of(model).no_sync():
        yield


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


def tuned_config(model: nn.Module) -> OverlapConfig:
    """The model's OverlapConfig with the schedule knobs in force now: with `autotune`, what the
    tuner chose so far (autotune off, to reuse: `.save(path)`); without, the config given to wrap."""
    state = state_of(model)
    return state.config if state.autotuner is None else state.autotuner.tuned_config()
