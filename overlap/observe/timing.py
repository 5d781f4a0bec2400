"""Timing of communication spans without blocking the host: CUDA events on GPUs, clocks on CPU.

A `SpanTimer` times three kinds of span, each recorded in one step:

    collective  a collective from issue to completion ("gather", "reduce", "all_reduce")
    stall       the compute waiting on a collective: the exposed communication
    step        the step itself, from `begin_step()` to `harvest()`

The runtime calls `start(...) -> token` and `stop(token, ...)` around each, the training loop calls
`begin_step()` at a step's first forward and `harvest()` once at its end; `harvest()` returns every
span that has completed since the last call. StatsRecorder, TraceRecorder and Monitor read those.

[Note: device timing]
On CUDA (`EventTimer`) the host only enqueues: `start`/`stop` record a timing event on a stream,
and `harvest()` reads `elapsed_time` only for spans whose events `query()` True. Nothing
synchronizes, so a span is normally harvested a step after it was recorded; it keeps the step it
was recorded in, and the step's figures are complete (and published by StatsRecorder) one step
late. What the spans measure:
  - collective: an event on the comm stream before the collective is issued (after that stream
    waited for compute) and one after the comm stream waited for it (`work.wait()` there): issue
    to completion as that stream sees it, including queueing behind earlier collectives of the
    same communicator.
  - stall: an event on the compute stream just before its `wait_event` on a comm event and one
    just after: how long the compute stream sat idle waiting, the exposed communication.
  - step: the begin-step event and an event at harvest, both on the compute stream.
NCCL's own future completes at enqueue and a compute-stream wait returns at once on the host, so
neither can time anything on a GPU (why the host clock is useless there).
Events come from a pool: a harvested span's events are reused, and spans still incomplete
`max_pending_steps` after their step are dropped (counted in `num_dropped`), so the number of
events stays bounded however long the run.

[Note: device clock]
Trace timestamps are `time.perf_counter_ns()` (see [Note: trace clock] in trace.py). A device
span is placed relative to its step's begin event A_s; the device times of successive A_s are
chained (elapsed A_{s-1} -> A_s), and the chain is mapped onto the host clock by the offset
max(host time when A_s was enqueued - device time of A_s) over the last `clock_window` steps: an
event never runs before the host enqueues it, so each term is a lower bound of the true offset,
and the largest is exact whenever the GPU was idle when a step began. Spans of one step are exact
relative to one another; the whole device timeline may sit up to the GPU's queue lag early.

On CPU (`HostTimer`) spans are `perf_counter_ns()` stamps: a stall is the time the training thread
blocked in the wait; a collective ends when its work completes (a callback on its future, which
gloo runs before `wait()` returns; for work without a future, see `CompletionWaiter`). Host spans
are final at harvest, except the completion stamp of a collective still running then: it is
returned by a later harvest, with the step it was issued in.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

SpanKind = Literal["collective", "stall", "step"]


@dataclass(frozen=True, slots=True)
class Span:
    """One completed span. `op` is "gather", "reduce" or "all_reduce" ("step" for a step);
    `label` names the unit or bucket ("unit3 (layers.2)", "bucket0 [unit3,unit4]")."""

    kind: SpanKind
    op: str
    label: str
    step: int
    """The step the span was recorded in (not the one it was harvested in)."""
    start_ns: int
    """On the trace clock, `time.perf_counter_ns()` ([Note: device clock] for device spans)."""
    duration_ms: float
    num_bytes: int = 0
    device_timed: bool = False
    """True: measured with device events ([Note: device timing]); False: host clock."""

    @property
    def name(self) -> str:
        """The key in StepStats.unit_waits_ms / collective_ms, e.g. "unit3 (layers.2) gather"."""
        return f"{self.label} {self.op}"


@dataclass(slots=True)
class SpanToken:
    """What `start` returns; pass it to `stop`. Opaque to callers."""

    kind: SpanKind
    op: str
    label: str
    step: int
    num_bytes: int
    host_ns: int  # perf_counter_ns at start


class SpanTimer(ABC):
    """Records spans and hands them out once complete. See the module docstring."""

    device_timed: bool = False

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.step = 0  # the step new spans are recorded in; advanced by harvest()
        self._clock = clock  # the trace clock, injectable for tests

    @abstractmethod
    def begin_step(self, stream: Any = None) -> None:
        """The step's first forward starts (on `stream`, the compute stream; None: current)."""

    @abstractmethod
    def start(self, kind: SpanKind, op: str, label: str, stream: Any = None, num_bytes: int = 0) -> SpanToken:
        """A span starts now (CUDA: at this point of `stream`, None: the current stream)."""

    @abstractmethod
    def stop(self, token: SpanToken, stream: Any = None, work: Any = None) -> None:
        """The span ends. CUDA: at this point of `stream` (`work` is ignored: the stream has
        already waited for it). Host: when `work` completes, or now when `work` is None."""

    @abstractmethod
    def harvest(self, stream: Any = None) -> list[Span]:
        """End the step (its step span ends on `stream`), advance `step`, and return every span
        completed since the last harvest, whatever step it was recorded in. Never blocks."""

    @property
    def oldest_open_step(self) -> int | None:
        """The oldest step that may still produce spans for StepStats (None: every step before
        `step` is final). StatsRecorder publishes a step's StepStats once it is final."""
        return None

    def waited(self, work: Any) -> None:
        """The training thread's wait on `work` returned (host timers stamp work that cannot
        report its own completion; device timers ignore it)."""


