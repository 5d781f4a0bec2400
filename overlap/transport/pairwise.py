"""gloo's all-to-all as point-to-point messages that post every receive before any send.

[Note: receive before send]
gloo pairs a send with a receive by a rendezvous over the one TCP socket two ranks share: the
receiving side announces a posted receive with a small message, and a payload leaves only once
its peer's announcement has arrived. Announcements and payloads go out through the socket's one
queue, in the order they are posted. gloo's all-to-all (and `isend` before `irecv`) posts the
send to a peer before the receive from it, so whenever one rank of a pair starts a little after
the other, its payload (already cleared: the peer announced early) is queued ahead of its own
announcement, the peer's payload cannot leave until that announcement arrives behind the whole
payload, and the two directions of a full-duplex link run one after the other. Which way an
exchange goes depends on a few microseconds of skew, so the same exchange takes one of two times.

Measured at two ranks behind the emulated 1 Gbit link, 6 MiB each way, 12 calls each, the ranks
started together after a barrier (`benchmarks/exchange_order.py`): `all_to_all_single` and
`isend`+`irecv` took 53 or 104 ms (median 104), `irecv`+`isend` 53.5 ms every time, the bytes of
one direction alone 52 ms; raw TCP both ways over one socket (no gloo) 52 ms.

Posting every receive first puts this rank's announcements on the wire before any of its
payloads, so both directions flow at once: `exchange` does that for every peer of an all-to-all.
The bytes moved and where they land are those of the all-to-all it replaces, so results are
bitwise the same. Messages match by their order on each pair and direction, which every rank
shares ([Note: collective order] in engine/schedule.py), under a tag of their own; the order of
receives against sends does not enter the matching.

[Note: sends posted off the training thread]
gloo starts a send where it is called, and when the peer's announcement is already there it
writes the payload into the socket in place, as far as the socket takes it: measured at two
ranks on loopback, 6 MiB, 3.9 ms of the calling thread for the later rank of the pair (0.1 ms
for an all-to-all, which gloo's worker thread runs). So receives are posted on the calling thread
(small announcements, and they must go first) and the sends of an exchange of at least
`POST_OFF_THREAD_BYTES` by one thread of our own, in the order they were asked for; smaller ones
in place, where a thread hand-off would cost more than the write.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

EXCHANGE_TAG = 0x0E0A
"""The point-to-point tag of every exchange: keeps them apart from a user's own sends and
receives on the same group (gloo matches by tag, then by order)."""

POST_OFF_THREAD_BYTES = 256 * 1024
"""Exchanges sending at least this many bytes post their sends on the sender thread
([Note: sends posted off the training thread])."""

_MIN_WAIT = timedelta(milliseconds=1)  # Work.wait(0) means "the group's timeout", not "now"
_sender: ThreadPoolExecutor | None = None
_last_posting: Future[list[Any]] | None = None  # the sender thread's latest job
_sender_lock = threading.Lock()


def _sender_thread() -> ThreadPoolExecutor:
    """The one thread that posts sends, in order (started on first use)."""
    global _sender
    with _sender_lock:
        if _sender is None:
            _sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-send")
        return _sender


class ExchangeWork:
    """The receives and sends of one exchange as one handle, used as a `dist.Work` is here.

    No future: the host timer stamps its completion when the training thread's wait returns
    (`CompletionWaiter`, as for gloo's reduce-scatter). It may be waited on more than once (a
    fused exchange's two results share it): gloo's own send and receive handles may not (a
    second wait on a receive waits for another message), so each is waited on once."""

    def __init__(self, works: Sequence[Any], posting: Future[list[Any]] | None = None) -> None:
        self._pending = [w for w in works if w is not None]
        self._posting = posting  # the sends, while the sender thread posts them

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for every message; `timeout` bounds the whole exchange (gloo raises RuntimeError)."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        if self._posting is not None:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            try:
                sends = self._posting.result(left)
            except TimeoutError as e:
                raise RuntimeError(f"the sends of an exchange were not posted within {timeout}") from e
            self._posting = None
            self._pending += sends
        while self._pending:
            work = self._pending[0]
            if deadline is None:
                work.wait()
            else:
                work.wait(max(timedelta(seconds=deadline - time.monotonic()), _MIN_WAIT))
            self._pending.pop(0)
        return True

    def get_future(self) -> Any:
        raise RuntimeError("getFuture not implemented: a pairwise exchange has no future")


def exchange(
    group: dist.ProcessGroup, receives: Sequence[torch.Tensor | None], sends: Sequence[torch.Tensor | None]
) -> ExchangeWork:
    """Receive `receives[r]` from and send `sends[r]` to each group rank r where it is given
    (contiguous tensors; a receive may be larger than what arrives: gloo fills its front),
    receives first ([Note: receive before send])."""
    if len(receives) != len(sends):
        raise ValueError(f"exchange: {len(receives)} receives against {len(sends)} sends")
    devices = {buf.device.type for buf in (*receives, *sends) if buf is not None}
    # gloo's send/recv read and write the data pointer as host memory (CommSemantics.receive_first)
    assert devices <= {"cpu"}, f"rank {dist.get_rank()}: point-to-point exchange of {devices} tensors"
    works = [
        dist.irecv(buf, group=group, tag=EXCHANGE_TAG, group_src=r) for r, buf in enumerate(receives) if buf is not None
    ]
    to_send = [(r, buf) for r, buf in enumerate(sends) if buf is not None]
    global _last_posting
    small = sum(buf.numel() * buf.element_size() for _, buf in to_send) < POST_OFF_THREAD_BYTES
    if small and (_last_posting is None or _last_posting.done()):
        return ExchangeWork(works + _post_sends(group, to_send))
    # [Note: sends posted off the training thread]; a small one too while earlier sends are still
    # queued there: posted in place, it would overtake them and be matched with their receives
    _last_posting = _sender_thread().submit(_post_sends, group, to_send)
    return ExchangeWork(works, _last_posting)


def _post_sends(group: dist.ProcessGroup, to_send: list[tuple[int, torch.Tensor]]) -> list[Any]:
    return [dist.isend(buf, group=group, tag=EXCHANGE_TAG, group_dst=r) for r, buf in to_send]
