"""Counting non-finite quantization blocks on the device, checked once per step, on every rank alike.

[Note: deferred finite check]
A quantizing codec cannot carry Inf/NaN: such a block encodes to scale NaN and decodes to NaN
([Note: blockwise quantization format] in overlap/kernels/reference.py). Testing every encode
on the host (`bool(scales.isnan().any())`) would block the host on the device W-1 times per
bucket on CUDA. Instead each encode (or, for a gather, each decode) adds its number of NaN scales
to a counter on the device (in stream order, on the stream that ran it: one counter per
(device, stream), so that no two streams update one tensor; the Triton kernels add with one
atomic per program), and the runtime calls `Codec.raise_if_nonfinite()` once per step.

Every rank raises, at the same check ([Note: collective finite check] below), so that a user who
catches the error to skip a step keeps the ranks in step (one rank raising alone would leave the
others in the next collective: a hang until the watchdog).

When the counts reach the host:
- CPU: read directly; the error comes at the check that follows the values.
- CUDA: never a device-wide sync. A check copies the count into pinned memory with
  `non_blocking=True` behind the work that produced it, records an event, zeroes the counter
  (all in stream order), and reports that copy `REPORT_AFTER_CHECKS` (2) checks later: the error
  comes two steps late, and the NaN blocks of those steps go through as NaN meanwhile. At that
  check the event is first asked (`query()`); it has normally completed a step ago, and only if
  it has not (the device two whole steps behind the host) does the host wait for that one event
  (counted in `NonfiniteCounter.blocking_waits`). The report step is fixed, not "whenever the
  copy happens to be done": the ranks' devices run at their own pace, and a rank that reported
  when its copy was ready would raise a step before a slower one.
  `raise_if_nonfinite(wait=True)`, an explicit final check (before a checkpoint, at the end of
  training), reads everything still in flight and this step's counts at once, with one wait.
Between checks the blocks pass through as NaN, as with `check_finite=False`.

[Note: collective finite check]
Each rank encodes only the gradient rows it sends, so its own count would be its own business. So
the count travels: `reduce_scatter_encoded` (transport/coded.py) writes this rank's count so
far this step (the device counter, after the bucket's encodes in stream order) into an int64 slot
of every row it sends, sums the slots it receives, and appends that sum to the reduced shard as
one more element. Each rank sends the same value to everyone, so every rank receives the same
sum: the count of every rank. The engine hands the element to `Codec.agree_nonfinite` once the
shard is final (after the HSDP all-reduce across replicas, which sums it too): the counts are
cumulative over the step's buckets, so the largest (the last bucket's) is the step's total, on
every rank. A check reports that agreed total when the step had one, and the local counts
otherwise (standalone use, or a codec that only decodes). The parameter codec needs no carrying:
it counts what it decodes from the all-gather, every rank's shard, the same bytes on every rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

REPORT_AFTER_CHECKS = 2
"""A CUDA count sent at check c is reported at check c + 2 ([Note: deferred finite check])."""


@dataclass
class _Count:
    """What one (device, stream) has counted since the last check."""

    stream: Any  # torch.cuda.Stream, or None on CPU
    bad_blocks: torch.Tensor  # int64 scalar on the device: NaN scales counted
    num_blocks: int = 0  # on the host: blocks encoded (or decoded)
    num_encodes: int = 0


@dataclass
class Report:
    """What a check reports: `bad_blocks` of `num_blocks` blocks in `num_encodes` encodes;
    `all_ranks`: the count is every rank's ([Note: collective finite check])."""

    bad_blocks: int = 0
    num_blocks: int = 0
    num_encodes: int = 0
    all_ranks: bool = False

    def add(self, other: Report) -> None:
        self.bad_blocks += other.bad_blocks
        self.num_blocks += other.num_blocks
        self.num_encodes += other.num_encodes
        self.all_ranks = self.all_ranks or other.all_ranks


@dataclass(eq=False)
class _Snapshot:
    """A CUDA count on its way to the host."""

    values: torch.Tensor  # pinned float64, valid once `ready` has completed
    ready: Any  # torch.cuda.Event
    due: int  # the check that reports it
    report: Report = field(default_factory=Report)  # bad_blocks filled from `values`


