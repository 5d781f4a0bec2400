"""Checks that run at an optimizer's `step()`, once per optimizer until something changes.

Parts of overlap look at the optimizers users build over the wrapped model (guard.py: stale
parameters). Each is a global optimizer step
pre-hook, installed when the first wrap registers something, that runs its check on an
optimizer's first step and again only when the optimizer's number of parameter groups changed
(`add_param_group`) or a later wrap registered more: a dict lookup per step otherwise. The hook
is "optimizer_step_check" of [Note: process-wide hooks] in process_hooks.py, which may keep it out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from overlap.engine import process_hooks


class StepCheck:
    """`check(optimizer)` at an optimizer's step, once per (groups, registrations) state."""

    def __init__(self, check: Callable[[torch.optim.Optimizer], None]) -> None:
        self._check = check
        self._generation = 0
        self._owner = f"{check.__module__}.{check.__qualname__}"
        self._checked: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> state checked

    def registered(self) -> None:
        """Something the check reads changed: every optimizer is checked again; installs the
        hook on first use (unless disabled: [Note: process-wide hooks] in process_hooks.py)."""
        self._generation += 1
        process_hooks.install("optimizer_step_check", self._owner, self._install)

    def _install(self) -> process_hooks.Remove:
        return register_optimizer_step_pre_hook(self).remove

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        key = (len(optimizer.param_groups), self._generation)
        if self._checked.get(optimizer) == key:
            return
        self._check(optimizer)  # may raise: then it is checked again at the next step
        self._checked[optimizer] = key
