"""Counting non-finite quantization blocks on the device, checked once per step.

[Note: deferred finite check]
A quantizing codec cannot carry Inf/NaN: such a block encodes to scale NaN and decodes to NaN
([Note: blockwise quantization format] in overlap/kernels/reference.py). Testing every encode
on the host (`bool(scales.isnan().any())`) would block the host on the device W-1 times per
bucket on CUDA. Instead each encode adds its number of NaN scales to a counter on the device (in
stream order, on the stream that encoded: one counter per (device, stream), so that no two
streams update one tensor), and the runtime calls `Codec.raise_if_nonfinite()` once per step:
- CPU: the counters are read directly; the error comes in the step that met the values.
- CUDA: the check copies each counter into pinned memory with `non_blocking=True`, records an
  event, zeroes the counter (all in that stream's order), and raises for what the *previous*
  check copied, after waiting on its event, which normally completed long ago: the error comes
  one step late, and the NaN blocks of that step went through as NaN in the meantime.
  `raise_if_nonfinite(wait=True)` reads this step's counts at once, at the price of one sync.
Between checks the blocks pass through as NaN, as with `check_finite=False`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Count:
    """What one (device, stream) has seen since the last check."""

    stream: Any  # torch.cuda.Stream, or None on CPU
    bad_blocks: torch.Tensor  # int64 scalar on the device: NaN scales counted
    num_blocks: int = 0  # on the host: blocks encoded
    num_encodes: int = 0


@dataclass
class _Snapshot:
    """A CUDA count on its way to the host."""

    bad_blocks: torch.Tensor  # pinned int64, valid once `ready` has completed
    ready: torch.cuda.Event
    num_blocks: int
    num_encodes: int


class NonfiniteCounter:
    """Device-side count of non-finite blocks for one codec ([Note: deferred finite check])."""

    def __init__(self) -> None:
        self._counts: dict[tuple[Any, ...], _Count] = {}
        self._in_flight: list[_Snapshot] = []
        self._lock = threading.Lock()

    def add(self, scales: torch.Tensor) -> None:
        """Count the NaN scales of one encoding: device work only, on the current stream."""
        device = scales.device
        stream = _stream_of(device)
        key = (device, None if stream is None else stream.cuda_stream)
        with self._lock:
            count = self._counts.get(key)
            if count is None:
                with torch.inference_mode(False):  # a normal tensor: updated in and out of inference mode
                    count = _Count(stream, torch.zeros((), dtype=torch.int64, device=device))
                self._counts[key] = count
            count.num_blocks += scales.numel()
            count.num_encodes += 1
        count.bad_blocks.add_(torch.isnan(scales).sum())

    def take(self, wait: bool = False) -> tuple[int, int, int]:
        """(bad blocks, blocks, encodes) ready to report: on CPU everything since the last call;
        on CUDA what the previous call sent (and, with `wait`, also everything since)."""
        bad = blocks = encodes = 0
        with self._lock:  # the runtime checks between steps; encodes from other threads wait
            ready = self._in_flight
            self._in_flight = []
            for count in self._counts.values():
                if count.stream is None:
                    bad += int(count.bad_blocks.item())  # a CPU tensor: no device to wait for
                    count.bad_blocks.zero_()
                    blocks, encodes = blocks + count.num_blocks, encodes + count.num_encodes
                    count.num_blocks = count.num_encodes = 0
                elif count.num_encodes:
                    (ready if wait else self._in_flight).append(self._send(count))
            for snapshot in ready:
                snapshot.ready.synchronize()  # sent a step ago (or now, with wait=True)
                bad += int(snapshot.bad_blocks[0])
                blocks, encodes = blocks + snapshot.num_blocks, encodes + snapshot.num_encodes
        return bad, blocks, encodes

    @staticmethod
    def _send(count: _Count) -> _Snapshot:
        """Copy a CUDA count to pinned memory and zero it, in its stream's order, without blocking."""
        host = _pinned_int64()
        with torch.cuda.stream(count.stream):
            host.copy_(count.bad_blocks.view(1), non_blocking=True)
            count.bad_blocks.zero_()
            ready = torch.cuda.Event()
            ready.record(count.stream)
        snapshot = _Snapshot(host, ready, count.num_blocks, count.num_encodes)
        count.num_blocks = count.num_encodes = 0
        return snapshot


def _stream_of(device: torch.device) -> Any:
    """The stream an encode on `device` runs on (None: a host device, read directly)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _pinned_int64() -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, pin_memory=True)
