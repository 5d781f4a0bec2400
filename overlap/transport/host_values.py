"""Small collectives of host values: every rank's int (order checks) or floats (autotune's
measurements), for checks and decisions taken once in a while, never in the hot path. The
blocking ones wait for the device; `gather_floats_later` does not: on a stream-ordered device the
values travel from pinned memory, and are read back, on the stream, to be read a step later.
Re-exported by collectives.py.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from overlap.transport.readback import HostRead
from overlap.transport.results import CommResult, wait
from overlap.transport.results import runs_locally as _local

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_int(
    value: int, group: dist.ProcessGroup, device: torch.device, timeout: timedelta | None = None
) -> list[int]:
    """Every rank's `value` (an int64), in rank order. Blocking; for checks, not the hot path."""
    world_size = dist.get_world_size(group)
    if _local(world_size):
        return [value]
    send = torch.tensor([value], dtype=torch.int64, device=device)
    out = torch.empty(world_size, dtype=torch.int64, device=device)
    wait(CommResult(out, _all_gather(out, send, group=group, async_op=True), (send,)), timeout)
    return out.tolist()


def all_gather_floats(
    values: list[float], group: dist.ProcessGroup, device: torch.device, timeout: timedelta | None = None
) -> list[list[float]]:
    """Every rank's `values` (float64, the same count on every rank), in rank order. Blocking;
    for decisions taken every few steps (engine/autotune.py), not the hot path."""
    world_size = dist.get_world_size(group)
    if _local(world_size):
        return [list(values)]
    send = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(world_size * len(values), dtype=torch.float64, device=device)
    wait(CommResult(out, _all_gather(out, send, group=group, async_op=True), (send,)), timeout)
    return out.view(world_size, len(values)).tolist()


class GatheredLater:
    """`gather_floats_later`'s result: `rows()` is every rank's values, in rank order."""

    def __init__(self, rows: list[list[float]] | None, read: HostRead | None = None, width: int = 0) -> None:
        self._rows, self._read, self._width = rows, read, width
        self.keep: tuple[torch.Tensor, ...] = ()  # buffers the device still reads

    def rows(self) -> list[list[float]]:
        """Waits for this exchange's copy alone (CUDA): issued a step ago, it is done by now."""
        if self._rows is None:
            assert self._read is not None
            flat = self._read.values()
            self._rows = [flat[i : i + self._width] for i in range(0, len(flat), self._width)]
            self._read, self.keep = None, ()
        return self._rows


def gather_floats_later(
    values: list[float], group: dist.ProcessGroup, device: torch.device, timeout: timedelta | None = None
) -> GatheredLater:
    """`all_gather_floats` without waiting for the device: on CUDA the values go up from pinned
    memory and come back into pinned memory behind the all-gather, on the current stream; read
    them a step later (`rows()`). On CPU it is the blocking one (gloo runs it on the host anyway)."""
    if device.type != "cuda" or _local(dist.get_world_size(group)):
        return GatheredLater(all_gather_floats(values, group, device, timeout))
    world_size = dist.get_world_size(group)
    host = torch.tensor(values, dtype=torch.float64).pin_memory()
    send = host.to(device, non_blocking=True)
    out = torch.empty(world_size * len(values), dtype=torch.float64, device=device)
    # no timeout: on a stream-ordered backend a bounded wait would block the host ([Note: collective
    # failures] in results.py); this one only makes the current stream wait
    wait(CommResult(out, _all_gather(out, send, group=group, async_op=True), (send,)))
    result = GatheredLater(None, HostRead(out), len(values))
    result.keep = (host, send)  # the pinned source until the copy that reads it has run
    return result
