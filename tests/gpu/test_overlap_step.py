"""How much of a step's communication is hidden: the median step with the real (world size 1)
collectives, then with a stand-in torch.cuda._sleep before each collective adding up to half the
step. CUDA only."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from .helpers.common import TIMED_STEPS, Sizes, make_input, sleep_cycles_per_ms, synchronize, train_step, wrapped
from .helpers.delays import patched_comm
from .helpers.report import PartRecord

pytestmark = pytest.mark.cuda
HIDDEN_BAR = 0.5


def median_step_ms(device: torch.device, step: Callable[[], Any], n: int = TIMED_STEPS) -> float:
    times = []
    for _ in range(n):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@pytest.mark.part("overlap")
@pytest.mark.usefixtures("world1")
def test_overlap(device: torch.device, sizes: Sizes, record: PartRecord) -> None:
    record.bar = f"hidden share of the stand-in comm >= {HIDDEN_BAR} (1.0 = all hidden, 0 = none)"
    model, opt = wrapped(sizes, device)
    x = make_input(sizes, device)
    calls: Counter = Counter()

    def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            calls[fn.__name__] += 1
            return fn(*a, **k)

        return call

    for _ in range(2):
        train_step(model, opt, x)
    with patched_comm(counting):
        train_step(model, opt, x)
    num_collectives = sum(calls.values())
    real_ms = median_step_ms(device, lambda: train_step(model, opt, x))
    standin_total_ms = 0.5 * real_ms
    per_collective_ms = standin_total_ms / max(1, num_collectives)
    cycles = int(per_collective_ms * sleep_cycles_per_ms())

    def with_sleep(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            torch.cuda._sleep(cycles)  # on the stream the runtime issues the collective from
            return fn(*a, **k)

        return call

    with patched_comm(with_sleep):
        train_step(model, opt, x)
        standin_ms = median_step_ms(device, lambda: train_step(model, opt, x))
    hidden = 1.0 - (standin_ms - real_ms) / standin_total_ms
    record.progress({"collectives_per_step": dict(calls), "real_step_ms": real_ms, "standin_step_ms": standin_ms,
                     "standin_comm_ms_per_step": standin_total_ms, "standin_ms_per_collective": per_collective_ms,
                     "serial_would_be_ms": real_ms + standin_total_ms, "hidden_share": hidden})  # fmt: skip
    assert hidden >= HIDDEN_BAR, f"hidden share {hidden:.2f}"
