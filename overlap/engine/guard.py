"""Refuse to step an optimizer that holds parameters `overlap.wrap` replaced.

An optimizer built before `wrap` holds the model's original full parameters. `wrap` swaps them
for sharded ones, so the originals never get a gradient again and `step()` silently skips them:
the model never trains. Every parameter `wrap` replaced is remembered (weakly: the registry
keeps nothing alive), and a global optimizer step pre-hook raises on the first `step()` of an
optimizer holding one. Each rank raises on its own, before the step does anything, so no rank
is left waiting in a collective. When an optimizer is checked again: step_hooks.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from overlap.engine.step_hooks import StepCheck

_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> the name wrap found it under


def remember_replaced(params: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Record (name, parameter) pairs that `wrap` replaced; installs the step hook once."""
    for name, param in params:
        _replaced[param] = name
    _hook.registered()


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    stale = [_replaced[p] for group in optimizer.param_groups for p in group["params"] if p in _replaced]
    if stale:
        shown = ", ".join(repr(n) for n in stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): this optimizer holds {len(stale)} parameter(s) "
            f"that overlap.wrap replaced by shards ({shown}); they never receive gradients, so "
            "the model would not train. Build the optimizer after overlap.wrap, from the wrapped "
            "model: opt = torch.optim.AdamW(model.parameters(), ...)"
        )


_hook = StepCheck(_check_optimizer)
