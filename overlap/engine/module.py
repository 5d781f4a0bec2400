"""The methods DDP and FSDP2 scripts call on the wrapped model itself.

`wrap` ends by giving the model a class of its own, a subclass of (OverlapModule, the model's
class), as FSDP2's `fully_shard` does with `FSDPModule`. The model keeps every attribute and
method it had, `isinstance(model, OriginalClass)` still holds, and the subclass carries the same
`__name__` (so logs, `repr`, and Hugging Face's `config.architectures` written by
`save_pretrained` are unchanged), plus:

    with model.no_sync(): ...                  # DDP: accumulate, do not reduce (overlap.no_sync)
    model.set_requires_gradient_sync(False)    # FSDP2's switch for the same
    model.set_gradient_divide_factor(1.0)      # FSDP2's: sum the gradients over ranks
    model.set_reshard_after_backward(False)    # FSDP2's: keep units unsharded between
                                               # micro-batches whose gradients are not synced
    model.unshard() / model.reshard()          # FSDP2: gather every unit and keep it, e.g. while
                                               # generating; free them again
    model.zero_grad()                          # DDP's: also drops what no_sync accumulated

[Note: zero_grad after no_sync]
Under no_sync the gradients accumulate on the *unsharded* parameters (and their reduce-dtype
sums), which neither `model.parameters()` nor the optimizer holds: the sharded parameters are
what they see. DDP's `model.zero_grad()` after a no_sync backward drops the accumulated
gradients (its parameters hold them); nn.Module's would leave ours to be reduced into the next
synchronized step, silently. So the wrapped model's `zero_grad` drops them too (zeroes them with
`set_to_none=False`). `optimizer.zero_grad()` cannot see them, as under FSDP2: they are reduced
by the next backward outside no_sync, which is the gradient accumulation idiom.

[Note: state dicts of a wrapped model]
`model.state_dict()` is the *sharded* state dict: DTensors holding this rank's shard (and plain
tensors for buffers and replicated scalars). It needs no collective, so calling it on rank 0
alone (a DDP habit before `torch.save`) returns at once and never hangs; but it is not the full
model: its DTensors say so (`.to_local()` is the shard, `.placements` the sharding), and loading
it into the unwrapped model raises instead of loading one shard. The full model is
`overlap.full_state_dict(model)`, called on every rank (it gathers) and returned on rank 0; the
sharded one is what `overlap.checkpoint` and `torch.distributed.checkpoint` save.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any, NoReturn

import torch
import torch.nn as nn

from overlap.engine.lazy_torch import is_dtensor
from overlap.engine.schedule import Phase, Schedule
from overlap.engine.state import state_of


class OverlapModule:
    """Mixed into the wrapped model's class by `wrap`: see the module docstring."""

    # The dynamic class's MRO is [Overlap<cls>, OverlapModule, cls, ...]: the original at 2.
    _ORIGINAL_CLASS_INDEX = 2

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # `type(model)(...)` (e.g. slicing a wrapped nn.Sequential, which builds a new
        # Sequential of the same class) builds a plain, unwrapped instance of the original class.
        original = cls.__mro__[OverlapModule._ORIGINAL_CLASS_INDEX]
        self = original.__new__(original, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def no_sync(self) -> AbstractContextManager[None]:
        """DDP's `model.no_sync()`: inside, backward accumulates gradients locally (unsharded)
        and reduces nothing; the first backward after it reduces everything accumulated. The
        same as `overlap.no_sync(model)`."""
        return state_of(self).no_sync()  # type: ignore[arg-type]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: with False, backward accumulates gradients locally and reduces nothing
        (as inside `no_sync`) until it is set back to True. `recurse` is accepted for FSDP2's
        signature; the whole model is one wrapped module, so it always covers every parameter."""
        for schedule in _schedules(self, "set_requires_gradient_sync", recurse):
            schedule.sync_grads = bool(requires_gradient_sync)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """FSDP2's: with False, a backward whose gradients are not synced (under `no_sync` or
        `set_requires_gradient_sync(False)`) keeps every unit unsharded, so the next micro-batch
        gathers nothing; the next backward that syncs frees them, and so does `reshard()`.
        Memory: the whole model's unsharded parameters, kept only where they fit
        `max_inflight_allgather_bytes` (no cap: always); otherwise units are freed as before.
        Do not step the optimizer between: the kept copies would not see the update (unlike
        FSDP2, a backward that syncs always reshards). [Note: retained across micro-batches]
        in overlap/engine/unit_state.py. `recurse` is accepted for FSDP2's signature."""
        for schedule in _schedules(self, "set_reshard_after_backward", recurse):
            schedule.set_reshard_after_backward(bool(reshard_after_backward))

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """FSDP2's: the sum of the ranks' gradients is divided by `factor` (1.0: summed; None:
        the mean) from the next step on (`OverlapConfig.gradient_divide_factor`). Between steps."""
        state_of(self).set_gradient_divide_factor(factor)  # type: ignore[arg-type]

    def unshard(self) -> None:
        """Gather every unit now and keep it: forwards until `reshard()` gather and free nothing
        (generation, evaluation). Collective: every rank calls it. Between steps only. A backward
        frees the units as it reduces their gradients; the next step gathers as usual. Memory:
        the whole model's parameters, unsharded, on every rank."""
        state = state_of(self)  # type: ignore[arg-type]
        _check_between_steps(state.schedule.phase, "unshard")
        with torch.no_grad():  # forward gathers: no hpZ secondary copy is kept for a backward
            for each in (state, *state.experts):  # [Note: expert parallelism] in experts.py
                each.runtime.run(each.schedule.unshard_all())

    def reshard(self) -> None:
        """Free what `unshard()` gathered. Local (no collective). Between steps only."""
        state = state_of(self)  # type: ignore[arg-type]
        _check_between_steps(state.schedule.phase, "reshard")
        for each in (state, *state.experts):
            each.runtime.run(each.schedule.reshard_all())

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """`model.to(...)`, `.cuda()`, `.half()`, `.double()` and the like, on the wrapped model.

        [Note: no moves after wrap]
        The engine gathers from each unit's flat shard buffer, which the sharded parameters view.
        `nn.Module._apply` would swap in the converted copies (a DTensor's `.to("cpu:0")` copies
        even on the same device), so the optimizer would update the copies while the engine
        gathers the originals: training silently wrong. So a conversion that leaves every
        parameter shard and buffer on its device and in its dtype (`.to` the device it is on,
        `"cpu:0"` included, `.float()` of an fp32 model) is a no-op whose copies are dropped, and
        any other raises, naming the fix."""
        changed = []
        tensors = [(n, p.to_local() if is_dtensor(p) else p) for n, p in self.named_parameters()]  # type: ignore[attr-defined]
        for name, tensor in tensors + list(self.named_buffers()):  # type: ignore[attr-defined]
            if not _same_place(fn(tensor), tensor):
                changed.append(name)
        if changed:
            shown = ", ".join(repr(n) for n in changed[:3]) + (
                f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            )
            raise ValueError(
                f"a model wrapped by overlap.wrap cannot be moved or cast (this would change {shown}): "
                "move or cast the model before overlap.wrap; for mixed precision pass "
                "param_dtype / reduce_dtype to overlap.wrap"
            )
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module's, plus the gradients accumulated under no_sync ([Note: zero_grad after
        no_sync])."""
        super().zero_grad(set_to_none)  # type: ignore[misc]
        state = state_of(self)  # type: ignore[arg-type]
        for each in (state, *state.experts):  # [Note: expert parallelism] in experts.py
            each.runtime.discard_accumulated(set_to_none)

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(
            "a model wrapped by overlap.wrap cannot be deep-copied (its parameters are shards "
            "tied to process groups and hooks): copy the model before wrapping it, or load "
            "overlap.full_state_dict(model) into a fresh unwrapped model"
        )


def _same_place(converted: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether a conversion left `tensor` where it was: the same tensor, or a copy of the same
    dtype on the same device ("cpu:0" names the CPU that "cpu" does)."""
    if converted is tensor:
        return True
    a, b = converted.device, tensor.device
    same_device = a.type == b.type and (a.index == b.index or a.type == "cpu")
    return same_device and converted.dtype == tensor.dtype


