"""Collectives as pure functions over a process group: no state, no schedule, no hooks.

Each function issues one asynchronous collective and returns a typed result holding the output
tensor, the handle to wait on, and every tensor the collective reads or writes (so the caller keeps
them alive until the wait; see [Note: buffer lifetime] in runtime.py).
"""

from __future__ import annotations

from datetime import timedelta
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of the
# *_single names (a FutureWarning on every call); torch 2.11 has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_to_all = dist.all_to_all_single


class CommResult(NamedTuple):
    output: torch.Tensor
    work: Any  # dist.Work, or None when the collective ran synchronously (world size 1)
    inputs: tuple[torch.Tensor, ...]  # kept alive until the wait
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None  # applied to output by `wait`


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


ReduceImpl = Literal["native", "all_to_all"]


def reduce_scatter_flat(
    full: torch.Tensor, group: dist.ProcessGroup, world_size: int, impl: ReduceImpl = "native"
) -> CommResult:
    """Sum the rank-major `full` (world_size * n) over ranks; this rank keeps its n-element chunk.

    [Note: reduce-scatter through all-to-all]
    "native" calls the backend's reduce-scatter. "all_to_all" sends chunk r to rank r and sums
    the world_size received chunks here, in rank order: the same (n-1)/n of the bytes on the
    wire as a ring reduce-scatter. gloo's own reduce-scatter puts twice that on the wire
    (measured: 1.0x the buffer per rank against 0.5x for all-to-all at 2 ranks), so "auto"
    picks all_to_all for gloo; NCCL's is a true ring and stays native. At two ranks the sum is
    a + b either way, so results stay bitwise equal to DDP.
    """
    n = full.numel() // world_size
    if world_size == 1:
        out = torch.empty(n, dtype=full.dtype, device=full.device)
        out.copy_(full)
        return CommResult(out, None, (full,))
    if impl == "all_to_all":
        received = torch.empty_like(full)
        work = _all_to_all(received, full, group=group, async_op=True)
        return CommResult(received, work, (full,), _sum_chunks(world_size, n))
    out = torch.empty(n, dtype=full.dtype, device=full.device)
    work = _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return CommResult(out, work, (full,))


def _sum_chunks(world_size: int, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def finish(received: torch.Tensor) -> torch.Tensor:
        chunks = received.view(world_size, n)
        total = chunks[0].clone()
        for r in range(1, world_size):  # rank order, as a ring would add them
            total.add_(chunks[r])
        return total

    return finish


def wait(result: CommResult, timeout: timedelta | None = None) -> torch.Tensor:
    """Block until `result` is done (CPU) or enqueue the wait on the current stream (CUDA)."""
    if result.work is not None:
        if timeout is None:
            result.work.wait()
        else:
            result.work.wait(timeout)
    if result.finish is not None:
        return result.finish(result.output)
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
