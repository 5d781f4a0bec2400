"""All-to-all exchanges on gloo: gathers through all-to-all, a reduction and a gather in one
all-to-all, own chunks that stay home, the gather of a pair, and the receive slack that keeps a
mismatched pair from aborting the process ([Note: all-gather through all-to-all], [Note: own
part stays home], [Note: gather of a pair], [Note: receive slack] in transport/collectives.py; [Note: fused
exchange] in transport/host.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.harness import World

from overlap.tools.worlds.launch import run_local_world
from overlap.transport import collectives as comm


@pytest.fixture(scope="module")
def world3():
    w = World(3)
    yield w
    w.close()


def _data(rank: int, numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 10 + rank))


def exchanges_agree(rank: int, world: int, slack_bytes: int) -> dict:
    """Every all-to-all path against the native collectives, bitwise."""
    group = dist.group.WORLD
    slack = comm.RecvSlack(rank, slack_bytes) if slack_bytes else None
    shard, grads = _data(rank, 40, 1), _data(rank, world * 24, 2)
    native_gather = comm.wait(comm.all_gather_flat(shard, group, world, torch.float32))
    a2a_gather = comm.wait(comm.all_gather_flat(shard, group, world, torch.float32, impl="all_to_all", slack=slack))
    reduce_result = comm.reduce_scatter_flat(grads.clone(), group, world, "all_to_all", slack)
    received = reduce_result.output.numel()  # the receive buffer
    reduced = comm.wait(reduce_result)
    rows = torch.cat([grads.view(world, 24), shard.expand(world, 40)], dim=1).contiguous()
    fused_reduce, fused_gather = comm.reduce_scatter_and_gather(rows, 24, group, slack)
    got_gather, got_reduce = comm.wait(fused_gather), comm.wait(fused_reduce)
    # [Note: one pass for the sum]: the average of the first 20, in the sum's pass
    divide = comm.Divide(20, world)
    averaged = comm.wait(comm.reduce_scatter_flat(grads.clone(), group, world, "all_to_all", slack, divide))
    fused_averaged = comm.wait(comm.reduce_scatter_and_gather(rows, 24, group, slack, divide)[0])
    # the reference sum, in rank order
    everyone = comm.wait(comm.all_gather_flat(grads, group, world, torch.float32)).view(world, world, 24)
    expected = everyone[0, rank].clone()
    for r in range(1, world):
        expected += everyone[r, rank]
    # [Note: receive before send]: on gloo every rank's own chunk stays home (no message to
    # itself), so it receives only its peers' parts
    peers_part = max(24, slack_bytes // 4)
    expected_received = (world - 1) * peers_part
    return {
        "receive_buffer": received == expected_received,
        "a2a_gather": torch.equal(native_gather, a2a_gather),
        "reduce": torch.equal(reduced, expected),
        "fused_gather": torch.equal(got_gather, native_gather),
        "fused_reduce": torch.equal(got_reduce, expected),
        "averaged": torch.equal(averaged, torch.cat([expected[:20] / world, expected[20:]])),
        "fused_averaged": torch.equal(fused_averaged, averaged),
    }


@pytest.mark.parametrize("slack_bytes", [0, 4096], ids=["no-slack", "slack"])
def test_all_to_all_paths_match_native_collectives(world3, slack_bytes):
    for rank, r in enumerate(world3.run(exchanges_agree, slack_bytes=slack_bytes)):
        assert all(r.values()), (rank, r)


def pair_gather(rank: int, world: int, slack_bytes: int) -> dict:
    """[Note: gather of a pair]: the rows in rank order equal the native all-gather's; the
    own row is the buffer sent (no copy) and only the peer's part is received."""
    group = dist.group.WORLD
    slack = comm.RecvSlack(rank, slack_bytes) if slack_bytes else None
    shard = _data(rank, 40, 1)
    native = comm.wait(comm.all_gather_flat(shard, group, world, torch.float32))
    result = comm.all_gather_pair(shard, group, rank, torch.float32, slack=slack)
    rows = comm.wait(result)
    cast = comm.wait(comm.all_gather_pair(shard, group, rank, torch.bfloat16, slack=slack))
    return {
        "rows": torch.equal(torch.cat(rows), native),
        "own_row_is_sent": rows[rank] is shard,
        "received_peer_only": result.output.numel() == max(40, slack_bytes // 4),
        "cast": torch.equal(torch.cat(cast), native.to(torch.bfloat16)),
    }


@pytest.mark.parametrize("slack_bytes", [0, 4096], ids=["no-slack", "slack"])
def test_gather_of_a_pair(world2, slack_bytes):
    for rank, r in enumerate(world2.run(pair_gather, slack_bytes=slack_bytes)):
        assert all(r.values()), (rank, r)


def mismatched_pair(rank: int, world: int, slack_bytes: int) -> list[float]:
    """Rank 1 sends twice the bytes rank 0 expects (ranks whose steps diverged)."""
    part = 8 if rank == 0 else 16
    slack = comm.RecvSlack(rank, slack_bytes) if slack_bytes else None
    send = torch.full((world * part,), float(rank + 1))
    result = comm.reduce_scatter_flat(send, dist.group.WORLD, world, "all_to_all", slack)
    return comm.wait(result).tolist()


def test_receive_slack_turns_an_abort_into_wrong_bytes():
    """With room for the larger message, the mismatch completes (the bytes are wrong, which the
    gathers' tags or the next collective's timeout report); without it gloo aborts the process
    from its own thread, which no Python code can catch."""
    world = World(2)  # its own: the pair's messages do not match
    try:
        sums = world.run(mismatched_pair, timeout_s=120, slack_bytes=16 * 4)
    finally:
        world.close()
    assert len(sums[0]) == 8 and len(sums[1]) == 16
    assert sums[0] == [3.0] * 8  # its 8 expected elements arrived from rank 1 (of 16 sent)
    with pytest.raises(RuntimeError, match=r"SIGABRT|signal 6|exit code -6"):
        run_local_world(mismatched_pair, 2, 0, timeout_s=30, deadline_s=120)  # ends at the first exit


def receive_first(rank: int, world: int) -> dict:
    """[Note: receive before send]: on gloo an all-to-all exchange is point-to-point messages,
    receives posted first; sends of a large exchange are posted by the sender thread ([Note:
    sends posted off the training thread]), a small one's in place; both land as the
    backend's own all-to-all would."""
    from overlap.transport import pairwise

    group = dist.group.WORLD
    out = {}
    for label, numel in (("small", 64), ("large", pairwise.POST_OFF_THREAD_BYTES // 4 * world)):
        grads = _data(rank, numel, 3)
        result = comm.reduce_scatter_flat(grads.clone(), group, world, "all_to_all")
        out[f"{label}_is_exchange"] = isinstance(result.work, pairwise.ExchangeWork)
        out[f"{label}_off_thread"] = result.work._posting is not None
        reduced = comm.wait(result)
        everyone = comm.wait(comm.all_gather_flat(grads, group, world, torch.float32)).view(world, world, -1)
        out[f"{label}_sum"] = torch.equal(reduced, everyone[0, rank] + everyone[1, rank])
    return out


def test_exchanges_go_receive_first_on_gloo(world2):
    for rank, r in enumerate(world2.run(receive_first)):
        assert r == {
            "small_is_exchange": True,
            "small_off_thread": False,
            "small_sum": True,
            "large_is_exchange": True,
            "large_off_thread": True,
            "large_sum": True,
        }, (rank, r)


def silent_peer(rank: int, world: int, done: str) -> float:
    """Rank 1 never posts its side and stays alive (an exit would close the socket) until rank 0
    has written `done`; rank 0's wait must end at its own timeout, not hang."""
    import os
    import time
    from datetime import timedelta

    from overlap.transport import pairwise

    if rank == 1:
        deadline = time.monotonic() + 120  # a bound in case rank 0 never writes `done`
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return 0.0
    receives, sends = [None, torch.empty(1 << 20)], [None, torch.ones(1 << 20)]
    work = pairwise.exchange(dist.group.WORLD, receives, sends)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError):
            work.wait(timedelta(seconds=2))
        return time.monotonic() - t0
    finally:
        open(done, "w").close()


def test_exchange_wait_ends_at_its_timeout(tmp_path):
    world = World(2)  # its own: the failed exchange leaves the pair mid-message
    try:
        waited = world.run(silent_peer, timeout_s=180, done=str(tmp_path / "done"))
    finally:
        world.close()
    assert 1.5 <= waited[0] < 8, waited  # its own 2 s: the peer was alive and silent throughout


def test_exchange_refuses_unequal_peer_lists():
    from overlap.transport import pairwise

    with pytest.raises(ValueError, match="2 receives against 3 sends"):
        pairwise.exchange(None, [None, None], [None, None, None])  # type: ignore[arg-type]


def test_only_cpu_tensors_go_point_to_point():
    """gloo's send/recv take a CUDA tensor's device pointer as host memory: with CUDA tensors an
    exchange goes through gloo's all-to-all, which stages them through host copies."""
    from overlap.transport import backend

    assert backend.semantics_of("gloo", torch.device("cpu")).receive_first
    assert not backend.semantics_of("gloo", torch.device("cuda", 0)).receive_first
    assert not backend.semantics_of("nccl", torch.device("cuda", 0)).receive_first


def exchanges_as_for_cuda(rank: int, world: int) -> dict:
    """A gloo group whose semantics are those of CUDA tensors (the data stays on the CPU, which
    gloo's all-to-all serves the same way): every exchange the runtime issues, plain, with the
    own part home, with slack, and the encoded reduce-scatter, completes without a single
    point-to-point message and sums as the point-to-point path does."""
    from overlap.transport import backend

    group = dist.group.WORLD
    grads = _data(rank, world * 24, 2)
    expected = comm.wait(comm.reduce_scatter_flat(grads.clone(), group, world, "all_to_all"))
    real_semantics, real_exchange = backend.semantics, comm._p2p_exchange

    def refuse(*args, **kwargs):
        raise AssertionError(f"rank {rank}: a point-to-point exchange was issued")

    backend.semantics = lambda g, device: real_semantics(g, torch.device("cuda", 0))
    comm._p2p_exchange = refuse
    try:
        plain = comm.wait(comm.reduce_scatter_flat(grads.clone(), group, world, "all_to_all"))
        slack = comm.wait(
            comm.reduce_scatter_flat(grads.clone(), group, world, "all_to_all", comm.RecvSlack(rank, 4096))
        )
        received, work, starts = comm._exchange(grads.clone(), world, group, None, rank)
        work.wait()
        home = comm._rows(received, world, 24, starts, grads)
    finally:
        backend.semantics, comm._p2p_exchange = real_semantics, real_exchange
    return {
        "plain": torch.equal(plain, expected),
        "slack": torch.equal(slack, expected),
        "home": torch.equal(home[0] + home[1] + home[2], expected),
    }


def test_gloo_with_cuda_semantics_never_goes_point_to_point(world3):
    for rank, r in enumerate(world3.run(exchanges_as_for_cuda)):
        assert all(r.values()), (rank, r)
