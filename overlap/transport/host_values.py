"""Small blocking collectives of host values: every rank's int (order checks) or floats
(autotune's measurements), for checks and decisions taken once in a while, never in the hot path.
Re-exported by collectives.py.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from overlap.transport.results import CommResult, runs_locally as _local, wait

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
