"""SGD, Adam and AdamW over overlap's sharded CPU parameters step the local shards.

[Note: local optimizer step]
The optimizer sees overlap's parameters as DTensors (the API contract, as FSDP2's), and every
tensor op on a DTensor goes through DTensor's Python dispatch, tens of µs per op on these CPUs.
torch's single-tensor optimizers issue about ten ops per parameter and step, so on W1 (96 shards)
AdamW's step over half the elements cost 101 ms a step against 115 ms for DDP's full plain tensors
(py-spy profiles of rank 0). DDP never pays that dispatch, nor does an optimizer stepping
plain tensors.

A parameter's DTensor is Shard(0) over its local tensor, a view of the unit's flat shard, and
every op these three optimizers apply is elementwise on the parameter, its gradient and its
state (no op looks across parameters or ranks: their foreach and single-tensor steps are the same
bits for that reason). Run on the local tensors, the step computes the same values in the same
storage. So a global step pre-hook, for each parameter group of an SGD, Adam or AdamW whose
parameters are all overlap's CPU shards (and that is not fused, capturable or differentiable),
puts the local tensors in the group for the duration of `step()`: each gets its DTensor
gradient's local as `.grad`, and the parameter's optimizer state moves over with its DTensors'
locals. The post-hook puts everything back, re-wrapping state tensors the step created (the
first step's exp_avg, momentum buffers) as DTensors with the parameter's placement, so between
steps the optimizer, its `state_dict()`, DCP and the user see what they saw before, and the
results are the DTensor step's to the bit (tests/engine/test_local_step.py checks both every run).

A step that raised has skipped its post-hook: the swap is undone at the start of that
optimizer's next step, or by `restore(optimizer)`. A step given a closure is not swapped: the
closure's backward would leave its gradients on the DTensors, after the swap took the old ones. On CUDA the dispatch runs ahead of the
device and foreach is torch's default there, so groups on other devices are left alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from overlap.engine import process_hooks
from overlap.engine.lazy_torch import is_dtensor

LOCAL_STEP_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose step is elementwise per parameter: stepping the local shards is exact."""

_ours: WeakIdKeyDictionary = WeakIdKeyDictionary()  # overlap's sharded CPU parameters
_swapped: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> its groups' swaps in effect


@dataclass
class _GroupSwap:
    group: dict[str, Any]
    params: list[torch.nn.Parameter]  # the group's own (DTensor) parameters, in order
    locals: list[torch.Tensor]  # their local tensors, what the group holds during the step
    state: list[dict[str, Any] | None]  # each parameter's state before the step (DTensors)


def register_sharded(params: Iterable[torch.Tensor]) -> None:
    """Record `wrap`'s sharded parameters that live on the CPU; installs the global hooks once
    (unless disabled: "local_step" in [Note: process-wide hooks] in process_hooks.py)."""
    for param in params:
        if param.device.type == "cpu" and is_dtensor(param):
            _ours[param] = True
    process_hooks.install("local_step", __name__, _install_hooks)


def _install_hooks() -> process_hooks.Remove:
    handles = (register_optimizer_step_pre_hook(_arrange), register_optimizer_step_post_hook(_post_step))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def _eligible(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    params = group["params"]
    return (
        type(optimizer) in LOCAL_STEP_OPTIMIZERS
        and bool(params)
        and not group.get("fused")
        and not group.get("capturable")
        and not group.get("differentiable")
        and all(p in _ours for p in params)
    )


# [Note: local step hook order]
# torch runs the global step pre-hooks, then the optimizer's own, then the step, then the
# optimizer's own post-hooks, then the global ones. The user's hooks must see the DTensors (a
# pre-hook clipping gradients would otherwise take the local norm), so the swap is done by a
# pre-hook of the optimizer's own kept last, and undone by a post-hook of its own kept first:
# the global pre-hook below installs them on an eligible optimizer's first step and moves them
# into place before every step (torch's private hook dicts, ordered; where a torch release lacks
# them, nothing is swapped and the DTensor step runs as before).
_own_hooks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> (pre handle, post handle)


def _arrange(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore(optimizer)  # a step that raised left its swap in place
    pre_hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    post_hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
    if not isinstance(pre_hooks, OrderedDict) or not isinstance(post_hooks, OrderedDict):
        return
    if not any(_eligible(optimizer, g) for g in optimizer.param_groups):
        return
    handles = _own_hooks.get(optimizer)
    if handles is None:
        handles = (optimizer.register_step_pre_hook(_swap), optimizer.register_step_post_hook(_post_step))
        _own_hooks[optimizer] = handles
    pre_hooks.move_to_end(handles[0].id)  # last of the optimizer's pre-hooks
    post_hooks.move_to_end(handles[1].id, last=False)  # first of its post-hooks


def _swap(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling() or len(args) > 1 or kwargs.get("closure") is not None:
        return  # a closure runs forward and backward inside the step: its gradients are new DTensors
    swaps = []
    for group in optimizer.param_groups:
        if not _eligible(optimizer, group):
            continue
        params = list(group["params"])
        local = [p._local_tensor for p in params]  # type: ignore[attr-defined]
        saved: list[dict[str, Any] | None] = []
        for param, tensor in zip(params, local):
            grad = param.grad
            tensor.grad = None if grad is None else grad._local_tensor  # type: ignore[attr-defined]
            state = optimizer.state.pop(param, None)
            saved.append(state)
            if state:
                optimizer.state[tensor] = {k: v._local_tensor if is_dtensor(v) else v for k, v in state.items()}
        group["params"] = local
        swaps.append(_GroupSwap(group, params, local, saved))
    if swaps:
        _swapped[optimizer] = swaps


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    restore(optimizer)


def restore(optimizer: torch.optim.Optimizer) -> None:
    """Put back the DTensor parameters and state of `optimizer`'s groups, if a step swapped them
    ([Note: local optimizer step]); nothing otherwise."""
    swaps = _swapped.pop(optimizer, None)
    if swaps is None:
        return
    for swap in swaps:
        for param, tensor, before in zip(swap.params, swap.locals, swap.state):
            tensor.grad = None
            state = optimizer.state.pop(tensor, None)
            if state:
                optimizer.state[param] = {k: _restored(param, tensor, k, v, before) for k, v in state.items()}
        swap.group["params"] = swap.params


def _restored(param: torch.Tensor, local: torch.Tensor, key: str, value: Any, before: dict[str, Any] | None) -> Any:
    """One state entry after the step, as the DTensor step would have left it."""
    from torch.distributed.tensor import DTensor  # loaded: `param` is a DTensor

    old = None if before is None else before.get(key)
    per_element = isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local.shape
    if not per_element or not (old is None or isinstance(old, DTensor)):
        return value  # scalars (Adam's step count), entries that were plain before the step
    if isinstance(old, DTensor) and old._local_tensor is value:
        return old  # updated in place: the same object as before the step
    return DTensor(value, param._spec, requires_grad=False)  # type: ignore[attr-defined,call-arg]  # new this step
