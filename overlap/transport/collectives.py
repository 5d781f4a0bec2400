"""Collectives as pure functions over a process group: no state, no schedule, no hooks.

Each function issues one asynchronous collective and returns a typed result holding the output
tensor, the handle to wait on, and every tensor the collective reads or writes (so the caller keeps
them alive until the wait; see [Note: buffer lifetime] in engine/runtime.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from overlap import kernels
from overlap.transport import backend, pairwise
from overlap.transport.fingerprint import TAG_NUMEL, write_tag
from overlap.transport.host_values import all_gather_floats, all_gather_int  # noqa: F401  re-exported
from overlap.transport.results import (  # re-exported: callers use collectives' one namespace
    CollectiveError,  # noqa: F401
    CommResult,
    Divide,
    RecvSlack,
    runs_locally,
    wait,  # noqa: F401
)

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of the
# *_single names (a FutureWarning on every call); torch 2.11 has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_all_to_all = dist.all_to_all_single
_p2p_exchange = pairwise.exchange  # gloo's all-to-all, receives first ([Note: receive before send])
_local = runs_locally


GatherImpl = Literal["native", "all_to_all"]


def _exchange(
    send: torch.Tensor, world_size: int, group: dist.ProcessGroup, slack: RecvSlack | None, rank: int | None = None
) -> tuple[torch.Tensor, Any, list[int | None] | None]:
    """All-to-all of `send` (world_size equal parts, part r to rank r). Returns (received, work,
    starts): what rank r sent here is `received[starts[r] : starts[r] + part]`; starts is None
    when `received` is simply rank-major (no slack needed, every part travelled), and
    `starts[rank]` is None when this rank's own part stayed home (read it from `send`: `_rows`).
    On gloo the exchange is point-to-point messages posted receives first ([Note: receive
    before send] in pairwise.py), and every rank's own part stays home; elsewhere it is the
    backend's all-to-all.

    [Note: own part stays home]
    An all-to-all sends each rank's own part to itself too: a copy of 1/world_size of the
    buffer, made by the backend's thread, into a receive buffer that large (at two ranks, half
    of a gradient bucket copied and held for nothing). With `rank` given and the own part at an
    end of `send` (always at two ranks; the first and last rank otherwise), it is left out of
    both splits and the reader takes it from `send` itself: the same values in the same rank
    order, so sums stay bitwise as before. Ranks in the middle send theirs to themselves as
    before; the splits only have to agree pairwise, so the two kinds mix in one collective.

    [Note: receive slack]
    gloo aborts the process (an uncaught `EnforceNotMet` in its own thread, no Python error)
    when a message is larger than the buffer posted for it, and completes quietly when it is
    smaller. Ranks whose steps diverge (a data-dependent branch on one rank) pair different
    collectives; once small all-gathers and fused exchanges go through all-to-all too
    ([Note: all-gather through all-to-all], [Note: fused exchange] in host.py), a larger
    all-to-all of one rank can meet a smaller one of another. So each all-to-all posts at least
    `floor_bytes` for every peer, the largest message the runtime's small exchanges can carry:
    a mismatch then delivers the wrong bytes instead of aborting, and the tags of the gathers
    ([Note: collective fingerprints]) or the collective timeout make every rank raise. The
    parts for peers are then not back to back, hence `starts`. Messages above the floor (large
    units) are not covered, as with any collective of mismatched sizes on gloo.
    """
    part = send.numel() // world_size
    floor = 0 if slack is None else -(-slack.floor_bytes // send.element_size())
    if world_size > 1 and _receive_first(group, send):  # [Note: receive before send]
        me = rank if rank is not None else _rank(group, slack)
        sizes = [0 if r == me else max(part, floor) for r in range(world_size)]
        received = torch.empty(sum(sizes), dtype=send.dtype, device=send.device)
        starts: list[int | None] = [sum(sizes[:r]) for r in range(world_size)]
        starts[me] = None  # every rank's own part stays home: no message to itself
        flat = send.view(-1)
        receives = [None if r == me else received[start : start + sizes[r]] for r, start in enumerate(starts)]
        sends = [None if r == me else flat[r * part : (r + 1) * part] for r in range(world_size)]
        return received, _p2p_exchange(group, receives, sends), starts
    home = rank is not None and world_size > 1 and rank in (0, world_size - 1)
    if (floor <= part and not home) or world_size == 1:
        received = torch.empty_like(send)
        return received, _all_to_all(received, send, group=group, async_op=True), None
    me = slack.rank if slack is not None else rank
    assert me is not None and (rank is None or rank == me), (rank, me)
    # gloo: the own part exact (or absent), the peers' at least the floor
    sizes = [(0 if home else part) if r == me else max(part, floor) for r in range(world_size)]
    received = torch.empty(sum(sizes), dtype=send.dtype, device=send.device)
    if home:  # [Note: own part stays home]
        travel = send[part:] if me == 0 else send[: send.numel() - part]
        splits = [0 if r == me else part for r in range(world_size)]
    else:
        travel, splits = send, [part] * world_size
    work = _all_to_all(received, travel, output_split_sizes=sizes, input_split_sizes=splits, group=group, async_op=True)
    starts = [sum(sizes[:r]) for r in range(world_size)]
    if home:
        starts[me] = None
    return received, work, starts


def _receive_first(group: dist.ProcessGroup, send: torch.Tensor) -> bool:
    """Whether an exchange over `group` goes receive-first, point to point (gloo; see
    `backend.CommSemantics.receive_first`) instead of through the backend's all-to-all."""
    return backend.semantics(group, send.device).receive_first


