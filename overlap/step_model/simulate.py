"""The runtime's own schedule on a virtual clock: predicted step time, exposed comm, memory.

The same `Schedule` that drives `overlap.wrap` decides every action here; only the executor
differs: instead of tensors and process groups it advances a clock. The training thread runs
the units' forward and backward in order; collectives go to communication lanes:

    nccl  one lane: one communicator runs its collectives in issue order (our reduce-scatters
          share the all-gathers' process group, so they queue behind prefetched gathers)
    gloo  two lanes: a gloo process group has two worker threads and runs two collectives at once

A wait advances the training thread's clock to the collective's end (that is the exposed time).

On a CPU host the communication also takes cycles from compute: `contention=Contention(...)`
charges it by the fluid model of [Note: fluid clock], its three terms measured directly
(overlap/tools/plan/calibrate.py). (An additive charge, step += c x comm busy time, was what
`overlap tune` used before the tools shared this model; it is gone: [Note: one model] in
calibration.py.)

[Note: fluid clock]
Time advances from event to event (a collective ends, the training thread's work ends); between
events every activity progresses at a constant rate:
    a collective  its share of the link (`link_shares`): the collectives in flight get the
                  link's `concurrent_throughput` (in solo speeds) in issue order, at most 1 each:
                  2 = independent lanes, 1 = strictly one after the other, between = the later
                  one gets what the earlier leaves. Issue order, not equal shares: on the
                  emulated 1 Gbit link, a one-layer gather issued just behind an all-to-all
                  finished with it (~120 ms), issued just ahead of it at about its solo time
                  (~60 ms), the pair in ~125-145 ms either way. On such a shared link the
                  collectives also complete in issue order: one whose bytes are through waits
                  (holding its lane) for those issued before it (a gather issued behind a
                  two-layer all-to-all was ready only after it). Divided by `comm_stretch`
                  while the training thread works (on loopback, gloo's copies need the cores)
    the training thread  1; (1 − `compute_share_lost`) while any collective is in flight
A collective's solo seconds come from the cost model (`ring_time_s`). Only the training thread
issues collectives, so nothing new arrives while it works or waits: the rates between two of
its actions are final, and stepping to the next event is exact. With the defaults (no
contention, lanes independent) this is the plain lane model: each collective takes its solo
time on the first free lane.

[Note: host work]
On CPU the collectives run on gloo's threads, but what surrounds them runs on the training
thread: the all-gather's copy-out into the unsharded buffer (and decoding, with a codec) happens
in its wait, the reduction's packing (and encoding) at its issue, the sum of received chunks
(and decoding) in its wait. `UnitCost.*_host_s` carry those seconds; the clock charges them to
the training thread where the runtime does the work, so they delay compute and the next issue.
On GPUs they are kernels on the comm streams (`gather_codec_s`, `reduce_codec_s`) and the
host fields stay 0. Through shared memory the collective itself is host work: the post at issue,
the pull (the peers' copies, the sum) in the wait, and nothing in flight between ([Note:
shared-memory collectives] in cost.py); an HSDP all-reduce through it is pulled at the bucket's
last wait, its seconds here charged with the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from overlap.config import OverlapConfig
from overlap.engine.schedule import (
    Action,
    CheckOrder,
    Free,
    Gather,
    Reduce,
    ReleaseReduce,
    Schedule,
    ScheduleConfig,
    WaitGather,
    WaitReduce,
)
from overlap.step_model.cost import Link, Topology, UnitCost, ring_time_s


@dataclass
class Prediction:
    step_s: float
    compute_s: float
    exposed_s: float
    comm_busy_s: float
    """Sum of the collectives' solo times (what they would take alone on an idle host)."""
    peak_unsharded_bytes: int
    peak_unsharded_units: int
    waits_s: dict[str, float] = field(default_factory=dict)
    num_allgathers: int = 0
    num_reduce_scatters: int = 0
    peak_reduce_bytes: int = 0
    """Most unsharded gradient bytes waiting for or in a reduction at once: a bucket's buffer
    lives from its issue (gradients ready) to the end of its collective."""
    events: list[tuple[str, str, float, float]] = field(default_factory=list)
    """(lane, name, start_s, end_s) of the simulated step, for plots and invariant checks."""
    host_s: float = 0.0
    """Training-thread seconds spent on collectives' host work ([Note: host work])."""
    forward_s: float = 0.0
    """From the step's start to the end of its forward (its last forward action run)."""
    backward_s: float = 0.0
    """From the end of the forward to the end of the backward (its last reduction waited for):
    `step_s` is `forward_s + backward_s` + the optimizer."""


