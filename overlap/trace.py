"""Per-step recorder of unit events, written as Chrome/Perfetto trace JSON (one file per rank).

Lanes (Chrome "threads") per rank:
    compute         forward and backward of each unit (hook to hook)
    all-gather      issued -> done, per unit
    reduce-scatter  issued -> done, per bucket
    wait            the training thread blocked on a collective (exposed communication)

Turned on by `OverlapConfig.trace_dir` or the environment variable `OVERLAP_TRACE=dir`.
Open the file in https://ui.perfetto.dev or chrome://tracing; `overlap report DIR` summarizes it.

[Note: trace clock]
Timestamps are `time.perf_counter_ns()`, which on Linux is CLOCK_MONOTONIC: one clock for every
process on a machine, so the ranks of a local world line up in one view. Ranks on different
machines do not share it. A collective's "done" is stamped by a callback on its future where the
backend offers one (gloo's all-gather); otherwise (gloo's reduce-scatter has no future, and its
`is_completed()` stays False even after `wait()`) a daemon thread of the recorder waits on the
work handles in issue order and stamps each as it returns: an upper bound when an earlier
collective finishes after a later one.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

LANES = ("compute", "all-gather", "reduce-scatter", "wait")


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
        self._steps: list[list[dict[str, Any]]] = []
        self._current: list[dict[str, Any]] = []
        self._open: dict[tuple[str, str], int] = {}
        self._waiter_queue: queue.SimpleQueue | None = None  # collectives without a future
        self._lock = threading.Lock()  # comm callbacks arrive on other threads

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    def span(self, lane: str, name: str, t0_ns: int, t1_ns: int, **args: Any) -> None:
        event = {
            "name": name,
            "ph": "X",
            "pid": self.rank,
            "tid": LANES.index(lane),
            "ts": t0_ns / 1e3,
            "dur": max(t1_ns - t0_ns, 0) / 1e3,
            "args": {"step": self.step, **args},
        }
        with self._lock:
            self._current.append(event)

    def _wait_in_background(self, lane: str, name: str, t0: int, work: Any, num_bytes: int) -> None:
        if self._waiter_queue is None:
            self._waiter_queue = queue.SimpleQueue()
            threading.Thread(target=self._waiter, name="overlap-trace-waiter", daemon=True).start()
        self._waiter_queue.put((lane, name, t0, work, num_bytes, self.step))

    def _waiter(self) -> None:
        assert self._waiter_queue is not None
        while True:
            lane, name, t0, work, num_bytes, step = self._waiter_queue.get()
            try:
                work.wait()
            except Exception:  # the training thread reports collective errors
                continue
            self.span(lane, name, t0, self.now(), bytes=num_bytes, issued_step=step)

    def begin(self, lane: str, name: str) -> None:
        self._open[(lane, name)] = self.now()

    def end(self, lane: str, name: str, **args: Any) -> None:
        t0 = self._open.pop((lane, name), None)
        if t0 is not None:
            self.span(lane, name, t0, self.now(), **args)

    def comm(self, lane: str, name: str, work: Any, num_bytes: int) -> None:
        """A collective issued now; its span ends when `work` completes."""
        t0 = self.now()
        if work is None:
            self.span(lane, name, t0, self.now(), bytes=num_bytes)
            return
        step = self.step

        def done(_: Any) -> None:
            self.span(lane, name, t0, self.now(), bytes=num_bytes, issued_step=step)

        try:
            work.get_future().then(done)
        except RuntimeError:  # "getFuture not implemented" for this work type
            self._wait_in_background(lane, name, t0, work, num_bytes)

    def finish_step(self) -> None:
        with self._lock:
            self._steps.append(self._current)
            self._current = []
            self._steps = self._steps[-self.max_steps :]
            events = [e for step in self._steps for e in step]
        self.step += 1
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
