"""Accounting of the bytes the library itself holds, by kind of buffer, with high-water marks.

[Note: memory accounting]
The runtime adds a buffer's bytes when it creates the buffer and subtracts them when it drops
its last reference (for the unsharded parameters: when their storage is resized up and down).
Integer adds on the training thread, nothing else: the account costs nothing on the device and
is exact for what the library allocates. What it cannot see: activations, the optimizer's
state, and allocator overheads (CUDA's caching, glibc's free lists, the idle buffers of
csrc/pool.cpp's recycled reduce-scatter outputs, never more than were lent at once);
`overlap bench memory` puts the OS and CUDA figures beside it. Gradient shards are the reduced outputs the optimizer
reads as `.grad`; they are re-counted at the start of each step from the parameters, so a
`zero_grad(set_to_none=True)` shows up there.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS: tuple[str, ...] = (
    "sharded_params",  # the flat shards (master dtype): the parameters the optimizer updates
    "grad_shards",  # reduced gradient shards held as `.grad`
    "unsharded",  # unsharded parameter storage of gathered units
    "gather_buffers",  # all-gather inputs (casts, encoded shards) and outputs until copy-out
    "reduce_inputs",  # rank-major reduce-scatter inputs (and all-to-all receive buffers)
    "reduce_outputs",  # reduced shards waiting for the end of backward
    "residuals",  # error-feedback residuals (kept across steps)
    "secondary",  # hpZ: the inner group's copies of the unit for backward
)


@dataclass(frozen=True)
class MemoryStats:
    """What `overlap.memory_stats(model)` returns: bytes by kind now and their high-water marks
    since the last reset (`overlap.memory_stats(model, reset_peak=True)`)."""

    bytes: dict[str, int]
    peak: dict[str, int]
    """The high-water mark of each kind on its own."""
    current_total_bytes: int
    peak_total_bytes: int
    """The high-water mark of the sum over kinds (not the sum of the per-kind peaks)."""

    def table(self) -> str:
        rows = [f"{'buffer':<16} {'now MiB':>10} {'peak MiB':>10}"]
        for kind in KINDS:
            rows.append(f"{kind:<16} {self.bytes[kind] / 2**20:>10.1f} {self.peak[kind] / 2**20:>10.1f}")
        rows.append(f"{'total':<16} {self.current_total_bytes / 2**20:>10.1f} {self.peak_total_bytes / 2**20:>10.1f}")
        return "\n".join(rows)


class MemoryAccount:
    """Running byte counts by kind (see [Note: memory accounting])."""

    __slots__ = ("bytes", "peak", "peak_total", "total")

    def __init__(self) -> None:
        self.bytes: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.peak: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.total = 0
        self.peak_total = 0

    def add(self, kind: str, num_bytes: int) -> None:
        now = self.bytes[kind] + num_bytes
        self.bytes[kind] = now
        if now > self.peak[kind]:
            self.peak[kind] = now
        self.total += num_bytes
        if self.total > self.peak_total:
            self.peak_total = self.total

    def sub(self, kind: str, num_bytes: int) -> None:
        now = self.bytes[kind] - num_bytes
        assert now >= 0, f"memory account: {kind} went negative ({now} bytes)"
        self.bytes[kind] = now
        self.total -= num_bytes

    def set(self, kind: str, num_bytes: int) -> None:
        """Set a kind recounted from scratch (gradient shards at a step's start)."""
        delta = num_bytes - self.bytes[kind]
        if delta >= 0:
            self.add(kind, delta)
        else:
            self.sub(kind, -delta)

    def reset_peak(self) -> None:
        self.peak = dict(self.bytes)
        self.peak_total = self.total

    def snapshot(self) -> MemoryStats:
        return MemoryStats(dict(self.bytes), dict(self.peak), self.total, self.peak_total)


def nbytes(*tensors: object) -> int:
    """Bytes of the tensors' elements (None entries count 0)."""
    total = 0
    for t in tensors:
        if t is not None:
            total += t.numel() * t.element_size()  # type: ignore[attr-defined]
    return total