@dataclass(frozen=True, kw_only=True)
class Contention:
    """How the training thread and concurrent collectives slow each other on a CPU host and a
    shared link; see [Note: fluid clock]. Each term comes from a microbenchmark of its own
    (benchmarks/plan_validate.py measures all three), never from the step times predicted."""

    compute_share_lost: float = 0.0
    """Share of its speed the training thread loses while a collective is in flight: compute
    alone vs the same compute beside a collective loop, 1 − alone / beside."""
    comm_stretch: float = 1.0
    """A collective takes this many times its solo time while the training thread works."""
    concurrent_throughput: float | None = None
    """Total throughput of the collectives in flight, in solo speeds, handed out in issue
    order: 2 for two independent lanes, 1 when they go one after the other on one wire.
    None: each lane at full speed."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.compute_share_lost < 1.0:
            raise ValueError(f"Contention.compute_share_lost must be in [0, 1), got {self.compute_share_lost!r}")
        if not self.comm_stretch >= 1.0:
            raise ValueError(f"Contention.comm_stretch must be >= 1, got {self.comm_stretch!r}")
        if self.concurrent_throughput is not None and not self.concurrent_throughput > 0:
            raise ValueError(f"Contention.concurrent_throughput must be > 0, got {self.concurrent_throughput!r}")


def link_shares(num_running: int, throughput: float | None) -> list[float]:
    """Rates of `num_running` collectives in flight, in issue order, as shares of their solo
    speed: the link's `throughput` is handed out in issue order, at most 1 each (None: every
    lane at full speed). See [Note: fluid clock]."""
    if throughput is None:
        return [1.0] * num_running
    rates, left = [], throughput
    for _ in range(num_running):
        rates.append(min(1.0, max(0.0, left)))
        left -= rates[-1]
    return rates


@dataclass
class _Collective:
    kind: str
    key: int
    name: str
    left_s: float  # solo seconds still to run
    issued_s: float
    start_s: float | None = None  # when a lane took it
    lane: int = -1
    num_bytes: int = 0  # reductions: the bucket's unsharded gradient bytes


_EPS_S = 1e-12
_NO_LINK = Link("none", 0.0, 1.0)  # batch_time_s times given solo seconds: no link needed


class _Clock:
    """Executes schedule actions on virtual time ([Note: fluid clock])."""

    def __init__(self, units: list[UnitCost], topo: Topology, lanes: int, record: bool, contention: Contention) -> None:
        self.units, self.topo = units, topo
        self.now = 0.0
        self.num_lanes = lanes
        self.lane_free_s = [0.0] * (2 * lanes)  # when each lane's last collective ended (HSDP: + the replicas')
        self.contention = contention
        self.flight: list[_Collective] = []  # issued, not finished; in issue order
        self.done: set[tuple[str, int]] = set()
        self.exposed = self.busy = self.compute = self.host = 0.0
        self.waits: dict[str, float] = {}
        self.counts = {"gather": 0, "reduce": 0, "allreduce": 0}
        self.record = record
        self.events: list[tuple[str, str, float, float]] = []
        self.gathered: set[int] = set()  # units whose gather finished and was waited on
        self.reduce_spans: list[tuple[float, float, int]] = []  # (issued, done, bytes)
        self.released: set[int] = set()  # buckets whose ReleaseReduce has run

    # ------------------------------------------------------------- the fluid core
    def _running(self) -> list[_Collective]:
        return [c for c in self.flight if c.start_s is not None]

    def _lanes_of(self, c: _Collective) -> range:
        """The lanes a collective may take: HSDP's all-reduces run on the replica group, a
        process group with lanes of its own."""
        if c.kind == "allreduce":
            return range(self.num_lanes, 2 * self.num_lanes)
        return range(self.num_lanes)

    def _start_queued(self) -> None:
        """Queued collectives take free lanes in issue order (the lane free the longest first)."""
        busy = {c.lane for c in self._running()}
        for c in self.flight:
            free = [lane for lane in self._lanes_of(c) if lane not in busy]
            if c.start_s is None and free:
                c.lane = min(free, key=lambda lane: self.lane_free_s[lane])
                c.start_s = self.now
                busy.add(c.lane)

    def _comm_rates(self, running: list[_Collective], thread_busy: bool) -> list[float]:
        rates = link_shares(len(running), self.contention.concurrent_throughput)
        stretch = self.contention.comm_stretch if thread_busy else 1.0
        return [r / stretch for r in rates]

    def _finish(self, c: _Collective) -> None:
        self.flight.remove(c)
        self.lane_free_s[c.lane] = self.now
        self.done.add((c.kind, c.key))
        if c.kind == "reduce":
            self.reduce_spans.append((c.issued_s, self.now, c.num_bytes))
        if self.record:
            assert c.start_s is not None
            self.events.append((f"comm{c.lane}", c.name, c.start_s, self.now))

    def _advance(self, work_s: float = 0.0, until: tuple[str, int] | None = None) -> None:
        """Step events until the training thread has done `work_s` seconds of work, or (with
        `until`) until that collective has finished while the thread waits."""
        left = work_s
        while True:
            if until is None and left <= _EPS_S:
                return
            if until is not None and until in self.done:
                return
            moving = [c for c in self._running() if c.left_s > _EPS_S]  # in issue order
            thread_busy = until is None
            rates = self._comm_rates(moving, thread_busy)
            thread_rate = 1.0 - self.contention.compute_share_lost if self._running() else 1.0
            dt = left / thread_rate if thread_busy else float("inf")
            for c, rate in zip(moving, rates):
                if rate > 0.0:
                    dt = min(dt, c.left_s / rate)
            assert dt < float("inf"), f"waiting for {until} with nothing in flight"
            self.now += dt
            if thread_busy:
                left -= dt * thread_rate
            for c, rate in zip(moving, rates):
                c.left_s -= dt * rate
            self._finish_done()
            self._start_queued()

    def _finish_done(self) -> None:
        """Finish the collectives whose bytes are through; on a shared link (a throughput is
        set) only in issue order: one whose bytes are through waits, holding its lane, until
        every collective issued before it has finished ([Note: fluid clock])."""
        in_order = self.contention.concurrent_throughput is not None
        for c in self._running():
            if c.left_s > _EPS_S:
                if in_order:
                    return
                continue
            self._finish(c)

    # ------------------------------------------------------------- actions
    def _issue(self, kind: str, key: int, seconds: float, name: str, num_bytes: int = 0) -> None:
        self.busy += seconds
        self.counts[kind] += 1
        self.flight.append(_Collective(kind, key, name, seconds, self.now, num_bytes=num_bytes))
        self._start_queued()
        self._finish_done()  # an empty collective (one rank) ends at once

    def _wait(self, kind: str, key: int, name: str) -> None:
        t0 = self.now
        self._advance(until=(kind, key))
        self.done.discard((kind, key))
        if self.now > t0:
            self.exposed += self.now - t0
            self.waits[name] = self.waits.get(name, 0.0) + self.now - t0
            if self.record:
                self.events.append(("wait", name, t0, self.now))

    def _work(self, seconds: float, lane: str, name: str) -> float:
        """The training thread works `seconds` (at full speed); returns the wall time it took."""
        t0 = self.now
        self._advance(work_s=seconds)
        if self.record:
            self.events.append((lane, name, t0, self.now))
        return self.now - t0

    def _host(self, seconds: float, name: str) -> None:
        if seconds > 0.0:
            self.host += self._work(seconds, "host", name)

    def compute_for(self, unit: int, seconds: float, what: str) -> None:
        assert unit in self.gathered, f"unit {unit} computed before its gather was waited on"
        self.compute += self._work(seconds, "compute", f"{what} {self.units[unit].name}")

    def _flying(self) -> set[tuple[str, int]]:
        return {(c.kind, c.key) for c in self.flight}

    def _all_reduce(self, bucket: int, indices: tuple[int, ...], names: str) -> None:
        """HSDP: the reduced shard (1/num_ranks of the bucket's gradients) is all-reduced
        across replicas as soon as its reduce-scatter is summed, and waited for at the
        bucket's WaitReduce (engine/reduction.py, `_reduced` and `wait_reduce`)."""
        replicas = self.topo.replicas()
        if replicas is None:
            return
        shard_bytes = sum(self.units[i].grad_bytes for i in indices) / self.topo.num_ranks
        seconds = ring_time_s("all_reduce", shard_bytes, replicas)
        self._issue("allreduce", bucket, seconds, f"all-reduce [{names}]")

    def peak_reduce_bytes(self) -> int:
        """Sweep over the reduce buffers' lifetimes (issue -> done) for the most bytes alive."""
        points = [(t0, b) for t0, _, b in self.reduce_spans] + [(t1, -b) for _, t1, b in self.reduce_spans]
        alive = peak = 0
        for _, delta in sorted(points, key=lambda p: (p[0], p[1])):  # frees before allocations
            alive += delta
            peak = max(peak, alive)
        return peak

    def run(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Gather):
                u = self.units[a.unit]
                issue = u.gather_issue_host_s
                if a.for_backward and u.backward_gather_issue_host_s is not None:
                    issue = u.backward_gather_issue_host_s
                self._host(issue, f"issue gather {u.name}")
                self._issue("gather", a.unit, u.gather_s(self.topo), f"gather {u.name}")
            elif isinstance(a, WaitGather):
                u = self.units[a.unit]
                self._wait("gather", a.unit, f"gather {u.name}")
                self._host(u.gather_wait_host_s, f"copy-out {u.name}")
                self.gathered.add(a.unit)
            elif isinstance(a, Free):
                self.gathered.discard(a.unit)
            elif isinstance(a, Reduce):
                bucket = [self.units[i] for i in a.units]
                wire = sum(u.grad_bytes if u.reduce_wire_bytes is None else u.reduce_wire_bytes for u in bucket)
                seconds = ring_time_s(bucket[0].reduce_op, wire, self.topo) + sum(u.reduce_codec_s for u in bucket)
                names = ",".join(u.name for u in bucket)
                self._host(sum(u.reduce_issue_host_s for u in bucket), f"pack [{names}]")
                num_bytes = sum(u.grad_bytes for u in bucket)
                self._issue("reduce", a.bucket, seconds, f"reduce [{names}]", num_bytes)
            elif isinstance(a, (ReleaseReduce, WaitReduce)):
                names = ",".join(self.units[i].name for i in a.units)
                if a.bucket not in self.released:  # else the wait and the sum are done
                    if isinstance(a, ReleaseReduce):
                        self.released.add(a.bucket)
                    self._wait("reduce", a.bucket, f"reduce [{names}]")
                    self._host(sum(self.units[i].reduce_wait_host_s for i in a.units), f"sum [{names}]")
                    self._all_reduce(a.bucket, a.units, names)
                if isinstance(a, WaitReduce) and ("allreduce", a.bucket) in self.done | self._flying():
                    self._wait("allreduce", a.bucket, f"all-reduce [{names}]")
            elif isinstance(a, CheckOrder):
                pass  # first step only; the simulated step is a steady one


def batch_time_s(solo_s: list[float], lanes: int, contention: Contention) -> float:
    """Seconds until collectives of these solo times, all issued at once by an idle training
    thread, have finished on this clock: the microbenchmark that calibrates
    `Contention.concurrent_throughput` is inverted through it (benchmarks/plan_validate.py)."""
    clock = _Clock([], Topology(1, 1, _NO_LINK, _NO_LINK), lanes, False, contention)
    for i, seconds in enumerate(solo_s):
        clock._issue("gather", i, seconds, f"c{i}")
    for i in range(len(solo_s)):
        clock._wait("gather", i, f"c{i}")
    return clock.now


def simulate(
    units: list[UnitCost],
    config: OverlapConfig,
    topo: Topology,
    backend: str = "nccl",
    root: int | None = None,
    optimizer_s: float = 0.0,
    record: bool = False,
    contention: Contention | None = None,
) -> Prediction:
    """Predict one steady-state step of a model whose units run in index order.

    `units[root]` (if given) is the root unit: gathered at the start of forward, its forward
    compute first (embeddings) and its backward compute last, freed when backward ends.
    Host contention: `contention` (the fluid model; see the module docstring).
    """
    fluid = contention or Contention()
    schedule = Schedule(
        [u.param_bytes for u in units], [u.grad_bytes for u in units], ScheduleConfig.from_config(config), root=root
    )
    order = [i for i in range(len(units)) if i != root]
    lanes = 2 if backend == "gloo" else 1
    clock = _Clock(units, topo, lanes, False, fluid)
    for step in range(2):  # the first step records the order; the second is the steady state
        if step == 1:
            clock = _Clock(units, topo, lanes, record, fluid)
        schedule.reset_peak()
        clock.run(schedule.begin_forward())
        if root is not None:
            clock.compute_for(root, units[root].forward_s, "forward")
        for u in order:
            clock.run(schedule.pre_forward(u))
            clock.compute_for(u, units[u].forward_s, "forward")
            clock.run(schedule.post_forward(u, True))
        clock.run(schedule.end_forward(True))
        forward_end = clock.now
        schedule.begin_backward()
        if root is not None:
            clock.run(schedule.pre_backward(root))
        for u in reversed(order):
            clock.run(schedule.pre_backward(u))
            clock.compute_for(u, units[u].backward_s, "backward")
            clock.run(schedule.post_backward(u))
        if root is not None:
            clock.compute_for(root, units[root].backward_s, "backward")
        clock.run(schedule.end_backward())
        backward_end = clock.now
        clock.now += optimizer_s  # after every wait: no collective in flight
    peak_units, peak_bytes = schedule.max_unsharded()
    step_s = clock.now
    return Prediction(
        step_s=step_s,
        compute_s=clock.compute + optimizer_s,
        exposed_s=clock.exposed,
        comm_busy_s=clock.busy,
        peak_unsharded_bytes=peak_bytes,
        peak_unsharded_units=peak_units,
        waits_s=clock.waits,
        num_allgathers=clock.counts["gather"],
        num_reduce_scatters=clock.counts["reduce"],
        peak_reduce_bytes=clock.peak_reduce_bytes(),
        events=clock.events,
        host_s=clock.host,
        forward_s=forward_end,
        backward_s=backward_end - forward_end,
    )
