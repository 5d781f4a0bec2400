"""Delays injected into the runtime's collectives and waits, and the host's event waits counted.

[Note: injected delays]
The second run of each world config wraps the runtime's collectives and waits: a delay before each
collective is issued (on the comm stream it is issued from), one after each wait on a collective
(on that comm stream, before its copy-out or decode), and one on the compute stream before each
Free and ReleaseReduce. On CUDA a delay is `torch.cuda._sleep` of 0.05, 0.3 or 1.5 ms (drawn from
a seeded generator per rank), so a missing stream wait or event lets a reader see data that is not
there yet, and the run differs from the undelayed one; on CPU it is `time.sleep`, which tests the
bookkeeping only. The count of each kind is reported: a run with none proves nothing.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .common import patched, sleep_cycles_per_ms
from .internals import Reductions, Runtime, coded, comm

DELAYS_MS = (0.05, 0.3, 1.5)
COLLECTIVES = ((comm, "all_gather_flat"), (comm, "reduce_scatter_flat"), (comm, "all_reduce_flat"),
               (coded, "all_gather_encoded"), (coded, "reduce_scatter_encoded"))  # fmt: skip


def patched_comm(wrap_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> contextlib.AbstractContextManager:
    """overlap's two plain collectives replaced by `wrap_fn(original)` (the runtime calls them
    through the module)."""
    return patched([(comm, n, wrap_fn) for n in ("all_gather_flat", "reduce_scatter_flat")])


@contextlib.contextmanager
def injected_delays(device: torch.device, counts: Counter, seed: int) -> Iterator[None]:
    """[Note: injected delays]; `counts` gets the number of each kind."""
    rng = random.Random(seed)
    if device.type == "cuda":
        per_ms = sleep_cycles_per_ms()

        def delay() -> None:
            torch.cuda._sleep(int(rng.choice(DELAYS_MS) * per_ms))  # on the current stream
    else:

        def delay() -> None:
            time.sleep(rng.choice(DELAYS_MS) / 1e3)

    def before(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*a: Any, **k: Any) -> Any:
                counts[kind] += 1
                delay()
                return fn(*a, **k)

            return call

        return wrap

    def after_wait(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(result: Any, timeout: Any = None) -> Any:
            if result.work is not None:
                result.work.wait() if timeout is None else result.work.wait(timeout)
                counts["after_wait"] += 1
                delay()  # on the comm stream, before copy-out / decode (`finish`)
                result = result._replace(work=None)
            return fn(result, timeout)

        return call

    patches: list[tuple[Any, str, Any]] = [(module, n, before("before_collective")) for module, n in COLLECTIVES]
    patches += [(comm, "wait", after_wait), (Runtime, "free", before("before_free")),
                (Reductions, "release_reduce", before("before_release_reduce"))]  # fmt: skip
    with patched(patches):
        yield


@contextlib.contextmanager
def counted_event_waits(waits: list[float]) -> Iterator[None]:
    """torch.cuda.Event.synchronize timed (sync debug mode does not see it): host ms per call."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self)
            finally:
                waits.append((time.perf_counter() - t0) * 1e3)

        return call

    with patched([(torch.cuda.Event, "synchronize", wrap)]):
        yield
