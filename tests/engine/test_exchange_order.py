"""Point-to-point exchanges keep their order on every pair when some sends are posted by the
sender thread and others in place ([Note: sends posted off the training thread] in
overlap/transport/pairwise.py): gloo matches a pair's messages by their order, so a small send
posted in place while a large one still waits on the sender thread would be received into the
large one's buffer, and the large one into the small one's (an abort on a size mismatch)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from helpers.harness import World

from overlap.transport import pairwise


def large_then_small(rank: int, world: int) -> list[bool]:
    peer = 1 - rank
    big = torch.full((pairwise.POST_OFF_THREAD_BYTES // 4 + 1,), float(rank))  # posted off the thread
    small = torch.full((8,), 10.0 + rank)  # posted in place, unless sends are still queued
    got_big, got_small = torch.empty_like(big), torch.empty_like(small)
    if rank == 0:  # the sender thread busy: the large send waits behind this
        pairwise._sender_thread().submit(time.sleep, 0.5)
    sends = [None, None]
    receives = [None, None]
    sends[peer], receives[peer] = big, got_big
    first = pairwise.exchange(dist.group.WORLD, receives, sends)
    sends[peer], receives[peer] = small, got_small
    second = pairwise.exchange(dist.group.WORLD, receives, sends)
    first.wait()
    second.wait()
    return [bool((got_big == peer).all()), bool((got_small == 10.0 + peer).all())]


def test_a_small_exchange_does_not_overtake_sends_queued_on_the_sender_thread():
    world = World(2)
    try:
        assert world.run(large_then_small, timeout_s=120) == [[True, True], [True, True]]
    finally:
        world.close()