def _rows(
    received: torch.Tensor,
    world_size: int,
    part: int,
    starts: list[int | None] | None,
    send: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """What each rank sent, in rank order (see `_exchange`); a part that stayed home is read
    from `send`, the flat buffer given to `_exchange`."""
    if starts is None:
        return list(received.view(world_size, part).unbind(0))
    rows = []
    for r, start in enumerate(starts):
        if start is None:
            assert send is not None, "the own part stayed home: pass the send buffer"
            rows.append(send.view(-1)[r * part : (r + 1) * part])
        else:
            rows.append(received[start : start + part])
    return rows


def all_gather_flat(
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    world_size: int,
    dtype: torch.dtype,
    tag: int | None = None,
    tag_slot: torch.Tensor | None = None,
    impl: GatherImpl = "native",
    slack: RecvSlack | None = None,
    out: torch.Tensor | None = None,
    via: Any = None,
) -> CommResult:
    """Gather every rank's flat `shard` into one rank-major (world_size * numel) tensor: `out`
    when given (a strategy's allocation, `AllGather.allocate` in strategy.py), else a new one.
    `via`: an exchange of a strategy's own instead of the backend's (`via.all_gather(send, out)`:
    shared memory, transport/shm.py).

    The shard is cast to `dtype` first (mixed precision: the wire and the compute use it). With
    `tag`, the last `fingerprint.TAG_NUMEL` elements of `shard` are not data: the tag is written
    there (after the cast) and every rank receives every rank's ([Note: collective fingerprints]).
    `tag_slot`: the caller's `fingerprint.tag_view` of `shard`'s tag, used when there is no cast.

    [Note: all-gather through all-to-all]
    "native" calls the backend's all-gather. "all_to_all" sends a copy of the shard to every
    rank through all-to-all: the same (n-1)/n of the bytes on the wire and the same rank-major
    output, one more unit-sized send buffer while it runs. gloo's all-gather costs more CPU per
    call than its all-to-all (measured at two ranks, 8 KiB shards: 364 against 306 µs a call,
    251 against 185 µs of the process's CPU; at 4 MiB the two are even and the copy moves to
    the calling thread), so "auto" picks all_to_all on gloo for units of up to
    `backend.ALL_TO_ALL_GATHER_MAX_BYTES` gathered, where the fixed cost of a collective
    dominates and the send copies stay small. An all-to-all gather can also travel in the same
    all-to-all as a gradient reduction (`reduce_scatter_and_gather`).
    """
    send = _send_of(shard, dtype, tag, tag_slot)
    if out is None:
        out = torch.empty(world_size * send.numel(), dtype=dtype, device=send.device)
    if _local(world_size):
        out.copy_(send)
        return CommResult(out, None, (send,))
    if via is not None:
        return via.all_gather(send, out)
    if impl == "all_to_all":  # `slack`: see [Note: receive slack]
        copies = out  # the send copies; a fresh buffer receives
        copies.view(world_size, -1).copy_(send.expand(world_size, send.numel()))
        received, work, starts = _exchange(copies, world_size, group, slack)
        if starts is None:
            return CommResult(received, work, (copies,))
        numel = send.numel()
        return CommResult(
            received, work, (copies,), lambda buf: torch.cat(_rows(buf, world_size, numel, starts, copies))
        )
    work = _all_gather(out, send, group=group, async_op=True)
    return CommResult(out, work, (send,))


def _send_of(shard: torch.Tensor, dtype: torch.dtype, tag: int | None, tag_slot: torch.Tensor | None) -> torch.Tensor:
    """What a gather of `shard` sends: cast to `dtype`, the tag written (`all_gather_flat`)."""
    send = shard if shard.dtype == dtype else shard.to(dtype)
    if tag is not None:
        if tag_slot is not None and send is shard:
            tag_slot.fill_(tag)
        else:
            write_tag(send, send.numel() - TAG_NUMEL, tag)
    return send


def all_gather_pair(
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    dtype: torch.dtype,
    tag: int | None = None,
    tag_slot: torch.Tensor | None = None,
    slack: RecvSlack | None = None,
) -> CommResult:
    """`all_gather_flat` over two ranks, without the copy of this rank's own shard: `wait`
    returns the two rows in rank order, this rank's being what it sent, the peer's what it
    received; `shard`, `tag` and `tag_slot` as there.

    [Note: gather of a pair]
    A backend's all-gather copies each rank's own input into its output, and at two ranks that
    is half of every gathered unit (W1: 48 MiB a step, in gloo's thread). Through all-to-all the
    own part need not travel ([Note: own part stays home]): one message to the peer, one from
    it, the same bytes on the wire; the copy-out that follows every CPU gather reads the own row
    from the send buffer (`kernels.bind_copy_out` with `rows`), so the rows are never concatenated.
    The receive buffer has `slack`'s room, as every all-to-all ([Note: receive slack]).
    """
    send = _send_of(shard, dtype, tag, tag_slot)
    n = send.numel()
    peer = 1 - rank
    floor = 0 if slack is None else -(-slack.floor_bytes // send.element_size())
    received = torch.empty(max(n, floor), dtype=dtype, device=send.device)
    if _receive_first(group, send):  # [Note: receive before send]
        receives: list[torch.Tensor | None] = [None, None]
        sends: list[torch.Tensor | None] = [None, None]
        receives[peer], sends[peer] = received, send
        work = _p2p_exchange(group, receives, sends)
    else:
        out_sizes, in_sizes = [0, 0], [0, 0]
        out_sizes[peer], in_sizes[peer] = received.numel(), n
        work = _all_to_all(
            received, send, output_split_sizes=out_sizes, input_split_sizes=in_sizes, group=group, async_op=True
        )

    def rows(buf: torch.Tensor) -> list[torch.Tensor]:
        return [send, buf[:n]] if rank == 0 else [buf[:n], send]

    return CommResult(received, work, (send,), rows)  # type: ignore[arg-type]


def all_gather_secondary(secondary: torch.Tensor, group: dist.ProcessGroup, num_outer: int) -> CommResult:
    """hpZ: all-gather the inner group's secondary copies back into the rank-major order of a
    gather over every rank. Inner rank i holds the parts of global ranks o * inner + i for
    o = 0..num_outer-1 ([Note: secondary copy] in engine/runtime.py); `wait` reorders (inner, outer)
    into (outer, inner)."""
    inner = dist.get_world_size(group)
    result = all_gather_flat(secondary, group, inner, secondary.dtype)

    def finish(out: torch.Tensor) -> torch.Tensor:
        return out.view(inner, num_outer, -1).transpose(0, 1).reshape(-1)

    return result._replace(finish=finish)


ReduceImpl = Literal["native", "all_to_all"]


def reduce_scatter_flat(
    full: torch.Tensor,
    group: dist.ProcessGroup,
    world_size: int,
    impl: ReduceImpl = "native",
    slack: RecvSlack | None = None,
    divide: Divide | None = None,
    average: bool = False,
    via: Any = None,
) -> CommResult:
    """Sum the rank-major `full` (world_size * n) over ranks; this rank keeps its n-element chunk.
    `via`: an exchange of a strategy's own (`via.reduce_scatter(full, divide)`: transport/shm.py).
    `divide`: through all-to-all, the sum's first `divide.numel` elements are divided by
    `divide.divisor` in the same pass (`kernels.sum_rows`); natively they are not (the caller
    divides; `divides(impl, world_size)` says which). `average`: natively, the backend's
    `ReduceOp.AVG` (every element, NCCL only: `CommSemantics.native_average`).

    [Note: reduce-scatter through all-to-all]
    "native" calls the backend's reduce-scatter. "all_to_all" sends chunk r to rank r and sums
    the world_size received chunks here, in rank order: the same (n-1)/n of the bytes on the
    wire as a ring reduce-scatter. gloo's own reduce-scatter puts twice that on the wire
    (measured: 1.0x the buffer per rank against 0.5x for all-to-all at 2 ranks), so "auto"
    picks all_to_all for gloo; NCCL's is a true ring and stays native. At two ranks the sum is
    a + b either way, so results stay bitwise equal to DDP.
    """
    n = full.numel() // world_size
    if _local(world_size):
        out = torch.empty(n, dtype=full.dtype, device=full.device)
        out.copy_(full)
        return CommResult(out, None, (full,))
    if via is not None:
        return via.reduce_scatter(full, divide)
    if impl == "all_to_all":  # `slack`: see [Note: receive slack]; [Note: own part stays home]
        received, work, starts = _exchange(full, world_size, group, slack, _rank(group, slack))
        return CommResult(received, work, (full,), _sum_rows(world_size, n, n, starts, full, divide))
    out = torch.empty(n, dtype=full.dtype, device=full.device)
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    work = _reduce_scatter(out, full, op=op, group=group, async_op=True)
    return CommResult(out, work, (full,))


def reduce_scatter_and_gather(
    rows: torch.Tensor,
    reduce_cols: int,
    group: dist.ProcessGroup,
    slack: RecvSlack | None = None,
    divide: Divide | None = None,
) -> tuple[CommResult, CommResult]:
    """One all-to-all for a gradient reduction and an all-gather ([Note: fused exchange] in
    host.py). `rows` is (world_size, reduce_cols + g): row r holds the gradient chunk for
    rank r in its first `reduce_cols` columns, this rank's shard (g elements) in the rest.

    Returns (reduce, gather), sharing one work: `wait` on the first gives the sum of the
    received gradient chunks in rank order (as `reduce_scatter_flat` with "all_to_all"), on the
    second every rank's shard, rank-major (as `all_gather_flat`)."""
    world_size, part = rows.shape
    send = rows.view(-1)
    received, work, starts = _exchange(send, world_size, group, slack, _rank(group, slack))

    def gathered(buf: torch.Tensor) -> torch.Tensor:
        return torch.cat([row[reduce_cols:] for row in _rows(buf, world_size, part, starts, send)])

    reduce = CommResult(received, work, (rows,), _sum_rows(world_size, reduce_cols, part, starts, send, divide))
    return reduce, CommResult(received, work, (rows,), gathered)


def all_reduce_flat(
    tensor: torch.Tensor, group: dist.ProcessGroup, average: bool = False, via: Any = None
) -> CommResult:
    """Sum (`average`: the backend's mean, NCCL only) `tensor` in place over `group` (HSDP: a
    reduced gradient shard across replicas). `via`: an exchange of a strategy's own
    (`via.all_reduce(tensor)`: transport/shm_all_reduce.py)."""
    if via is not None:
        return via.all_reduce(tensor)
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return CommResult(tensor, work, (tensor,))


def _rank(group: dist.ProcessGroup, slack: RecvSlack | None) -> int:
    return slack.rank if slack is not None else dist.get_rank(group)


def divides(impl: ReduceImpl, world_size: int) -> bool:
    """Whether `reduce_scatter_flat` applies its `divide` (through all-to-all, over ranks)."""
    return impl == "all_to_all" and not _local(world_size)


def _sum_rows(
    world_size: int,
    n: int,
    part: int,
    starts: list[int | None] | None,
    send: torch.Tensor,
    divide: Divide | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sum the first `n` elements of what each rank sent (`part` each, see `_exchange`; `send`
    the flat buffer given to it), in rank order (as a ring would add them), then `divide`."""

    def finish(received: torch.Tensor) -> torch.Tensor:
        chunks = [row[:n] for row in _rows(received, world_size, part, starts, send)]
        if world_size == 1:
            return chunks[0]
        if divide is None:
            return kernels.sum_rows(chunks)
        return kernels.sum_rows(chunks, divide.numel, divide.divisor)

    return finish