def _schedules(model: Any, method: str, recurse: bool) -> list[Schedule]:
    """The schedules an FSDP2-style setter covers: the model's and its experts' ([Note: expert
    parallelism] in experts.py); `recurse=False` is refused (the model is one wrapped module)."""
    if not recurse:
        raise ValueError(
            f"{method}(recurse=False): overlap wraps the whole model as one module, so the setting "
            "covers all its parameters; call it with recurse=True"
        )
    state = state_of(model)
    return [each.schedule for each in (state, *state.experts)]


def _check_between_steps(phase: Phase, verb: str) -> None:
    if phase is not Phase.IDLE:
        raise ValueError(
            f"model.{verb}() was called in the middle of a step ({phase.value}); call it between "
            "steps: after backward (and the optimizer step), or after a forward under "
            "torch.no_grad()"
        )


_CLASSES: dict[type, type] = {}  # original class -> its wrapped subclass, one per class
_METHODS = frozenset(
    {
        "no_sync",
        "set_requires_gradient_sync",
        "set_reshard_after_backward",
        "set_gradient_divide_factor",
        "unshard",
        "reshard",
    }
)


def as_overlap_module(model: nn.Module) -> None:
    """Give `model` the subclass (OverlapModule, its class) in place. Called at the end of wrap."""
    cls = type(model)
    if isinstance(model, OverlapModule):
        return
    new_cls = _CLASSES.get(cls)
    if new_cls is None:
        shadowed = sorted(_METHODS & {name for klass in cls.__mro__ for name in vars(klass)})
        if shadowed:
            warnings.warn(
                f"overlap.wrap: {cls.__qualname__} defines {', '.join(shadowed)}; on the wrapped "
                "model these names are overlap's (see overlap/engine/module.py), call the model's own "
                f"through {cls.__qualname__}.<name>(model, ...)",
                stacklevel=3,
            )
        new_cls = type(cls.__name__, (OverlapModule, cls), {"__qualname__": cls.__qualname__})
        new_cls.__module__ = cls.__module__
        _CLASSES[cls] = new_cls
    model.__class__ = new_cls
