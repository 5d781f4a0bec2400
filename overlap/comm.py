"""Collectives as pure functions over a process group: no state, no schedule, no hooks.

Each function issues one asynchronous collective and returns a typed result holding the output
tensor, the handle to wait on, and every tensor the collective reads or writes (so the caller keeps
them alive until the wait; see [Note: buffer lifetime] in runtime.py).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of the
# *_single names (a FutureWarning on every call); torch 2.11 has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommResult(NamedTuple):
    output: torch.Tensor
    work: Any  # dist.Work, or None when the collective ran synchronously (world size 1)
    inputs: tuple[torch.Tensor, ...]  # kept alive until the wait


def all_gather_flat(
    shard: torch.Tensor, group: dist.ProcessGroup, world_size: int, dtype: torch.dtype
) -> CommResult:
    """Gather every rank's flat `shard` into one rank-major (world_size * numel) tensor.

    The shard is cast to `dtype` first (mixed precision: the wire and the compute use it).
    """
    send = shard if shard.dtype == dtype else shard.to(dtype)
    out = torch.empty(world_size * send.numel(), dtype=dtype, device=send.device)
    if world_size == 1:
        out.copy_(send)
        return CommResult(out, None, (send,))
    work = _all_gather(out, send, group=group, async_op=True)
    return CommResult(out, work, (send,))


def reduce_scatter_flat(
    full: torch.Tensor, group: dist.ProcessGroup, world_size: int
) -> CommResult:
    """Sum the rank-major `full` (world_size * n) over ranks; this rank keeps its n-element chunk."""
    n = full.numel() // world_size
    out = torch.empty(n, dtype=full.dtype, device=full.device)
    if world_size == 1:
        out.copy_(full)
        return CommResult(out, None, (full,))
    work = _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return CommResult(out, work, (full,))


def wait(result: CommResult, timeout: timedelta | None = None) -> torch.Tensor:
    """Block until `result` is done (CPU) or enqueue the wait on the current stream (CUDA)."""
    if result.work is not None:
        if timeout is None:
            result.work.wait()
        else:
            result.work.wait(timeout)
    return result.output


def all_gather_int(
    value: int, group: dist.ProcessGroup, device: torch.device, timeout: timedelta | None = None
) -> list[int]:
    """Every rank's `value` (an int64), in rank order. Blocking; for checks, not the hot path."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return [value]
    send = torch.tensor([value], dtype=torch.int64, device=device)
    out = torch.empty(world_size, dtype=torch.int64, device=device)
    wait(CommResult(out, _all_gather(out, send, group=group, async_op=True), (send,)), timeout)
    return out.tolist()
