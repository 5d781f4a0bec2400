"""Collectives through a codec: what crosses the wire is encoded bytes (int8/fp8 blockwise
codes and scales), decoded and summed on arrival. Pure functions over a process group, as in
collectives.py, whose exchange mechanics they use (`collectives._exchange`: receive-first on
gloo, the backend's all-to-all elsewhere).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.compression import Codec
from overlap.compression.feedback import FeedbackResidual
from overlap.transport import collectives as comm
from overlap.transport.fingerprint import TAG_BYTES
from overlap.transport.results import CommResult, RecvSlack


def encode_shard(shard: torch.Tensor, codec: Codec, tag_room: bool = False) -> torch.Tensor:
    """The wire bytes of `shard` under `codec`, as `all_gather_encoded` sends them; with
    `tag_room`, padded to 8 bytes and followed by `TAG_BYTES` for the tag ([Note: collective
    fingerprints]). Encoded straight into the send buffer; its non-finite blocks are counted
    where every rank decodes them, not here ([Note: collective finite check] in
    compression/finite.py)."""
    wire = codec.wire_bytes(shard.numel(), shard.dtype)
    if tag_room:
        out = torch.zeros(_round8(wire) + TAG_BYTES, dtype=torch.uint8, device=shard.device)
    else:
        out = torch.empty(wire, dtype=torch.uint8, device=shard.device)
    codec.encode_rows_into(shard.reshape(1, -1), out[:wire].view(1, wire), count=False)
    return out


def all_gather_encoded(
    send: torch.Tensor,
    numel: int,
    group: dist.ProcessGroup,
    world_size: int,
    dtype: torch.dtype,
    codec: Codec,
    shard_dtype: torch.dtype = torch.float32,
    tag: int | None = None,
) -> CommResult:
    """All-gather through `codec`: `send` is this rank's shard of `numel` elements encoded by
    `encode_shard`; every rank's bytes are gathered and each part decoded into a rank-major
    `dtype` tensor by `wait`, in one call for all parts (`Codec.decode_rows_into`), which
    counts their non-finite blocks: the same count on every rank. The fp32 master shard is
    untouched; only the wire copy is compressed (this rank decodes its own part too, so every
    rank computes with the same values). With `tag`, `send` has `encode_shard`'s tag room and
    the tag is written into its last `TAG_BYTES`; each rank's row of the output then ends in
    that rank's tag (`fingerprint.byte_tags`)."""
    wire = codec.wire_bytes(numel, shard_dtype)
    row = send.numel()
    if tag is not None:
        assert row == _round8(wire) + TAG_BYTES, (row, wire)
        send[row - TAG_BYTES :].view(torch.int64).fill_(tag)
    else:
        assert row == wire, (row, wire)
    received = torch.empty(world_size * row, dtype=torch.uint8, device=send.device)
    work = None
    if comm._local(world_size):
        received.copy_(send)
    elif comm._receive_first(group, send):  # gloo: [Note: receive before send]; the own row copied here
        me = dist.get_rank(group)
        rows = received.view(world_size, row)
        rows[me].copy_(send)
        receives = [None if r == me else rows[r] for r in range(world_size)]
        work = comm._p2p_exchange(group, receives, [None if r == me else send for r in range(world_size)])
    else:
        work = comm._all_gather(received, send, group=group, async_op=True)

    def finish(buf: torch.Tensor) -> torch.Tensor:
        out = torch.empty(world_size, numel, dtype=dtype, device=buf.device)
        codec.decode_rows_into(buf.view(world_size, row)[:, :wire], numel, shard_dtype, out)
        return out.view(-1)

    return CommResult(received, work, (send,), finish)


