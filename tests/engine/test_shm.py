"""The shared-memory transport ([Note: shared-memory exchange] in overlap/transport/shm.py).

- ranks of one host are found from the group and exchange through shared memory; training is
  DDP's bitwise at two ranks (and within tolerance at four, and under HSDP 2 x 2, shared memory
  inside each shard group); `shared_memory="off"`, or a rank elsewhere, keeps gloo's strategies;
- the ring wraps around and makes room by completing earlier collectives, never deadlocking; once
  drained, posts start over at its beginning (first fit);
- an all-gather's output lives in the ring while it has room and is never reused while held;
- a wait that outlasts its spin and yield stages sleeps, and returns with the bytes once the peer posts;
- a large reduce-scatter's output is recycled once every view of it is dropped, never while one is
  held, and the pool of recycled buffers never holds more than was once lent at a time;
- ranks that issue different collectives raise on every rank, naming it;
- a peer killed or stopped mid-exchange makes the survivor raise (at once, or after the
  timeout), and no segment is left in /dev/shm at any point after wrap.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.models import STRICT_ZERO3, encoder_stack
from test_seam import _parity

from overlap.transport import collectives as comm
from overlap.transport import shm
from overlap.transport.strategy import UnitWire, Wire


def _segments_left(segments: shm.ShmSegments) -> list[str]:
    """Which of the segments' files are still in /dev/shm."""
    return [path for path in segments.paths if os.path.exists(path)]


