"""The autograd objects that report a unit's backward events to its OverlapState, and the count
that decides when a unit's backward is over: a parameter's post-accumulate-grad hook
(`GradReady`, which holds the state weakly), the identity function on a unit's inputs whose
backward says the unit's backward is over (`BackwardDone`), and `BackwardCounts`.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class BackwardEvents(Protocol):
    """What the hooks report to: the unit's `OverlapState` (named by its shape, so this module
    sits below state.py, which imports it)."""

    def _grad_ready(self, index: int, position: int, param: torch.Tensor) -> None: ...

    def _unit_backward_done(self, index: int) -> None: ...


class GradReady:
    """The post-accumulate-grad hook of a unit's unsharded parameter (`position`: its slot in the
    unit's layout); holds the state weakly.

    [Note: a wrapped model is collectable]
    torch keeps a parameter's post-accumulate-grad hooks where the garbage collector cannot see
    them (in C++), so a hook holding the state strongly closes a cycle the collector cannot
    break: parameter -> hook -> state -> units -> parameter. A wrapped model then lived until
    the process exited, whatever the user deleted: its flat buffers, shards, runtime and process
    group references (a notebook or a tuner that wraps model after model grew by a model each
    time). Held weakly, the state goes with the model. What a dropped model leaves for the
    collector is collected at exit at the latest ([Note: quiet exit] in teardown.py).
    """

    __slots__ = ("_index", "_position", "_state")

    def __init__(self, state: BackwardEvents, index: int, position: int) -> None:
        self._state = weakref.ref(state)
        self._index = index
        self._position = position

    def __call__(self, param: torch.Tensor) -> None:
        state = self._state()
        if state is not None:  # None: the model was dropped while its graph lived on
            state._grad_ready(self._index, self._position, param)


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


def report_input_grads(
    events: BackwardEvents, counts: BackwardCounts, args: tuple, indices: tuple[int, ...]
) -> tuple | None:
    """A unit's forward inputs (`args`), those needing a gradient replaced by views whose
    backward reports (b) of [Note: end of a unit's backward] for `indices`; None when no input
    needs a gradient (nothing flows back into this unit's inputs: (a) or the end of backward)."""
    if len(args) == 1 and isinstance(args[0], torch.Tensor):  # the most common case
        if not args[0].requires_grad:
            return None
        for index in indices:
            counts.forward(index)
        # An identity view whose backward node reports (b): a hook on the node is several
        # times cheaper than an autograd.Function. The node runs when the gradient w.r.t.
        # this use of the input is complete, exactly as BackwardDone.backward would.
        out = args[0].view_as(args[0])
        out.grad_fn.register_prehook(functools.partial(_inputs_done, events, indices))
        return (out,)
    if all(isinstance(a, torch.Tensor) for a in args):  # the common case, without pytree
        flat, spec = list(args), None
    else:
        flat, spec = tree_flatten(args)
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return None
    for index in indices:
        counts.forward(index)
    outs = BackwardDone.apply(events, indices, *(flat[i] for i in positions))
    for i, t in zip(positions, outs):
        flat[i] = t
    return tuple(flat) if spec is None else tree_unflatten(flat, spec)


def _inputs_done(events: BackwardEvents, indices: tuple[int, ...], grad_outputs: Any) -> None:
    for index in indices:  # returns None: the gradient is left as it is
        events._unit_backward_done(index)


class BackwardCounts:
    """Per step and unit: which trainable parameters have their gradient, how many forwards can
    report through their inputs and how many did, and whether the unit must wait for the end of
    the step's backward. Reset by `reset()` when the step's backward ends.

    [Note: end of a unit's backward]
    A unit's backward is over when (a) every trainable parameter's gradient has been
    accumulated (post-accumulate-grad hooks, each parameter counted once), or (b) the gradient
    w.r.t. its inputs has been computed, once for each forward it ran this step (`BackwardDone`
    on its inputs). (b) covers units with frozen or unused parameters, whose count never
    completes. It is safe because autograd runs AccumulateGrad nodes before any other ready node
    (they carry the highest sequence number), so a parameter's gradient produced by the same
    node as the input gradient is already accumulated. Within one autograd run a parameter used
    several times (a module called twice, tied weights) accumulates once, after its last use.
    (a) is not used for a unit with frozen parameters whose inputs need a gradient: its
    backward may still need a frozen weight after the last trainable gradient is in (to pass
    the gradient on to its inputs, e.g. a frozen attention before a trainable feed-forward),
    so only (b) ends it. With no input needing a gradient, nothing after (a) reads a weight.

    Neither (a) nor (b) ends a unit that got a gradient outside the step's main backward (the
    autograd run that reaches the model's forward graph: [Note: auxiliary backward runs] in
    state.py), nor one whose parameter accumulated twice: more may still come (a loss head
    applied chunk by chunk, each chunk with its own `backward()`, a tied embedding whose other
    use is in the main backward). Such a unit stays unsharded with its gradients accumulating
    and is reduced when the step's backward ends; the other units still reduce as early as
    their count allows. A gradient that arrives after its unit was reduced (a parameter used
    outside its unit's forward) raises instead of being lost.
    """

    __slots__ = ("_late", "_num_done", "_num_forwards", "_num_ready", "_ready_bits", "has_frozen", "num_trainable")

    def __init__(self, num_trainable: list[int], has_frozen: list[bool]) -> None:
        self.num_trainable = num_trainable  # per unit
        self.has_frozen = has_frozen  # per unit: some parameter is frozen
        self._ready_bits = [0] * len(num_trainable)  # bit `position`: that slot's gradient arrived
        self._num_ready = [0] * len(num_trainable)
        self._num_forwards = [0] * len(num_trainable)  # forwards this step that can report (b)
        self._num_done = [0] * len(num_trainable)
        self._late = [False] * len(num_trainable)  # ends with the step's backward only

    def reset(self) -> None:
        n = len(self.num_trainable)
        self._ready_bits = [0] * n
        self._num_ready = [0] * n
        self._num_forwards = [0] * n
        self._num_done = [0] * n
        self._late = [False] * n

    def set_trainable(self, index: int, num_trainable: int, has_frozen: bool) -> None:
        """The unit's trainable parameters changed between steps."""
        self.num_trainable[index] = num_trainable
        self.has_frozen[index] = has_frozen

    def forward(self, index: int) -> None:
        """The unit ran a forward whose inputs need a gradient: one more (b) report to wait for."""
        self._num_forwards[index] += 1

    def grad_ready(self, index: int, position: int, main: bool) -> bool:
        """Slot `position` of the unit got its gradient (in the step's main backward when `main`);
        True when that ends the unit's backward by (a)."""
        bit = 1 << position
        if self._ready_bits[index] & bit or not main:
            self._late[index] = True  # accumulated twice, or before the main backward
            self._ready_bits[index] |= bit
            return False
        self._ready_bits[index] |= bit
        self._num_ready[index] += 1
        return (
            self._num_ready[index] == self.num_trainable[index]
            and not self._late[index]
            and not (self.has_frozen[index] and self._num_forwards[index] > 0)
        )

    def input_done(self, index: int, main: bool) -> bool:
        """The gradient w.r.t. one forward's inputs of the unit is computed; True when that ends
        the unit's backward by (b)."""
        if not main:
            self._late[index] = True
            return False
        self._num_done[index] += 1
        return self._num_done[index] == self._num_forwards[index] and not self._late[index]