# ---------------------------------------------------------------------------------- host (CPU)


class CompletionWaiter:
    """Calls `callback(perf_counter_ns())` when a work handle completes.

    Work with a future (gloo's all-gather, all-to-all, all-reduce) is stamped by a callback on
    it, which gloo runs on its worker thread before `wait()` returns. Work without one (gloo's
    native reduce-scatter: `get_future` raises, `is_completed()` stays False) is stamped when
    the training thread's own wait on it returns (`waited`), an upper bound. It must not be
    waited on from a second thread: two concurrent `wait()`s on gloo's reduce-scatter work
    corrupted its output (caught by the bitwise DDP parity test)."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns, use_futures: bool = True) -> None:
        self._clock = clock
        self._use_futures = use_futures
        self._unstamped: dict[int, tuple[Any, Callable[[int], None]]] = {}  # id(work) -> (work, callback)

    def on_complete(self, work: Any, callback: Callable[[int], None]) -> None:
        if work is None:  # ran synchronously (world size 1)
            callback(self._clock())
            return
        if not self._use_futures:
            self._unstamped[id(work)] = (work, callback)  # the work object is kept alive here
            return
        try:
            future = work.get_future()
        except RuntimeError:  # "getFuture not implemented" for this work type
            self._unstamped[id(work)] = (work, callback)
            return
        future.then(lambda _: callback(self._clock()))

    def waited(self, work: Any) -> None:
        """The training thread's wait on `work` returned: stamp it if nothing else could."""
        entry = self._unstamped.pop(id(work), None)
        if entry is not None:
            entry[1](self._clock())


