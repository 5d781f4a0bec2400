"""Per-step accounting: how long compute waited on communication, and what moved.

Times come from the spans of overlap/observe/timing.py (`StatsRecorder.record_spans`): on CPU the host
clock, on CUDA device events ([Note: device timing] in timing.py). CUDA figures arrive a step
late: the StepStats of step s is published when step s+1 ends (sometimes later), and
`overlap.step_stats(model)` returns the newest *complete* step; its `step` field says which.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from overlap.observe.timing import Span


@dataclass
class StepStats:
    """What one completed step did.

    `allgather_wait_ms` / `reduce_wait_ms` are the *exposed* communication: on CPU the time the
    training thread spent blocked on an all-gather or reduce-scatter (plus the copy-out that
    follows a gather); on CUDA the time the compute stream sat waiting on the comm streams'
    events. Communication that finished while compute ran costs nothing here.
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
    """Issue-to-completion time per collective ("unit3 (layers.2) gather", "bucket0 [unit3]
    reduce"). CPU: until the work completed (or was waited on, for work that cannot say when);
    CUDA: on the comm stream, queueing behind earlier collectives included."""
    step_ms: float = 0.0
    """From the step's first forward to the end of its backward (or of an eval forward); on
    CUDA as the compute stream ran it."""
    gap_ms: float = 0.0
    """From the end of the previous step to this step's first forward: the optimizer step, data
    loading and whatever else the training loop does between steps (host clock)."""
    device_timed: bool = False
    """True when the times above come from device events (CUDA), False: the host clock."""
    memory_peak_bytes: int = 0
    """High-water mark of the library's own buffers during the step, state included
    (`overlap.memory_stats` has it by kind; [Note: memory accounting] in memory.py)."""

    @property
    def exposed_comm_ms(self) -> float:
        return self.allgather_wait_ms + self.reduce_wait_ms


class StatsRecorder:
    """Collects each step's numbers; `finish()` publishes complete steps as `last`.

    A step is closed on the host by `finish()` and published once its spans are final (the
    timer's `oldest_open_step`), or `max_lag_steps` after it closed, whatever is missing; spans
    arriving after their step was published are dropped (the trace still shows them).
    """

    def __init__(self, max_lag_steps: int = 4) -> None:
        self.current = StepStats()
        self.last: StepStats | None = None
        self.max_lag_steps = max_lag_steps
        self._closed: dict[int, StepStats] = {}  # finished on the host, waiting for device spans
        self._step_start: float | None = None
        self._last_end: float | None = None

    def begin_step(self) -> None:
        """The first forward of a step starts."""
        now = time.perf_counter()
        self._step_start = now
        if self._last_end is not None:
            self.current.gap_ms = (now - self._last_end) * 1e3

    def record_spans(self, spans: Iterable[Span]) -> None:
        """Spans from `SpanTimer.harvest()`, each added to the step it was recorded in."""
        for span in spans:
            assert span.step <= self.current.step, f"span of step {span.step} from the future"
            stats = self.current if span.step == self.current.step else self._closed.get(span.step)
            if stats is None:
                continue  # its step was published already
            stats.device_timed |= span.device_timed
            if span.kind == "stall":
                self._add_wait(stats, span.op, span.name, span.duration_ms)
            elif span.kind == "collective":
                stats.collective_ms[span.name] = span.duration_ms
            else:
                stats.step_ms = span.duration_ms

    def record_latency(self, label: str, t_issue: float) -> None:
        """Host timing (perf_counter at issue to now): the path before SpanTimer."""
        self.current.collective_ms[label] = (time.perf_counter() - t_issue) * 1e3

    def record_wait(self, kind: str, label: str, t0: float) -> None:
        """Host timing (perf_counter before the wait to now): the path before SpanTimer."""
        self._add_wait(self.current, kind, label, (time.perf_counter() - t0) * 1e3)

    @staticmethod
    def _add_wait(stats: StepStats, kind: str, label: str, ms: float) -> None:
        if kind == "gather":
            stats.allgather_wait_ms += ms
        else:
            stats.reduce_wait_ms += ms
        stats.unit_waits_ms[label] = stats.unit_waits_ms.get(label, 0.0) + ms

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

    def record_memory(self, peak_bytes: int) -> None:
        self.current.memory_peak_bytes = max(self.current.memory_peak_bytes, peak_bytes)

    def record_unsharded(self, num_units: int, num_bytes: int) -> None:
        cur = self.current
        cur.max_unsharded_units = max(cur.max_unsharded_units, num_units)
        cur.max_unsharded_bytes = max(cur.max_unsharded_bytes, num_bytes)

    def finish(self, oldest_open_step: int | None = None) -> list[StepStats]:
        """Close the current step; publish, oldest first, every closed step older than
        `oldest_open_step` (None: all) or closed `max_lag_steps` ago. Returns those published;
        `last` is the newest of them (unchanged when none)."""
        now = time.perf_counter()
        closed = self.current
        if self._step_start is not None and not closed.step_ms:  # a step span (timer) wins
            closed.step_ms = (now - self._step_start) * 1e3
        self._step_start, self._last_end = None, now
        self._closed[closed.step] = closed
        self.current = StepStats(step=closed.step + 1)
        published: list[StepStats] = []
        for step in sorted(self._closed):
            final = oldest_open_step is None or step < oldest_open_step
            if not final and step > closed.step - self.max_lag_steps:
                break  # in order: a later step waits for this one
            published.append(self._closed.pop(step))
        if published:
            self.last = published[-1]
        return published
