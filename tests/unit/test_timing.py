"""SpanTimer: the CUDA event logic driven on CPU by fake events whose completion the test
controls (spans harvested only once complete, a step late, never blocking; a bounded event
pool; device times placed on the host clock), the host timer, and StepStats fed from both."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from overlap.observe.stats import StatsRecorder
from overlap.observe.timing import EventTimer, HostTimer, Span, SpanTimer

MS = 1_000_000  # ns


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: list[FakeEvent] = []  # recorded, not yet run

    def run(self, *times_ms: float) -> None:
        """The device reaches the next len(times_ms) recorded events at these times."""
        assert len(times_ms) <= len(self.queue), (self.name, len(self.queue))
        for event, t in zip(list(self.queue), times_ms):
            event.time_ms = t
            self.queue.remove(event)

    def run_all(self, t_ms: float) -> None:
        self.run(*[t_ms] * len(self.queue))


class FakeEvent:
    """Like torch.cuda.Event: query() is True once the stream ran it; elapsed_time() of an
    incomplete event is an error (CUDA raises cudaErrorNotReady); any host wait fails."""

    def __init__(self, backend: FakeDevice) -> None:
        self.backend = backend
        self.time_ms: float | None = None

    def record(self, stream: FakeStream) -> None:
        for s in self.backend.streams:  # re-recording an event overwrites its pending record
            if self in s.queue:
                s.queue.remove(self)
        self.time_ms = None
        stream.queue.append(self)

    def query(self) -> bool:
        self.backend.num_queries += 1
        return self.time_ms is not None

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.time_ms is not None and end.time_ms is not None, "elapsed_time on an incomplete event"
        return end.time_ms - self.time_ms

    def synchronize(self) -> None:
        raise AssertionError("the timer blocked the host on an event")

    wait = synchronize


class FakeDevice:
    def __init__(self) -> None:
        self.compute, self.comm = FakeStream("compute"), FakeStream("comm")
        self.streams = (self.compute, self.comm)
        self.num_created = 0
        self.num_queries = 0

    def new_event(self) -> FakeEvent:
        self.num_created += 1
        return FakeEvent(self)

    def current_stream(self) -> FakeStream:
        return self.compute


class FakeClock:
    def __init__(self) -> None:
        self.now_ns = 1_000 * MS

    def __call__(self) -> int:
        return self.now_ns


def one_step(timer: SpanTimer, dev: FakeDevice, label: str = "unit1") -> None:
    """Host side of a step: a gathered unit whose wait stalls compute. Events, in order:
    compute [begin, stall start, stall end, step end]; comm [collective start, end]."""
    timer.begin_step()
    tok = timer.start("collective", "gather", label, dev.comm, num_bytes=100)
    timer.stop(tok, dev.comm)
    tok = timer.start("stall", "gather", label)
    timer.stop(tok)


def by_kind(spans: list[Span]) -> dict[str, Span]:
    return {s.kind: s for s in spans}


def test_spans_arrive_once_complete_a_step_late_without_blocking():
    dev, clock = FakeDevice(), FakeClock()
    timer = EventTimer(dev, clock=clock)
    stats = StatsRecorder()
    one_step(timer, dev)
    stats.record_spans(timer.harvest())
    assert stats.finish(timer.oldest_open_step) == [] and stats.last is None  # nothing ran yet
    assert timer.oldest_open_step == 0
    # the device runs step 0: compute begins at 0, waits for the gather 5..9, ends at 20
    dev.compute.run(0.0, 5.0, 9.0, 20.0)
    dev.comm.run(1.0, 9.0)
    clock.now_ns += 30 * MS
    timer.begin_step()  # step 1, not run
    spans = timer.harvest()
    assert {s.step for s in spans} == {0}  # recorded in step 0, harvested in step 1
    got = by_kind(spans)
    assert got["collective"].duration_ms == pytest.approx(8.0) and got["collective"].num_bytes == 100
    assert got["stall"].duration_ms == pytest.approx(4.0)
    assert got["step"].duration_ms == pytest.approx(20.0)
    assert all(s.device_timed for s in spans)
    # placed on the host clock relative to the step's begin event ([Note: device clock])
    assert got["collective"].start_ns - got["step"].start_ns == 1 * MS
    assert got["stall"].start_ns - got["step"].start_ns == 5 * MS
    assert timer.oldest_open_step == 1
    stats.record_spans(spans)
    (step0,) = stats.finish(timer.oldest_open_step)
    assert stats.last is step0 and step0.step == 0 and step0.device_timed
    assert step0.exposed_comm_ms == pytest.approx(4.0)  # not the ~0 of host timing on NCCL
    assert step0.allgather_wait_ms == pytest.approx(4.0)
    assert step0.unit_waits_ms == {"unit1 gather": pytest.approx(4.0)}
    assert step0.collective_ms == {"unit1 gather": pytest.approx(8.0)}
    assert step0.step_ms == pytest.approx(20.0)


def test_incomplete_span_waits_and_only_complete_events_are_read():
    dev = FakeDevice()
    timer = EventTimer(dev)
    one_step(timer, dev)
    timer.harvest()
    dev.compute.run(0.0, 5.0)  # begin, stall start: the stall's end has not run
    dev.comm.run(1.0, 3.0)
    spans = timer.harvest()  # FakeEvent.elapsed_time asserts on incomplete events
    assert [s.kind for s in spans] == ["collective"]
    assert timer.oldest_open_step == 0
    dev.compute.run_all(12.0)
    later = by_kind(timer.harvest())
    assert set(later) == {"stall", "step"} and later["stall"].step == 0
    assert later["stall"].duration_ms == pytest.approx(7.0)
    assert timer.oldest_open_step is None


def test_event_pool_is_bounded():
    dev = FakeDevice()
    timer = EventTimer(dev, max_pending_steps=4)
    counts = []
    for step in range(60):  # the device finishes each step while the host runs the next
        one_step(timer, dev, label=f"unit{step % 3}")
        spans = timer.harvest()
        assert step == 0 or {s.step for s in spans} == {step - 1}
        for s in dev.streams:
            s.run_all(float(step))
        counts.append(dev.num_created)
    assert counts[-1] == counts[5], counts  # steady state: every event reused
    assert counts[-1] <= 2 * 6 + 1  # two steps of 6 events, plus the anchor the next chains to
    # a device that never finishes: spans are given up after max_pending_steps, events reused
    for i in range(40):
        one_step(timer, dev)
        assert timer.harvest() == [] or i == 0  # the first returns the last finished step
    # at most max_pending_steps steps of 6 events in flight, plus the step being recorded and
    # the anchors the pending spans are placed by
    assert timer.num_dropped > 0 and dev.num_created <= 6 * (timer.max_pending_steps + 2)
    assert timer.oldest_open_step is not None and timer.oldest_open_step >= timer.step - timer.max_pending_steps - 1


def test_device_clock_is_exact_once_the_gpu_was_idle():
    """The begin event of step 0 ran 5 ms after the host enqueued it (GPU busy); step 1's ran
    the moment it was enqueued (GPU idle). The offset then becomes exact, for step 0's spans too."""
    dev, clock = FakeDevice(), FakeClock()
    timer = EventTimer(dev, clock=clock)
    h0 = clock.now_ns
    one_step(timer, dev)
    timer.harvest()
    clock.now_ns = h0 + 50 * MS
    timer.begin_step()
    # device timeline, true host time of device 0 is h0 + 5 ms
    dev.compute.run(0.0, 6.0, 8.0, 30.0, 45.0)  # A0, stall, step end, A1 (at h0 + 50 ms)
    dev.comm.run(2.0, 8.0)
    got = by_kind(timer.harvest())
    assert got["step"].start_ns == h0 + 5 * MS
    assert got["collective"].start_ns == h0 + 7 * MS
    assert got["stall"].start_ns == h0 + 11 * MS


