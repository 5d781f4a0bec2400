"""The runtime's own schedule on a virtual clock: predicted step time, exposed comm, memory.

The same `Schedule` that drives `overlap.wrap` decides every action here; only the executor
differs: instead of tensors and process groups it advances a clock. The compute thread runs the
units' forward and backward in order; collectives go to communication lanes:

    nccl  one lane: one communicator runs its collectives in issue order (our reduce-scatters
          share the all-gathers' process group, so they queue behind prefetched gathers)
    gloo  two lanes: a gloo process group has two worker threads and runs two collectives at once

A wait advances the compute clock to the collective's end (that is the exposed time). On a CPU
host the communication also takes cycles from compute: `cpu_contention` is the fraction of each
second of communication that the compute thread loses (0 on GPUs; calibrated from the two floors
of `benchmarks/step_w1.py`: (floor-compute∥comm − floor-compute) / comm busy time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from overlap.config import OverlapConfig
from overlap.plan.cost import Topology, UnitCost, ring_time_s
from overlap.schedule import (
    Action,
    CheckOrder,
    Free,
    Gather,
    Reduce,
    Schedule,
    ScheduleConfig,
    WaitGather,
    WaitReduce,
)


@dataclass
class Prediction:
    step_s: float
    compute_s: float
    exposed_s: float
    comm_busy_s: float
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


class _Clock:
    """Executes schedule actions on virtual time."""

    def __init__(self, units: list[UnitCost], topo: Topology, lanes: int, record: bool) -> None:
        self.units, self.topo = units, topo
        self.now = 0.0
        self.lanes = [0.0] * lanes
        self.done: dict[tuple[str, int], float] = {}
        self.exposed = self.busy = self.compute = 0.0
        self.waits: dict[str, float] = {}
        self.counts = {"gather": 0, "reduce": 0}
        self.record = record
        self.events: list[tuple[str, str, float, float]] = []
        self.gathered: set[int] = set()  # units whose gather finished and was waited on
        self.reduce_spans: list[tuple[float, float, int]] = []  # (issued, done, bytes)

    def _issue(self, kind: str, key: int, seconds: float, name: str) -> float:
        lane = min(range(len(self.lanes)), key=lambda i: self.lanes[i])
        start = max(self.now, self.lanes[lane])
        end = start + seconds
        self.lanes[lane] = end
        self.done[(kind, key)] = end
        self.busy += seconds
        self.counts[kind] += 1
        if self.record:
            self.events.append((f"comm{lane}", name, start, end))
        return end

    def peak_reduce_bytes(self) -> int:
        """Sweep over the reduce buffers' lifetimes (issue -> done) for the most bytes alive."""
        points = [(t0, b) for t0, _, b in self.reduce_spans] + [(t1, -b) for _, t1, b in self.reduce_spans]
        alive = peak = 0
        for _, delta in sorted(points, key=lambda p: (p[0], p[1])):  # frees before allocations
            alive += delta
            peak = max(peak, alive)
        return peak

    def _wait(self, kind: str, key: int, name: str) -> None:
        end = self.done.pop((kind, key))
        if end > self.now:
            self.exposed += end - self.now
            self.waits[name] = self.waits.get(name, 0.0) + end - self.now
            if self.record:
                self.events.append(("wait", name, self.now, end))
            self.now = end

    def run(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Gather):
                u = self.units[a.unit]
                self._issue("gather", a.unit, u.gather_s(self.topo), f"gather {u.name}")
            elif isinstance(a, WaitGather):
                self._wait("gather", a.unit, f"gather {self.units[a.unit].name}")
                self.gathered.add(a.unit)
            elif isinstance(a, Free):
                self.gathered.discard(a.unit)
            elif isinstance(a, Reduce):
                bucket = [self.units[i] for i in a.units]
                wire = sum(u.grad_bytes if u.reduce_wire_bytes is None else u.reduce_wire_bytes for u in bucket)
                seconds = ring_time_s("reduce_scatter", wire, self.topo) + sum(u.reduce_codec_s for u in bucket)
                names = ",".join(u.name for u in bucket)
                end = self._issue("reduce", a.bucket, seconds, f"reduce [{names}]")
                self.reduce_spans.append((self.now, end, sum(u.grad_bytes for u in bucket)))
            elif isinstance(a, WaitReduce):
                names = ",".join(self.units[i].name for i in a.units)
                self._wait("reduce", a.bucket, f"reduce [{names}]")
            elif isinstance(a, CheckOrder):
                pass  # first step only; the simulated step is a steady one

    def compute_for(self, unit: int, seconds: float, what: str) -> None:
        assert unit in self.gathered, f"unit {unit} computed before its gather was waited on"
        if self.record:
            self.events.append(("compute", f"{what} {self.units[unit].name}", self.now, self.now + seconds))
        self.now += seconds
        self.compute += seconds


def simulate(
    units: list[UnitCost],
    config: OverlapConfig,
    topo: Topology,
    backend: str = "nccl",
    root: int | None = None,
    optimizer_s: float = 0.0,
    cpu_contention: float = 0.0,
    record: bool = False,
) -> Prediction:
    """Predict one steady-state step of a model whose units run in index order.

    `units[root]` (if given) is the root unit: gathered at the start of forward, its forward
    compute first (embeddings) and its backward compute last, freed when backward ends.
    """
    schedule = Schedule(
        [u.param_bytes for u in units],
        [u.grad_bytes for u in units],
        ScheduleConfig(
            config.prefetch_depth,
            config.max_inflight_allgather_bytes,
            config.reshard_after_forward,
            config.reduce_scatter_bucket_bytes,
        ),
        root=root,
    )
    order = [i for i in range(len(units)) if i != root]
    clock = _Clock(units, topo, lanes=2 if backend == "gloo" else 1, record=False)
    for step in range(2):  # the first step records the order; the second is the steady state
        if step == 1:
            clock = _Clock(units, topo, lanes=2 if backend == "gloo" else 1, record=record)
        schedule.reset_peak()
        clock.run(schedule.begin_forward())
        if root is not None:
            clock.compute_for(root, units[root].forward_s, "forward")
        for u in order:
            clock.run(schedule.pre_forward(u))
            clock.compute_for(u, units[u].forward_s, "forward")
            clock.run(schedule.post_forward(u, True))
        clock.run(schedule.end_forward(True))
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
        clock.now += optimizer_s
    peak_units, peak_bytes = schedule.max_unsharded()
    step_s = clock.now + cpu_contention * clock.busy
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
    )