def reduce_scatter_encoded(
    grads: torch.Tensor,
    tail: torch.Tensor,
    group: dist.ProcessGroup,
    world_size: int,
    codec: Codec,
    residual: FeedbackResidual | None = None,
    slack: RecvSlack | None = None,
) -> CommResult:
    """Reduce-scatter the rank-major `grads` (world_size, n) through `codec`: row r is encoded
    (with error feedback from `residual`'s row for rank r when given) and sent to rank r by
    all-to-all; `wait` decodes the world_size received rows and sums them in fp32, in rank order.
    Each is one call for all rows (`Codec.encode_rows_into`, `Codec.decode_sum_rows`): on CUDA
    one kernel launch, whatever the world size ([Note: rows per launch] in
    kernels/triton_kernels.py).

    This rank's own row never crosses the wire, so it is not encoded: `wait` adds it exactly,
    and the residual has no row for it ([Note: error feedback residual] in feedback.py). That
    is both cheaper (1/world_size of the codec work, half of it at two ranks) and more accurate
    than sending it to itself through the codec.

    `tail` (world_size, k) rides along uncompressed and is summed exactly (the used-flag columns
    of the reduction: small integers, exact in any order). So does the codec's count of
    non-finite blocks so far this step ([Note: collective finite check] in
    compression/finite.py): the result is [sum of grads row | sum of tail row | sum of the
    counts], n + k + 1 elements in grads' dtype; the caller hands the last to
    `codec.agree_nonfinite` once the result is final.
    """
    n, k = grads.shape[1], tail.shape[1]
    dtype = grads.dtype
    # Each row: [tail | count (int64) | codes and scales], each part padded to 8 bytes so that
    # every view of the received bytes (fp32 scales, the tail's dtype, the count) is aligned.
    tail_bytes = k * tail.element_size()
    count_at = _round8(tail_bytes)
    tail_span = count_at + 8
    wire = codec.wire_bytes(n, dtype)
    step = tail_span + _round8(wire)
    send = torch.empty(world_size * step, dtype=torch.uint8, device=grads.device)
    rows = send.view(world_size, step)
    if count_at > tail_bytes:
        rows[:, tail_bytes:count_at].zero_()  # the bytes no reader looks at, zeros all the same
    if step > tail_span + wire:
        rows[:, tail_span + wire :].zero_()
    me = dist.get_rank(group) if world_size > 1 else 0
    own = grads[me]
    assert residual is None or (residual.rank, residual.world_size) == (me, world_size), (
        f"rank {me}: the residual belongs to rank {residual.rank} of {residual.world_size}"
    )
    codec.encode_rows_into(grads, rows[:, tail_span : tail_span + wire], me, residual)
    if tail_bytes:
        rows[:, :tail_bytes].copy_(tail.contiguous().view(torch.uint8).view(world_size, tail_bytes))
    counts = rows[:, count_at:tail_span].view(torch.int64)
    if codec.nonfinite is None:
        counts.zero_()
    else:  # in stream order after the encodes above
        counts.copy_(codec.nonfinite.current(grads.device).view(1, 1).expand(world_size, 1))
    work, starts = None, None
    if comm._local(world_size):
        received = send.clone()
    else:  # `slack`: see [Note: receive slack]; [Note: own part stays home]
        received, work, starts = comm._exchange(send, world_size, group, slack, me)

    def finish(buf: torch.Tensor) -> torch.Tensor:
        parts = comm._rows(buf, world_size, step, starts, send)
        peers = _peer_rows(buf, parts, me, step, starts)
        out = torch.empty(n + k + 1, dtype=dtype, device=buf.device)
        codec.decode_sum_rows(peers[:, tail_span : tail_span + wire], own, me, world_size, out[:n])
        heads = torch.stack([part[:tail_span] for part in parts])  # (world_size, tail_span) bytes
        if k:
            out[n : n + k].copy_(heads[:, :tail_bytes].view(tail.dtype).float().sum(0))
        out[n + k :].copy_(heads[:, count_at:].view(torch.int64).sum(0))
        return out

    return CommResult(received, work, (send, own, tail), finish)  # tail: read by the send copy


def _peer_rows(
    buf: torch.Tensor, parts: list[torch.Tensor], me: int, step: int, starts: list[int | None] | None
) -> torch.Tensor:
    """The received rows as one (rows, step) tensor for `Codec.decode_sum_rows`: a view when
    they are evenly spaced (every row, or every row but this rank's own), else a copy of the
    peers' rows (receive slack: gloo only)."""
    world_size = len(parts)
    if starts is None:
        return buf.view(world_size, step)
    if (
        all(start == (r - (r > me)) * step for r, start in enumerate(starts) if start is not None)
        and starts[me] is None
    ):
        return buf[: (world_size - 1) * step].view(world_size - 1, step)
    return torch.stack([part for r, part in enumerate(parts) if r != me])


def _round8(num_bytes: int) -> int:
    return (num_bytes + 7) // 8 * 8