def test_stats_publish_in_order_and_give_up_after_max_lag():
    stats = StatsRecorder(max_lag_steps=2)
    assert [s.step for s in stats.finish(oldest_open_step=0)] == []
    assert [s.step for s in stats.finish(oldest_open_step=0)] == []  # step 0 still open
    assert [s.step for s in stats.finish(oldest_open_step=0)] == [0]  # two steps late: given up
    assert [s.step for s in stats.finish(oldest_open_step=None)] == [1, 2, 3]
    stats.record_spans([Span("stall", "gather", "u", 1, 0, 5.0)])  # too late: dropped
    assert stats.last is not None and stats.last.step == 3 and stats.current.step == 4


class FakeWork:
    """A gloo-like work handle: with or without a future; done when the test says so."""

    def __init__(self, has_future: bool) -> None:
        self.has_future = has_future
        self.done = threading.Event()
        self.callbacks: list[Any] = []

    def get_future(self) -> Any:
        if not self.has_future:
            raise RuntimeError("getFuture not implemented")
        return self

    def then(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def complete(self) -> None:
        for callback in self.callbacks:
            callback(self)
        self.done.set()

    def wait(self, timeout: Any = None) -> bool:
        assert self.done.wait(120), "FakeWork never completed"
        return True


def test_host_timer_stamps_waits_and_completion():
    clock = FakeClock()
    timer = HostTimer(clock=clock)
    with_future, without = FakeWork(True), FakeWork(False)
    timer.begin_step()
    gather = timer.start("collective", "gather", "unit1", num_bytes=8)
    timer.stop(gather, work=with_future)
    reduce = timer.start("collective", "reduce", "bucket0 [unit1]")
    timer.stop(reduce, work=without)
    clock.now_ns += 2 * MS
    stall = timer.start("stall", "gather", "unit1")
    clock.now_ns += 3 * MS
    with_future.complete()  # gloo runs the callback before wait() returns
    timer.stop(stall)
    clock.now_ns += 1 * MS
    got = {(s.kind, s.op): s for s in timer.harvest()}
    assert set(got) == {("collective", "gather"), ("stall", "gather"), ("step", "step")}
    assert got["collective", "gather"].duration_ms == pytest.approx(5.0)
    assert got["collective", "gather"].num_bytes == 8
    assert got["stall", "gather"].duration_ms == pytest.approx(3.0)
    assert got["step", "step"].duration_ms == pytest.approx(6.0)
    assert all(s.step == 0 and not s.device_timed for s in got.values())
    assert timer.harvest() == []
    # work without a future: stamped when the training thread's wait on it returns (never by a
    # second thread waiting on it: that corrupted gloo's reduce-scatter output); it arrives
    # later, with its issue step
    clock.now_ns += 1 * MS
    without.complete()
    assert timer.harvest() == []  # completed, but nobody has waited on it yet
    timer.waited(without)
    late = timer.harvest()
    assert [(s.kind, s.op, s.step) for s in late] == [("collective", "reduce", 0)]
    assert late[0].duration_ms == pytest.approx(7.0)
    assert timer.oldest_open_step is None  # host stats never wait for a late stamp


def test_host_stats_match_the_legacy_recorder():
    """The host timer's spans give StatsRecorder the numbers record_wait/record_latency gave."""
    clock = FakeClock()
    timer, stats = HostTimer(clock=clock), StatsRecorder()
    timer.begin_step()
    stats.begin_step()
    tok = timer.start("stall", "reduce", "bucket0 [unit1]")
    clock.now_ns += 7 * MS
    timer.stop(tok)
    stats.record_spans(timer.harvest())
    (done,) = stats.finish(timer.oldest_open_step)
    assert done.step == 0 and stats.last is done and not done.device_timed
    assert done.reduce_wait_ms == pytest.approx(7.0) and done.exposed_comm_ms == pytest.approx(7.0)
    assert done.unit_waits_ms == {"bucket0 [unit1] reduce": pytest.approx(7.0)}
    assert done.step_ms == pytest.approx(7.0)