class HostTimer(SpanTimer):
    """Host-clock spans (CPU / gloo). Spans may complete on gloo's threads.

    [Note: completion callbacks cost latency]
    A future callback is Python: gloo's worker thread must take the GIL to run it before the
    collective counts as done, and while the training thread holds the GIL (it usually does)
    that delays every collective. With latency-bound units (64 tiny blocks on two ranks, `overlap
    bench overhead`) the callbacks cost ~15% of the step. So collectives end at their exact
    completion only when someone reads it (`precise=True`: a trace, or the collective-slowdown
    alert); otherwise a collective's span ends when the training thread's wait on it returns,
    an upper bound, as gloo's reduce-scatter (which has no future) always does."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns, precise: bool = True) -> None:
        super().__init__(clock)
        self._lock = threading.Lock()
        self._done: list[Span] = []
        self._step_token: SpanToken | None = None
        self._waiter = CompletionWaiter(clock, use_futures=precise)

    def begin_step(self, stream: Any = None) -> None:
        self._step_token = self.start("step", "step", "step")

    def start(self, kind: SpanKind, op: str, label: str, stream: Any = None, num_bytes: int = 0) -> SpanToken:
        return SpanToken(kind, op, label, self.step, num_bytes, self._clock())

    def stop(self, token: SpanToken, stream: Any = None, work: Any = None) -> None:
        if work is None:
            self._finish(token, self._clock())
        else:
            self._waiter.on_complete(work, lambda t1_ns: self._finish(token, t1_ns))

    def waited(self, work: Any) -> None:
        self._waiter.waited(work)

    def _finish(self, token: SpanToken, t1_ns: int) -> None:
        span = Span(
            token.kind,
            token.op,
            token.label,
            token.step,
            token.host_ns,
            max(t1_ns - token.host_ns, 0) / 1e6,
            token.num_bytes,
        )
        with self._lock:
            self._done.append(span)

    def harvest(self, stream: Any = None) -> list[Span]:
        if self._step_token is not None:
            self.stop(self._step_token)
            self._step_token = None
        self.step += 1
        with self._lock:
            spans, self._done = self._done, []
        return spans


# ---------------------------------------------------------------------------------- device (CUDA)


class DeviceEvent(Protocol):
    """The part of `torch.cuda.Event` the timer uses."""

    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end_event: Any) -> float: ...


class EventBackend(Protocol):
    """Makes timing events and names the current stream; injectable so that tests on CPU can
    drive `EventTimer` with events whose completion they control."""

    def new_event(self) -> DeviceEvent: ...
    def current_stream(self) -> Any: ...


class CudaEvents:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_event(self) -> DeviceEvent:
        return torch.cuda.Event(enable_timing=True)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)


@dataclass
class _Anchor:
    """A step's begin event on the compute stream ([Note: device clock])."""

    event: DeviceEvent
    step: int
    host_ns: int  # perf_counter_ns just before the event was enqueued
    device_ms: float | None = None  # position on the chained device timeline, once known


@dataclass
class _EventToken(SpanToken):
    start_event: DeviceEvent | None = None
    end_event: DeviceEvent | None = None
    anchor: _Anchor | None = None  # the step's begin event, to place the span in time