def train_against_ddp(rank: int, world: int, config: dict, hsdp: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    def setup(model: Any) -> Any:
        transport = model._overlap_state.runtime.transport
        kinds = [type(s).__name__ for s in (transport.all_gather, transport.reduce_scatter)]
        left = _segments_left(transport.all_gather.segments) if kinds[0] == "ShmAllGather" else []
        return {"kinds": kinds, "left": left}

    group = init_device_mesh("cpu", (2, world // 2)) if hsdp else None
    r = _parity(rank, 3, setup, layers=6, group=group, **config)
    return {"diff": r["diff"], **r["seen"]}


def train_on_recycled_sums(rank: int, world: int) -> dict:
    """`train_against_ddp` with every reduce-scatter output from the pool: `.grad` shards live
    in recycled buffers across optimizer steps and `zero_grad`."""
    from overlap.kernels import cpu
    from overlap.transport import shm_segments

    shm_segments.RECYCLED_BYTES = 1
    r = train_against_ddp(rank, world, {})
    return {**r, "pool": cpu.load_extension().pool_stats()}


def identity_differs_on_rank1(rank: int, world: int) -> list[str]:
    """A rank elsewhere (its host identity differs): every rank keeps gloo's strategies."""
    import overlap

    real = shm.host_identity
    shm.host_identity = (lambda: real() + "|elsewhere") if rank == 1 else real
    try:
        transport = overlap.wrap(encoder_stack(), collective_timeout_s=60)._overlap_state.runtime.transport
    finally:
        shm.host_identity = real
    return [type(s).__name__ for s in (transport.all_gather, transport.reduce_scatter)]


def _wire(group: dist.ProcessGroup) -> Wire:
    semantics = comm.backend.semantics(group, torch.device("cpu"))
    return Wire(
        group,
        dist.get_rank(group),
        dist.get_world_size(group),
        torch.device("cpu"),
        semantics,
        "auto",
        "all_to_all",
        None,
        (UnitWire(1, 4, 4, True),),
    )


def many_in_flight(rank: int, world: int, ring_bytes: int) -> dict:
    """Forty all-gathers and reduce-scatters of up to 1 MiB issued before any wait, through a
    ring of `ring_bytes`: the ring wraps and makes room; every result is exact."""
    from overlap.transport.gloo import gloo_strategies

    group = dist.group.WORLD
    plan = shm.ShmPlan(timedelta(seconds=60))
    plan.segments = shm.ShmSegments(group, ring_bytes, plan.timeout)
    gloo = gloo_strategies()
    gather, reduce = shm.ShmAllGather(plan, gloo[0]), shm.ShmReduceScatter(plan, gloo[1])
    for strategy in (gather, reduce):
        strategy.plan(_wire(group))
    issued = []
    for k in range(40):
        numel = 1024 * (1 + (k * 37) % 256)
        mine = torch.arange(numel, dtype=torch.float32) * (rank + 1) + k
        if k % 2:
            issued.append(("gather", numel, k, gather(0, mine, torch.float32, None, None, False)))
        else:
            full = reduce.allocate(world, numel, torch.float32, torch.device("cpu"))
            full.copy_(mine.expand(world, numel))
            issued.append(("reduce", numel, k, reduce(full, None)))
    wrong = []
    for kind, numel, k, result in issued:
        got = comm.wait(result)
        rows = [torch.arange(numel, dtype=torch.float32) * (r + 1) + k for r in range(world)]
        want = torch.cat(rows) if kind == "gather" else sum(rows[1:], rows[0])
        if not torch.equal(got, want):
            wrong.append(f"{kind} {k}")
    dist.barrier()  # every peer consumed every post: the ring has drained
    plan.segments.reserve(64)
    drained_start = plan.segments.reserved[0] if plan.segments.reserved else None
    plan.segments.cancel()
    return {"wrong": wrong, "seq": plan.segments.seq, "left": _segments_left(plan.segments), "start": drained_start}


def held_outputs(rank: int, world: int) -> dict:
    """All-gathers into outputs the strategy allocates in the ring, every output held: the
    ring's upper half fills, later outputs are private, and none is overwritten while held;
    once dropped and read by every peer, the ring hands out its upper half from the start."""
    group = dist.group.WORLD
    plan = shm.ShmPlan(timedelta(seconds=60))
    plan.segments = seg = shm.ShmSegments(group, 1 << 20, plan.timeout)
    gather = shm.ShmAllGather(plan, shm.AllGather())
    gather.plan(_wire(group))
    numel = 16 << 10  # 64 KiB a rank: four outputs of two ranks fill the 512 KiB upper half
    held = []
    for k in range(12):
        result = gather(0, torch.full((numel,), float(100 * k + rank)), torch.float32, None, None, False)
        held.append((k, comm.wait(result)))
    in_ring = [k for k, out in held if seg.ring_ptr <= out.data_ptr() < seg.ring_ptr + seg.ring_bytes]
    wrong = [k for k, out in held if not torch.equal(out, _rows(numel, world, k))]
    del held, result
    dist.barrier()  # every peer read every row
    again = gather.allocate(world * numel, torch.float32, torch.device("cpu"))
    return {"in_ring": in_ring, "wrong": wrong, "again": again.data_ptr() - seg.ring_ptr, "half": seg.half}


def _rows(numel: int, world: int, k: int) -> torch.Tensor:
    return torch.cat([torch.full((numel,), float(100 * k + r)) for r in range(world)])


def late_peer(rank: int, world: int, late_s: float) -> dict:
    """Rank 1 posts `late_s` after rank 0 starts waiting: past the spin and yield stages, rank 0
    sleeps on the futex and the post wakes it; the gathered bytes are rank 1's."""
    group = dist.group.WORLD
    plan = shm.ShmPlan(timedelta(seconds=60))
    plan.segments = shm.ShmSegments(group, 1 << 20, plan.timeout)
    gather = shm.ShmAllGather(plan, shm.AllGather())
    gather.plan(_wire(group))
    results = []
    for k in range(3):
        dist.barrier()
        if rank == 1:
            time.sleep(late_s)
        start = time.monotonic()
        got = comm.wait(gather(0, torch.full((256,), float(10 * k + rank)), torch.float32, None, None, False))
        want = torch.cat([torch.full((256,), float(10 * k + r)) for r in range(world)])
        results.append((torch.equal(got, want), time.monotonic() - start))
    return {"exact": all(ok for ok, _ in results), "waited_s": [w for _, w in results]}


def recycled_sums(rank: int, world: int) -> dict:
    """Reduce-scatters whose outputs come from the pool (its threshold lowered to 64 KiB here):
    exact sums; an output dropped before the next call gives its buffer to it, a held one (as a
    view) does not."""
    from overlap.transport import shm_segments

    shm_segments.RECYCLED_BYTES = 64 << 10
    group = dist.group.WORLD
    plan = shm.ShmPlan(timedelta(seconds=60))
    plan.segments = shm.ShmSegments(group, 4 << 20, plan.timeout)
    reduce = shm.ShmReduceScatter(plan, shm.ReduceScatter())
    reduce.plan(_wire(group))
    numel = 64 << 10  # 256 KiB of fp32 summed into this rank's 128 KiB
    pointers, wrong, held = [], [], []
    for k in range(6):
        full = reduce.allocate(world, numel // world, torch.float32, torch.device("cpu"))
        full.copy_(torch.arange(numel, dtype=torch.float32).view(world, -1) * (rank + 1) + k)
        got = comm.wait(reduce(full, None))
        rows = torch.arange(numel, dtype=torch.float32).view(world, -1)[rank]
        # integers below 2**24: exact in fp32 whatever the order or vector width of the sum
        if not torch.equal(got, sum(rows * (r + 1) + k for r in range(world))):
            wrong.append(k)
        pointers.append(got.data_ptr())
        if k == 3:
            held.append(got[1:])  # a view keeps the buffer out of the pool
        del got
    idle, lent, peak = plan.segments.ext.pool_stats()
    return {
        "wrong": wrong,
        "pointers": pointers,
        "held_is_live": held[0].data_ptr() == pointers[3] + 4,
        "idle": idle,
        "lent": lent,
        "peak": peak,
    }


def different_sizes(rank: int, world: int) -> str:
    group = dist.group.WORLD
    plan = shm.ShmPlan(timedelta(seconds=60))
    plan.segments = shm.ShmSegments(group, 1 << 20, plan.timeout)
    gather = shm.ShmAllGather(plan, shm.AllGather())
    gather.plan(_wire(group))
    try:
        comm.wait(gather(0, torch.ones(100 * (rank + 1)), torch.float32, None, None, False))
    except comm.CollectiveError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "config",
    [
        {},
        STRICT_ZERO3,
        {"reduce_scatter_bucket_bytes": 1 << 20},
        {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    ],
    ids=["default", "strict_zero3", "one_bucket", "bf16_params"],
)
def test_two_ranks_exchange_through_shared_memory(world2, config):
    exact = "param_dtype" not in config
    for rank, r in enumerate(world2.run(train_against_ddp, config=config, timeout_s=300)):
        assert r["kinds"] == ["ShmAllGather", "ShmReduceScatter"], (rank, r)
        assert r["diff"] == 0.0 if exact else r["diff"] < 5e-2, (rank, r["diff"])
        assert r["left"] == [], (rank, r["left"])  # unlinked at wrap: nothing can be left behind


def test_four_ranks_and_hsdp(world4):
    for hsdp in (False, True):
        for rank, r in enumerate(world4.run(train_against_ddp, config={}, hsdp=hsdp, timeout_s=300)):
            assert r["kinds"] == ["ShmAllGather", "ShmReduceScatter"], (hsdp, rank, r)
            assert r["diff"] < 1e-5, (hsdp, rank, r["diff"])


def test_off_or_elsewhere_keeps_gloo(world2):
    for rank, r in enumerate(world2.run(train_against_ddp, config={"shared_memory": "off"}, timeout_s=300)):
        assert r["kinds"] == ["GlooAllGather", "GlooReduceScatter"] and r["diff"] == 0.0, (rank, r)
    assert world2.run(identity_differs_on_rank1, timeout_s=120) == [["GlooAllGather", "GlooReduceScatter"]] * 2


def test_ring_wraps_and_makes_room(world2):
    for rank, r in enumerate(world2.run(many_in_flight, ring_bytes=6 << 20, timeout_s=300)):
        assert r["wrong"] == [] and r["seq"] == 40 and r["left"] == [], (rank, r)
        assert r["start"] == 0, (rank, r["start"])  # first fit: a drained ring starts over


def test_gather_outputs_held_in_the_ring(world2):
    for rank, r in enumerate(world2.run(held_outputs, timeout_s=120)):
        assert r["in_ring"] == list(range(4)) and r["wrong"] == [], (rank, r)
        assert r["again"] == r["half"], (rank, r)  # first fit again once every output was dropped


def test_sleeping_wait_returns_after_the_post(world2):
    late_s = 0.2  # well past the spin and yield stages (shm.SPIN_S, shm.YIELD_S)
    r0, r1 = world2.run(late_peer, late_s=late_s, timeout_s=120)
    assert r0["exact"] and r1["exact"], (r0, r1)
    # rank 0 slept through rank 1's delay and returned after the post, long before any deadline
    assert all(late_s * 0.9 < w < late_s + 5.0 for w in r0["waited_s"]), r0["waited_s"]


def test_large_sums_are_recycled(world2):
    for rank, r in enumerate(world2.run(recycled_sums, timeout_s=120)):
        p = r["pointers"]
        assert r["wrong"] == [], (rank, r)
        assert p[1] == p[0] and p[2] == p[0] and p[3] == p[0], (rank, p)  # dropped: the same buffer again
        assert p[4] != p[3] and p[5] == p[4], (rank, p)  # held as a view: a new one, then that one again
        assert r["held_is_live"] and r["lent"] == 128 << 10 and r["idle"] == 128 << 10, (rank, r)
        assert r["idle"] + r["lent"] <= r["peak"], (rank, r)


def test_training_on_recycled_sums_is_ddps(world2):
    # bitwise at two ranks on any CPU: each reduced element is one fp32 addition of the two
    # ranks' values (commutative, one rounding) divided by 2 (exact), as DDP's all-reduce does
    for rank, r in enumerate(world2.run(train_on_recycled_sums, timeout_s=300)):
        assert r["kinds"] == ["ShmAllGather", "ShmReduceScatter"] and r["diff"] == 0.0, (rank, r)
        assert r["pool"][2] > 0, (rank, r["pool"])  # the sums came from the pool


def test_pool_never_holds_more_than_was_lent_at_once():
    from overlap.kernels import cpu

    ext = cpu.load_extension()
    assert ext is not None, "the pool is part of the compiled kernels"
    ext.pool_release()  # idle buffers freed, the high-water mark down to what is lent now
    lent0 = ext.pool_stats()[1]
    a, b = ext.pool_empty(1 << 20, torch.float32), ext.pool_empty(1 << 20, torch.float32)  # 4 MiB each
    both = {a.data_ptr(), b.data_ptr()}
    del a, b
    assert ext.pool_stats()[0] == 8 << 20  # both kept: 8 MiB were lent at once
    c = ext.pool_empty(1 << 20, torch.float32)
    assert c.data_ptr() in both and c.data_ptr() % 4096 == 0
    del c
    big = ext.pool_empty(3 << 20, torch.float32)  # 12 MiB lent: the idle 8 MiB would exceed the mark
    idle, lent, peak = ext.pool_stats()
    assert lent - lent0 == 12 << 20 and idle + lent <= peak, (idle, lent, peak)
    del big
    assert ext.pool_release() == 12 << 20 and ext.pool_stats()[0] == 0


def test_different_collectives_raise_on_every_rank(world2):
    for rank, message in enumerate(world2.run(different_sizes, timeout_s=120)):
        assert "another collective" in message or "aborted" in message, (rank, message)


# ------------------------------------------------------------------ a peer killed or stopped


def _peer(rank: int, init: str, how: str, answers: Any) -> None:
    """Rank 1 stops before posting (killed, or frozen); rank 0 waits for its post."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    group = dist.group.WORLD
    plan = shm.ShmPlan(timedelta(seconds=3))
    plan.segments = shm.ShmSegments(group, 1 << 20, plan.timeout)
    gather = shm.ShmAllGather(plan, shm.AllGather())
    gather.plan(_wire(group))
    comm.wait(gather(0, torch.ones(64), torch.float32, None, None, False))  # one healthy exchange
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    start = time.monotonic()
    try:
        comm.wait(gather(0, torch.ones(64), torch.float32, None, None, False))
        answers.put(("no error", 0.0, _segments_left(plan.segments), plan.segments.paths))
    except comm.CollectiveError as e:
        answers.put((str(e), time.monotonic() - start, _segments_left(plan.segments), plan.segments.paths))
    answers.close()
    answers.join_thread()  # the answer is in the pipe before the process leaves
    os._exit(0)  # the group is broken: tearing it down could block


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_peer_killed_or_stopped_mid_exchange(tmp_path, how):
    ctx = mp.get_context("forkserver")  # ranks of their own: a dead rank breaks its group for good
    answers = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_peer, args=(r, init, how, answers)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        message, waited, left, paths = answers.get(timeout=240)
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=30)
    assert "shared-memory exchange" in message and "rank 1" in message, message
    if how == "kill":  # the process is gone: at once, not after the timeout
        assert "is gone" in message and waited < 3.0, (message, waited)
    else:  # frozen: its sockets and memory stay, the timeout ends the wait
        assert "did not post within 3s" in message and waited >= 2.5, (message, waited)
    assert left == [] and not [p for p in paths if os.path.exists(p)], left
