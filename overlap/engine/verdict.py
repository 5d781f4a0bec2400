"""One verdict for the whole job: what some rank found, known to every rank of the model's grid.

[Note: job-wide verdicts]
A check that raises on some ranks only leaves the others in their next collective until the
watchdog. The model's ranks form a grid: the shard group, the replicate group (HSDP) and the
tensor-parallel group (TP; for the experts' state the ep group, [Note: expert parallelism] in
experts.py) are its dimensions, and each rank is in exactly one group of each. Folding a value
over the dimensions in turn, as a hierarchical all-reduce does, gives every rank the fold over the
whole grid: after the shard group each rank holds its shard group's fold, after the replicate
group the fold over every shard group of its plane (a replicate group holds one rank of each),
after the tp group the fold over every plane. Every rank makes the same collectives whatever it
found, so all take the same branch: all raise, or none does. `clip_grad_norm_` and the loss
scaler's found-inf flag reduce over the same groups ([Note: found-inf across ranks] in amp.py).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from overlap.transport import collectives as comm

DIFFERS = -1
"""`agree_value`'s answer when the ranks' values differ (the values folded are >= 0)."""

_NOBODY = 1 << 62  # `first_flagged`'s fold when no rank flagged (above any encoded rank)
_KIND_BITS = 4  # what a rank found, in the low bits of its folded value


def job_groups(*groups: dist.ProcessGroup | None) -> list[dist.ProcessGroup]:
    """The grid's dimensions that exist, in the order given (shard, replicate, tensor)."""
    return [g for g in groups if g is not None]


def agree_value(
    value: int, groups: list[dist.ProcessGroup], device: torch.device, timeout: timedelta | None
) -> tuple[int, list[int] | None]:
    """(`value` if every rank of the grid holds the same one, else `DIFFERS`; the values of the
    first group in which this rank saw a difference, by rank in that group, or None). One small
    all-gather per group, on every rank ([Note: job-wide verdicts])."""
    assert value >= 0, f"rank {dist.get_rank()}: agree_value folds values >= 0, got {value}"
    seen = None
    for group in groups:
        values = comm.all_gather_int(value, group, device, timeout)
        if len(set(values)) != 1:
            seen = seen if seen is not None else values
            value = DIFFERS
        else:
            value = values[0]
    return value, seen


def first_flagged(
    kind: int, groups: list[dist.ProcessGroup], device: torch.device, timeout: timedelta | None
) -> tuple[int, int] | None:
    """(global rank, kind) of the lowest global rank of the grid that found something (`kind` >
    0; 0: nothing found here), the same on every rank; None when no rank found anything."""
    assert 0 <= kind < 1 << _KIND_BITS, f"rank {dist.get_rank()}: kind {kind} out of range"
    value = (dist.get_rank() << _KIND_BITS | kind) if kind else _NOBODY
    for group in groups:
        value = min(comm.all_gather_int(value, group, device, timeout))
    if value == _NOBODY:
        return None
    return value >> _KIND_BITS, value & ((1 << _KIND_BITS) - 1)