class NonfiniteCounter:
    """Device-side count of non-finite blocks for one codec ([Note: deferred finite check])."""

    def __init__(self) -> None:
        self._counts: dict[tuple[Any, ...], _Count] = {}
        self._agreed: list[torch.Tensor] = []  # this step's rank-summed counts (one element each)
        self._in_flight: list[_Snapshot] = []
        self._checks = 0
        self._lock = threading.Lock()
        self.blocking_waits = 0
        """Checks that found a due copy not yet done and waited for it (the device two steps behind)."""

    def _count(self, device: torch.device) -> _Count:
        stream = _stream_of(device)
        key = (device, None if stream is None else stream.cuda_stream)
        count = self._counts.get(key)
        if count is None:
            with torch.inference_mode(False):  # a normal tensor: updated in and out of inference mode
                count = _Count(stream, torch.zeros((), dtype=torch.int64, device=device))
            self._counts[key] = count
        return count

    def add(self, scales: torch.Tensor) -> None:
        """Count the NaN scales of one encoding: device work only, on the current stream."""
        with self._lock:
            count = self._count(scales.device)
            count.num_blocks += scales.numel()
            count.num_encodes += 1
        count.bad_blocks.add_(torch.isnan(scales).sum())

    def counter(self, device: torch.device, num_blocks: int, num_encodes: int) -> torch.Tensor:
        """The current stream's count (an int64 scalar on `device`) for a kernel to add into,
        after noting `num_encodes` encodes of `num_blocks` blocks in all."""
        with self._lock:
            count = self._count(device)
            count.num_blocks += num_blocks
            count.num_encodes += num_encodes
        return count.bad_blocks

    def current(self, device: torch.device) -> torch.Tensor:
        """This rank's count so far this step on the current stream (the slot a reduce-scatter
        sends, [Note: collective finite check])."""
        with self._lock:
            return self._count(device).bad_blocks

    def agree(self, total: torch.Tensor) -> None:
        """Note a count summed over every rank (one element, any dtype, on the device; read at
        the next check, after the work that wrote it in the caller's stream order)."""
        with self._lock:
            self._agreed.append(total.reshape(1))

    def take(self, wait: bool = False) -> Report:
        """What to report now: on CPU everything since the last call; on CUDA what the check
        `REPORT_AFTER_CHECKS` before this one sent (with `wait`, also everything since)."""
        report = Report()
        with self._lock:  # the runtime checks between steps; encodes from other threads wait
            self._checks += 1
            for snapshot in self._snapshots():
                if snapshot.ready is None:
                    report.add(snapshot.report)  # a CPU count: already read
                else:
                    self._in_flight.append(snapshot)
            due = [s for s in self._in_flight if wait or s.due <= self._checks]
            self._in_flight = [s for s in self._in_flight if not (wait or s.due <= self._checks)]
            for snapshot in due:
                if not snapshot.ready.query():  # done long ago, normally: no wait
                    self.blocking_waits += not wait  # asked for with `wait`: expected
                    snapshot.ready.synchronize()  # this copy only
                snapshot.report.bad_blocks = round(float(snapshot.values[0]))
                report.add(snapshot.report)
        return report

    def _snapshots(self) -> list[_Snapshot]:
        """This check's counts, zeroed behind the snapshot: the agreed total if the step had one
        (it covers every local count), else each (device, stream) count."""
        agreed, self._agreed = self._agreed, []
        counts = [c for c in self._counts.values() if c.num_encodes]
        snapshots: list[_Snapshot] = []
        if agreed:
            total = Report(num_blocks=sum(c.num_blocks for c in counts),
                           num_encodes=sum(c.num_encodes for c in counts), all_ranks=True)  # fmt: skip
            on_host = agreed[0].device.type != "cuda"
            snapshots.append(self._send(torch.cat([t.to(torch.float64) for t in agreed]).max(), None, total, on_host))
            for count in counts:
                _zero(count)
            return snapshots
        for count in counts:
            report = Report(num_blocks=count.num_blocks, num_encodes=count.num_encodes)
            snapshots.append(self._send(count.bad_blocks, count.stream, report, count.stream is None))
            _zero(count)
        return snapshots

    def _send(self, value: torch.Tensor, stream: Any, report: Report, on_host: bool) -> _Snapshot:
        """`value` (a scalar) on its way to the host: read at once `on_host` (a CPU tensor, no
        device to wait for); on CUDA copied to pinned memory behind the work on `stream` (None:
        the current stream), without blocking, due `REPORT_AFTER_CHECKS` checks from now."""
        if on_host:
            report.bad_blocks = round(float(value))
            return _Snapshot(value.reshape(1), None, self._checks, report)
        host = _pinned_float64()
        stream = stream if stream is not None else torch.cuda.current_stream(value.device)
        with torch.cuda.stream(stream):
            host.copy_(value.reshape(1).to(torch.float64), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        return _Snapshot(host, ready, self._checks + REPORT_AFTER_CHECKS, report)


def _zero(count: _Count) -> None:
    """Start `count` again from zero, in its stream's order (after the copy that reads it)."""
    if count.stream is None:
        count.bad_blocks.zero_()
    else:
        with torch.cuda.stream(count.stream):
            count.bad_blocks.zero_()
    count.num_blocks = count.num_encodes = 0


def _stream_of(device: torch.device) -> Any:
    """The stream an encode on `device` runs on (None: a host device, read directly)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _pinned_float64() -> torch.Tensor:
    return torch.empty(1, dtype=torch.float64, pin_memory=True)