class EventTimer(SpanTimer):
    """Device spans from timing events, read without synchronizing ([Note: device timing])."""

    device_timed = True

    def __init__(
        self,
        events: EventBackend,
        max_pending_steps: int = 8,
        clock_window: int = 64,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        super().__init__(clock)
        self._events = events
        self.max_pending_steps = max_pending_steps
        self._pool: list[DeviceEvent] = []
        self.num_events = 0  # events ever created: bounded in steady state
        self.num_dropped = 0  # spans given up on after max_pending_steps
        self._pending: list[_EventToken] = []  # started, not yet harvested, in start order
        self._anchors: deque[_Anchor] = deque()
        self._step_token: _EventToken | None = None
        self._offsets_ns: deque[float] = deque(maxlen=clock_window)

    def _event(self, stream: Any) -> DeviceEvent:
        if self._pool:
            event = self._pool.pop()
        else:
            event = self._events.new_event()
            self.num_events += 1
        event.record(stream if stream is not None else self._events.current_stream())
        return event

    def begin_step(self, stream: Any = None) -> None:
        host_ns = self._clock()  # before the enqueue: a lower bound of the event's time
        anchor = _Anchor(self._event(stream), self.step, host_ns)
        self._anchors.append(anchor)
        token = _EventToken("step", "step", "step", self.step, 0, host_ns, anchor.event, None, anchor)
        self._pending.append(token)
        self._step_token = token

    def start(self, kind: SpanKind, op: str, label: str, stream: Any = None, num_bytes: int = 0) -> SpanToken:
        token = _EventToken(
            kind,
            op,
            label,
            self.step,
            num_bytes,
            self._clock(),
            self._event(stream),
            None,
            self._anchors[-1] if self._anchors else None,
        )
        self._pending.append(token)
        return token

    def stop(self, token: SpanToken, stream: Any = None, work: Any = None) -> None:
        assert isinstance(token, _EventToken) and token.end_event is None, "stop called twice"
        token.end_event = self._event(stream)

    def harvest(self, stream: Any = None) -> list[Span]:
        if self._step_token is not None:
            self.stop(self._step_token, stream)
            self._step_token = None
        self.step += 1
        self._chain_anchors()
        spans: list[Span] = []
        pending: list[_EventToken] = []
        for token in self._pending:
            if self._complete(token):
                spans.append(self._span(token))
                self._release(token)
            elif token.step < self.step - self.max_pending_steps:
                self.num_dropped += 1
                self._release(token)
            else:
                pending.append(token)
        self._pending = pending
        self._trim_anchors()
        return spans

    @property
    def oldest_open_step(self) -> int | None:
        return min((t.step for t in self._pending), default=None)

    def _complete(self, token: _EventToken) -> bool:
        anchor = token.anchor
        return (
            token.end_event is not None
            and token.end_event.query()
            and token.start_event is not None
            and token.start_event.query()
            and (anchor is None or anchor.device_ms is not None)
        )

    def _span(self, token: _EventToken) -> Span:
        assert token.start_event is not None and token.end_event is not None
        anchor = token.anchor
        if anchor is None:  # no begin_step yet: place it where the host enqueued it
            start_ns = token.host_ns
        else:
            assert anchor.device_ms is not None
            start_ms = anchor.device_ms + anchor.event.elapsed_time(token.start_event)
            start_ns = int(max(self._offsets_ns) + start_ms * 1e6)
        duration_ms = max(token.start_event.elapsed_time(token.end_event), 0.0)
        return Span(token.kind, token.op, token.label, token.step, start_ns, duration_ms, token.num_bytes, True)

    def _chain_anchors(self) -> None:
        """Place newly completed begin events on the device timeline ([Note: device clock])."""
        previous: _Anchor | None = None
        for anchor in self._anchors:
            if anchor.device_ms is None:
                if not anchor.event.query():
                    break  # later anchors are behind it on the same stream
                if previous is None or previous.device_ms is None:
                    anchor.device_ms = 0.0  # first anchor (or a chain lost to dropped steps)
                    self._offsets_ns.clear()
                else:
                    anchor.device_ms = previous.device_ms + previous.event.elapsed_time(anchor.event)
                self._offsets_ns.append(anchor.host_ns - anchor.device_ms * 1e6)
            previous = anchor

    def _trim_anchors(self) -> None:
        """Keep the newest anchor (the next one chains to it) and every anchor a pending span
        still needs; anchors of dropped steps go back to the pool."""
        needed = min((t.anchor.step for t in self._pending if t.anchor is not None), default=self.step)
        while len(self._anchors) > 1 and (
            self._anchors[0].step < min(needed, self.step - self.max_pending_steps)
            or (self._anchors[0].step < needed and self._anchors[1].device_ms is not None)
        ):
            self._pool.append(self._anchors.popleft().event)

    def _release(self, token: _EventToken) -> None:
        if token.start_event is not None and (token.anchor is None or token.start_event is not token.anchor.event):
            self._pool.append(token.start_event)
        if token.end_event is not None:
            self._pool.append(token.end_event)
        token.start_event = token.end_event = None


def make_timer(device: torch.device, precise: bool = True) -> SpanTimer:
    """Event timing on CUDA devices, the host clock elsewhere (`precise`: see
    [Note: completion callbacks cost latency])."""
    return EventTimer(CudaEvents(device)) if device.type == "cuda" else HostTimer(precise=precise)
