"""Per-step recorder of unit events, written as Chrome/Perfetto trace JSON (one file per rank).

Lanes (Chrome "threads") per rank:
    compute         forward and backward of each unit (hook to hook, host clock)
    all-gather      issued -> done, per unit
    reduce-scatter  issued -> done, per bucket (HSDP: the all-reduce across replicas too)
    wait            compute blocked on a collective (exposed communication)

Turned on by `OverlapConfig.trace_dir` or the environment variable `OVERLAP_TRACE=dir`.
Open the file in https://ui.perfetto.dev or chrome://tracing; `overlap report DIR` summarizes it.

The communication lanes come from the spans of overlap/observe/timing.py (`record_spans`): on CPU host
stamps, on CUDA device events placed on the host clock ([Note: device clock] in timing.py). On
CUDA a step's communication reaches the file a step late, in its own step's bucket, so the newest
step of the file lacks it; `overlap report` reads the one before by default.

[Note: trace clock]
Timestamps are `time.perf_counter_ns()`, which on Linux is CLOCK_MONOTONIC: one clock for every
process on a machine, so the ranks of a local world line up in one view. Ranks on different
machines do not share it. A collective's "done" is stamped when its work completes
(`CompletionWaiter` in timing.py) or, on CUDA, by an event on its stream.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from overlap.observe.timing import CompletionWaiter, Span

LANES = ("compute", "all-gather", "reduce-scatter", "wait")
_LANE_OF_OP = {"gather": "all-gather", "reduce": "reduce-scatter", "all_reduce": "reduce-scatter"}
"""The lane of a collective span. The HSDP all-reduce shares the reduce-scatter lane (it is part
of the gradient reduction, and `overlap report` counts that lane as communication)."""


def trace_dir_from(config_dir: str | None) -> Path | None:
    value = os.environ.get("OVERLAP_TRACE") or config_dir
    return Path(value) if value else None


class TraceRecorder:
    """Collects spans for the last `max_steps` steps and rewrites this rank's file every step."""

    def __init__(self, out_dir: Path, rank: int, max_steps: int = 20) -> None:
        self.path = Path(out_dir) / f"trace_rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.max_steps = max_steps
        self.step = 0
        self._steps: dict[int, list[dict[str, Any]]] = {}  # events by the step they belong to
        self._open: dict[tuple[str, str], int] = {}
        self._waiter = CompletionWaiter()  # for `comm`
        self._lock = threading.Lock()  # comm callbacks arrive on other threads

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    def span(self, lane: str, name: str, t0_ns: int, t1_ns: int, step: int | None = None, **args: Any) -> None:
        """A span on `lane` ("all-reduce" is drawn on the reduce-scatter lane), in `step`
        (default: the current one)."""
        step = self.step if step is None else step
        event = {
            "name": name,
            "ph": "X",
            "pid": self.rank,
            "tid": LANES.index(_LANE_OF_OP["all_reduce"] if lane == "all-reduce" else lane),
            "ts": t0_ns / 1e3,
            "dur": max(t1_ns - t0_ns, 0) / 1e3,
            "args": {"step": step, **args},
        }
        with self._lock:
            if step >= self.step - self.max_steps:  # else: too late for the file
                self._steps.setdefault(step, []).append(event)

    def record_spans(self, spans: Iterable[Span]) -> None:
        """Spans from `SpanTimer.harvest()`: collectives on their lanes, stalls on "wait", each
        in the step it was recorded in. Step spans are not drawn."""
        for s in spans:
            t1_ns = s.start_ns + int(s.duration_ms * 1e6)
            if s.kind == "collective":
                name = f"all-reduce {s.label}" if s.op == "all_reduce" else s.label
                self.span(_LANE_OF_OP[s.op], name, s.start_ns, t1_ns, s.step, bytes=s.num_bytes, issued_step=s.step)
            elif s.kind == "stall":
                self.span("wait", f"wait {s.op} {s.label}", s.start_ns, t1_ns, s.step)

    def begin(self, lane: str, name: str) -> None:
        self._open[(lane, name)] = self.now()

    def end(self, lane: str, name: str, **args: Any) -> None:
        t0 = self._open.pop((lane, name), None)
        if t0 is not None:
            self.span(lane, name, t0, self.now(), **args)

    def comm(self, lane: str, name: str, work: Any, num_bytes: int) -> None:
        """A collective issued now; its span ends when `work` completes (host clock).

        The path before SpanTimer: on CUDA it draws NCCL collectives as ~0 µs (their futures
        complete at enqueue). Once the runtime times through SpanTimer, use `record_spans`."""
        t0, step = self.now(), self.step

        def done(t1: int) -> None:  # stamped in the step it completes in, as before
            self.span(lane, name, t0, t1, bytes=num_bytes, issued_step=step)

        self._waiter.on_complete(work, done)

    def finish_step(self) -> None:
        with self._lock:
            self.step += 1
            first = self.step - self.max_steps
            self._steps = {s: events for s, events in self._steps.items() if s >= first}
            events = [e for s in sorted(self._steps) for e in self._steps[s]]
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}
        ]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": i, "args": {"name": lane}}
            for i, lane in enumerate(LANES)
        ]
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
        tmp.replace(self.path)  # atomic: a reader never sees half a file
