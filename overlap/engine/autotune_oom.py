"""An out-of-memory error inside an autotune trial: caught on the rank that ran out, the step's
collectives finished there so that no rank waits, the trial reverted on every rank.

[Note: out of memory in a trial]
A trial is priced before it runs ([Note: autotune memory] in autotune_memory.py), but a price
is a prediction. When a trial step still runs one rank out of memory, what FSDP2 and DeepSpeed
do is let the error reach the training loop of that rank while the others block in their next
collective until the watchdog ends the job. With autotune that is not acceptable: the tuner
chose the setting, so it must undo it, on every rank, without a hang. What happens instead:

1. The error reaches the loop of the rank that ran out, as always (`torch.OutOfMemoryError`,
   on CPU `MemoryError`): the library cannot finish that rank's forward or backward for it. The
   root module's forward hook (registered with `always_call`) sees it pass in forward; in
   backward the next forward finds a backward that ended without the engine running it.
2. On that rank's next forward, before anything else, the library finishes the interrupted
   step's collectives without compute (`finish_interrupted_step`): it replays the schedule's
   verbs of the last complete step of the same kind from where the interrupted one stopped
   (`StepScript`), so it issues the same gathers and reductions as the other ranks, which are
   waiting in them, and ends the step as a training step (gradients not computed are reduced as
   zeros).
3. While a trial that adds memory is in force (its price is positive: [Note: autotune memory]
   in autotune_memory.py), every training step ends with one small all-gather of a flag over
   every rank of the model (the tuner's group, as its decisions): a rank that ran out sets it. When any rank did, every rank reverts the trial at that step (logged as "revert", "out
   of memory on rank(s) ..."), and every other rank raises `TrialOutOfMemoryError` (a
   `torch.OutOfMemoryError`) from its `backward()`, naming the ranks. So a loop that skips a
   batch on an out-of-memory error (`except torch.OutOfMemoryError: opt.zero_grad()`) skips the
   same step on every rank and goes on with the reverted knobs; a loop that does not ends on
   every rank with an error, and none hangs. That step's gradients are not a gradient of the
   batch (zeros stand for the rank that ran out): skip the optimizer step, as the loop does.
4. Outside such a trial (the configured knobs, the best ones, a move that holds less) nothing
   of this runs and an out-of-memory error is the user's, as under FSDP2. The flag costs one
   small collective per step of a trial that adds memory (on CUDA the host waits for it: the
   price of an answer before the optimizer step), none once settled.
The replay needs the step's structure to be the one of the last complete step (the same units,
forwards and backwards, as every rank's must be anyway: [Note: collective order] in
schedule.py); an error raised inside the library's own hooks between two of its collectives
(out of memory for a gather buffer) leaves a collective half issued that no replay can finish:
the other ranks then raise at the collective timeout, as for any rank that fails mid-step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch

from overlap.engine.schedule import Phase, Schedule


class InterruptedStep(Protocol):
    """What finishing an interrupted step needs of the model's `OverlapState` (named by its
    shape, so this module sits below state.py, which imports the tuner)."""

    rank: int
    schedule: Schedule
    runtime: Any
    units: Any

    def _run(self, actions: list[Any]) -> None: ...

    def _end_backward(self) -> None: ...


OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)

_VERBS = (
    "begin_forward",
    "pre_forward",
    "post_forward",
    "end_forward",
    "begin_backward",
    "pre_backward",
    "post_backward",
    "end_backward",
)


class TrialOutOfMemoryError(torch.OutOfMemoryError):
    """Another rank ran out of memory in this autotune trial step; the trial is reverted on every
    rank. Skip the step as for an out-of-memory error of this rank ([Note: out of memory in a
    trial] in engine/autotune_oom.py)."""


class StepScript:
    """The schedule's verbs of the step under way and of the last complete step of each kind
    (gradients reduced or not), in the order the hooks called them: what a rank whose step was
    interrupted replays."""

    def __init__(self, schedule: Schedule, active: Callable[[], bool]) -> None:
        self.schedule, self.active = schedule, active  # active: recording (while searching)
        self.current: list[tuple[str, tuple]] = []
        self.complete: dict[bool, list[tuple[str, tuple]]] = {}  # sync_grads -> its last complete step
        for name in _VERBS:
            setattr(schedule, name, self._recording(name, getattr(schedule, name)))

    def _recording(self, name: str, verb: Any) -> Any:
        def record(*args: Any) -> Any:
            if not self.active():
                self.current, self.complete = [], {}
                return verb(*args)
            if name == "begin_forward" and self.schedule.phase is Phase.IDLE:
                self.current = []  # a new step
            self.current.append((name, args))
            out = verb(*args)
            if name == "end_backward":
                self.complete[self.schedule.sync_grads] = self.current
            return out

        return record

    def rest(self) -> list[tuple[str, tuple]]:
        """The verbs the interrupted step has not run yet: the last complete step's after the
        ones this step ran, which must be the same."""
        done = self.current
        script = self.complete.get(self.schedule.sync_grads, [])
        if script[: len(done)] != done:
            raise RuntimeError(
                "overlap autotune: a step interrupted by an error cannot be finished: it ran other "
                "units or in another order than the last complete step"
            )
        return script[len(done) :]


def out_of_memory_passing() -> BaseException | None:
    """The out-of-memory error being handled now, if any (called from an always_call hook)."""
    error = sys.exc_info()[1]
    return error if isinstance(error, OUT_OF_MEMORY) else None


def backward_abandoned(schedule: Schedule) -> bool:
    """A backward that ended without the engine running it (an error inside it): the phase says
    backward while no backward runs. (`_current_graph_task_id`, what torch.utils.checkpoint
    asks too, is -1 outside a backward; without it, only forward errors are caught.)"""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return schedule.phase is Phase.BACKWARD and task_id is not None and task_id() == -1


def finish_interrupted_step(state: InterruptedStep, script: StepScript) -> None:
    """Issue the rest of the interrupted step's collectives, without compute, and end it as the
    engine's end-of-backward callback would ([Note: out of memory in a trial])."""
    schedule = state.schedule
    rest = script.rest()
    state.runtime.sync_grads = schedule.sync_grads
    for unit in state.units:  # what the interrupted backward accumulated is not a gradient
        for param in unit.unsharded_params:
            param.grad = None
    for name, args in rest:
        if name == "end_backward":
            state._end_backward()
            return
        actions = getattr(schedule, name)(*args)
        if actions:
            state._run(actions)
    raise AssertionError(f"rank {state.rank}: the replayed step has no end_backward")
