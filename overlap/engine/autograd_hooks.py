"""The autograd objects that report a unit's backward events to its OverlapState: a parameter's
post-accumulate-grad hook (`GradReady`, which holds the state weakly) and the identity function
on a unit's inputs whose backward says the unit's backward is over (`BackwardDone`).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch


class BackwardEvents(Protocol):
    """What the hooks report to: the unit's `OverlapState` (named by its shape, so this module
    sits below state.py, which imports it)."""

    def _grad_ready(self, index: int, param: torch.Tensor) -> None: ...

    def _unit_backward_done(self, index: int) -> None: ...


class GradReady:
    """The post-accumulate-grad hook of a unit's unsharded parameter; holds the state weakly.

    [Note: a wrapped model is collectable]
    torch keeps a parameter's post-accumulate-grad hooks where the garbage collector cannot see
    them (in C++), so a hook holding the state strongly closes a cycle the collector cannot
    break: parameter -> hook -> state -> units -> parameter. A wrapped model then lived until
    the process exited, whatever the user deleted: its flat buffers, shards, runtime and process
    group references (a notebook or a tuner that wraps model after model grew by a model each
    time). Held weakly, the state goes with the model. What a dropped model leaves for the
    collector is collected at exit at the latest ([Note: quiet exit] in teardown.py).
    """

    __slots__ = ("_state", "_index")

    def __init__(self, state: BackwardEvents, index: int) -> None:
        self._state = weakref.ref(state)
        self._index = index

    def __call__(self, param: torch.Tensor) -> None:
        state = self._state()
        if state is not None:  # None: the model was dropped while its graph lived on
            state._grad_ready(self._index, param)


class BackwardDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward reports that the unit's backward is over."""

    @staticmethod
    def forward(ctx: Any, state: BackwardEvents, indices: tuple[int, ...], *tensors: torch.Tensor) -> Any:
        ctx.state, ctx.indices = state, indices
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        for index in ctx.indices:
            ctx.state._unit_backward_done(index)
        return (None, None, *grads)
