"""Refuse to step an optimizer that holds parameters `overlap.wrap` replaced.

An optimizer built before `wrap` holds the model's original full parameters. `wrap` swaps them
for sharded ones, so the originals never get a gradient again and `step()` silently skips them:
the model never trains. Every parameter `wrap` replaced is remembered (weakly: the registry
keeps nothing alive), and a global optimizer step pre-hook raises on the first `step()` of an
optimizer holding one. Each rank raises on its own, before the step does anything, so no rank
is left waiting in a collective. An optimizer is checked again only when its number of
parameter groups changes (`add_param_group`) or another wrap replaced parameters, so the hook
costs a dict lookup per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> the name wrap found it under
_checked: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> (param groups, generation) checked
_generation = 0  # bumped by every wrap: an optimizer checked before must be checked again
_handle: Any = None


def remember_replaced(params: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Record (name, parameter) pairs that `wrap` replaced; installs the step hook once."""
    global _handle, _generation
    for name, param in params:
        _replaced[param] = name
    _generation += 1
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    key = (len(optimizer.param_groups), _generation)
    if _checked.get(optimizer) == key:
        return
    stale = [
        _replaced[p] for group in optimizer.param_groups for p in group["params"] if p in _replaced
    ]
    if stale:
        shown = ", ".join(repr(n) for n in stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): this optimizer holds {len(stale)} parameter(s) "
            f"that overlap.wrap replaced by shards ({shown}); they never receive gradients, so "
            "the model would not train. Build the optimizer after overlap.wrap, from the wrapped "
            "model: opt = torch.optim.AdamW(model.parameters(), ...)"
        )
    _checked[optimizer] = key
