"""The training thread's cost of the wrapper itself, per unit: what runs around a unit's forward
and backward besides the collectives and their copies (measured apart in `measure_host`).

[Note: hook cost]
A wrapped model's forward and backward run the schedule's verbs at every unit: the pre-forward
and post-forward hooks, the pre-backward hook, the gradient-ready hooks and the post-backward
bookkeeping (views of the unsharded buffer as parameters, phase and order checks, span timers).
None of it moves bytes over a link, so the link fit, the compute profile (the plain model) and
the host costs around the collectives all leave it out; on loopback W1 it was most of what the
calibrated model predicted too fast (about 2% of the step, every config). It is measured here
with nothing else in the way: the wrapped W1 with every unit already gathered (`unshard()`) and
`no_sync()` (no reduction), beside the plain W1, interleaved repetition by repetition. The
difference is charged per unit, not per byte: the verbs run once per unit whatever its size.

Both are timed in the training thread's CPU time (`time.thread_time`), not on the wall clock:
the difference is a few milliseconds in some hundreds, and CPU time does not count the time the
thread waited for a core, which other processes on a shared machine would otherwise add to
either side at random (the compute profile stays on the wall clock: there, sharing the cores
with the ranks' own communication is part of what is measured). On CPU autograd runs the
backward on the calling thread, so its CPU time is the backward's. Under `no_sync` the
gradient-ready hooks keep the unsharded gradients instead of packing them for a reduction (that
packing is `reduce_issue_s` of the host costs).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

HOOK_REPS = 6
HOOK_WARMUP = 2


def measure_hooks(
    wrapped: nn.Module, plain: nn.Module, batch: tuple[torch.Tensor, ...], reps: int = HOOK_REPS
) -> tuple[float, float]:
    """(forward, backward) seconds of training-thread CPU time the wrapper adds per unit of
    `wrapped` (an `overlap.wrap`ped copy of `plain`): the median over `reps` interleaved
    repetitions of (wrapped - plain), divided by the number of units; never below 0. Collective
    over the wrapped model's group (`unshard`)."""
    state: Any = wrapped._overlap_state  # OverlapState: its units are what the hooks run per
    num_units = len(state.runtime.units)
    x = batch[0]
    diffs: list[tuple[float, float]] = []
    for rep in range(HOOK_WARMUP + reps):
        wrapped.unshard()  # type: ignore[operator]  # collective; untimed
        with wrapped.no_sync():  # type: ignore[operator]
            wrapped_s = _forward_backward(wrapped, x)
        wrapped.zero_grad(set_to_none=True)
        wrapped.reshard()  # type: ignore[operator]
        plain_s = _forward_backward(plain, x)
        plain.zero_grad(set_to_none=True)
        if rep >= HOOK_WARMUP:
            diffs.append((wrapped_s[0] - plain_s[0], wrapped_s[1] - plain_s[1]))
    forward, backward = (max(0.0, statistics.median(d)) / num_units for d in zip(*diffs))
    return forward, backward


def _forward_backward(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """Training-thread CPU seconds of one forward (the loss included) and its backward."""
    t0 = time.thread_time()
    loss = model(x).pow(2).mean()
    t1 = time.thread_time()
    loss.backward()
    t2 = time.thread_time()
    return t1 - t0, t2 - t1
