"""Per-step accounting: how long the compute thread waited on communication, and what moved."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StepStats:
    """What the last completed step did. Times are wall-clock on the calling thread.

    `allgather_wait_ms` / `reduce_wait_ms` are the *exposed* communication: the time the
    training thread spent blocked on an all-gather or reduce-scatter (plus the copy-out that
    follows a gather). Communication that finished while compute ran costs nothing here.
    """

    step: int = 0
    allgather_wait_ms: float = 0.0
    reduce_wait_ms: float = 0.0
    num_allgathers: int = 0
    num_reduce_scatters: int = 0
    allgather_bytes: int = 0
    """Bytes each rank receives from all-gathers (the full unsharded units, padding included)."""
    reduce_scatter_bytes: int = 0
    """Bytes each rank contributes to reduce-scatters (full unit gradients, padding included)."""
    num_allreduces: int = 0
    """HSDP: all-reduces of reduced gradient shards across replicas (0 without replicas)."""
    allreduce_bytes: int = 0
    max_unsharded_units: int = 0
    """Most units holding unsharded parameters at one moment during the step."""
    max_unsharded_bytes: int = 0
    unit_waits_ms: dict[str, float] = field(default_factory=dict)
    """Exposed wait per unit label ("unit3 gather", "bucket0 reduce"), for the biggest offenders."""
    collective_ms: dict[str, float] = field(default_factory=dict)
    """Issue-to-ready time per collective (an upper bound: "ready" is when it was waited on)."""
    step_ms: float = 0.0
    """From the step's first forward to the end of its backward (or of an eval forward)."""
    gap_ms: float = 0.0
    """From the end of the previous step to this step's first forward: the optimizer step, data
    loading and whatever else the training loop does between steps."""

    @property
    def exposed_comm_ms(self) -> float:
        return self.allgather_wait_ms + self.reduce_wait_ms


class StatsRecorder:
    """Collects one step's numbers; `finish()` publishes them as the last `StepStats`."""

    def __init__(self) -> None:
        self.current = StepStats()
        self.last: StepStats | None = None
        self._step_start: float | None = None
        self._last_end: float | None = None

    def begin_step(self) -> None:
        """The first forward of a step starts."""
        now = time.perf_counter()
        self._step_start = now
        if self._last_end is not None:
            self.current.gap_ms = (now - self._last_end) * 1e3

    def record_latency(self, label: str, t_issue: float) -> None:
        self.current.collective_ms[label] = (time.perf_counter() - t_issue) * 1e3

    def record_wait(self, kind: str, label: str, t0: float) -> None:
        ms = (time.perf_counter() - t0) * 1e3
        if kind == "gather":
            self.current.allgather_wait_ms += ms
        else:
            self.current.reduce_wait_ms += ms
        self.current.unit_waits_ms[label] = self.current.unit_waits_ms.get(label, 0.0) + ms

    def record_issue(self, kind: str, num_bytes: int) -> None:
        if kind == "gather":
            self.current.num_allgathers += 1
            self.current.allgather_bytes += num_bytes
        elif kind == "all_reduce":
            self.current.num_allreduces += 1
            self.current.allreduce_bytes += num_bytes
        else:
            self.current.num_reduce_scatters += 1
            self.current.reduce_scatter_bytes += num_bytes

    def record_unsharded(self, num_units: int, num_bytes: int) -> None:
        cur = self.current
        cur.max_unsharded_units = max(cur.max_unsharded_units, num_units)
        cur.max_unsharded_bytes = max(cur.max_unsharded_bytes, num_bytes)

    def finish(self) -> None:
        now = time.perf_counter()
        if self._step_start is not None:
            self.current.step_ms = (now - self._step_start) * 1e3
        self._step_start, self._last_end = None, now
        self.last = self.current
        self.current = StepStats(step=self.last.step + 1)
