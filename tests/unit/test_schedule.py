"""The schedule alone (no ranks, no tensors): legal transitions, exact action sequences,
the prefetch budget, and that every unit is reduced exactly once per step."""

from __future__ import annotations

import random

import pytest

from overlap.engine.actions import CheckOrder, Free, Gather, Reduce, ReleaseReduce, WaitGather, WaitReduce, order_hash
from overlap.engine.schedule import Schedule, ScheduleConfig
from overlap.engine.unit_state import UnitState


def make(n: int, depth: int = 1, reshard: bool = True, bucket: int = 0, root=None, cap=None):
    return Schedule([100] * n, [200] * n, ScheduleConfig(depth, cap, reshard, bucket), root=root)


def sequential_step(s: Schedule, n: int, root=None, watch=None) -> list:
    """Events as a model running units 0..n-1 in order, then backward in reverse, produces."""
    out: list = []

    def emit(actions):
        out.extend(actions)
        if watch is not None:
            watch(s)

    emit(s.begin_forward())
    for u in range(n):
        if u != root:
            emit(s.pre_forward(u))
            emit(s.post_forward(u, True))
    emit(s.end_forward(True))
    if root is not None:
        emit(s.pre_backward(root))
    for u in reversed(range(n)):
        if u != root:
            emit(s.pre_backward(u))
            emit(s.post_backward(u))
    emit(s.end_backward())
    return out


def test_illegal_transition_is_asserted():
    s = make(2)
    with pytest.raises(AssertionError, match="illegal transition"):
        s._move(0, UnitState.UNSHARDED)  # SHARDED -> UNSHARDED skips the gather


def test_steady_state_actions_default():
    s = make(4)
    first = sequential_step(s, 4)
    assert [a for a in first if isinstance(a, CheckOrder) and a.what in ("forward", "backward")] == [
        CheckOrder("forward", order_hash((0, 1, 2, 3)), (0, 1, 2, 3)),
        CheckOrder("backward", order_hash((3, 2, 1, 0)), (3, 2, 1, 0)),
    ]
    second = sequential_step(s, 4)
    assert second == [
        Gather(0),
        Gather(1),
        WaitGather(0),
        Free(0),
        Gather(2),
        WaitGather(1),
        Free(1),
        Gather(3),
        WaitGather(2),
        Free(2),
        WaitGather(3),
        Gather(2, True),  # end of forward: unit 3 is kept for backward, unit 2 prefetched
        Free(3),
        Reduce(4, (3,)),
        Gather(1, True),
        WaitGather(2),
        # at most one reduce-scatter input alive ([Note: reduce buffers]): the previous
        # bucket's is released before the next bucket allocates its own
        Free(2),
        ReleaseReduce(4, (3,)),
        Reduce(5, (2,)),
        Gather(0, True),
        WaitGather(1),
        Free(1),
        ReleaseReduce(5, (2,)),
        Reduce(6, (1,)),
        WaitGather(0),
        Free(0),
        ReleaseReduce(6, (1,)),
        Reduce(7, (0,)),
        WaitReduce(4, (3,)),
        WaitReduce(5, (2,)),
        WaitReduce(6, (1,)),
        WaitReduce(7, (0,)),
    ]
    assert sum(isinstance(a, Gather) for a in second) == 4 + 3  # ZeRO-3: last unit kept


def test_first_step_checks_every_collective():
    s = make(3)
    first = sequential_step(s, 3)
    for i, action in enumerate(first):
        if isinstance(action, (Gather, Reduce)):
            assert isinstance(first[i - 1], CheckOrder), (i, first)
    assert not any(isinstance(a, CheckOrder) for a in sequential_step(s, 3))


def _forward_only(s: Schedule, n: int) -> list:
    out = s.begin_forward()
    for u in range(n):
        out += s.pre_forward(u) + s.post_forward(u, False)
    return out + s.end_forward(False)


def test_order_checks_stop_per_phase():
    """[Note: collective order]: an evaluation before training, and leading no_sync
    micro-batches, pay each phase's checks once; the checks of a phase not yet seen stay."""
    s = make(3)
    first_eval = _forward_only(s, 3)
    assert sum(isinstance(a, CheckOrder) for a in first_eval) == 3 + 1  # each gather + the order
    assert not any(isinstance(a, CheckOrder) for a in _forward_only(s, 3))  # evaluation: checked
    s.sync_grads = False
    accumulate = sequential_step(s, 3)
    forward_end = next(i for i, a in enumerate(accumulate) if isinstance(a, Gather) and a.for_backward)
    assert not any(isinstance(a, CheckOrder) for a in accumulate[: forward_end - 1])  # forward: checked
    backward_gathers = [a for a in accumulate if isinstance(a, Gather) and a.for_backward]
    assert backward_gathers and all(  # the first backward's gathers are checked
        isinstance(accumulate[accumulate.index(g) - 1], CheckOrder) for g in backward_gathers
    )
    assert not any(isinstance(a, CheckOrder) for a in sequential_step(s, 3))  # second no_sync: none
    s.sync_grads = True
    synced = sequential_step(s, 3)
    checks = [a for a in synced if isinstance(a, CheckOrder)]
    # only the reductions (and the backward order) are still unchecked
    assert [c.what for c in checks] == ["reduce"] * 3 + ["backward"], checks
    assert not any(isinstance(a, CheckOrder) for a in sequential_step(s, 3))


def test_zero2_gathers_once_and_buckets_by_bytes():
    s = make(4, depth=0, reshard=False, bucket=400)
    sequential_step(s, 4)
    second = sequential_step(s, 4)
    assert [a for a in second if isinstance(a, Gather)] == [Gather(u) for u in range(4)]
    assert [a for a in second if isinstance(a, Reduce)] == [Reduce(2, (3, 2)), Reduce(3, (1, 0))]


def test_root_unit_stays_gathered_and_is_reduced_last():
    s = make(4, root=0)
    sequential_step(s, 4, root=0)
    second = sequential_step(s, 4, root=0)
    assert second[0] == Gather(0)
    assert Free(0) not in second[: second.index(Reduce(4, (3,)))]
    reduces = [a.units for a in second if isinstance(a, Reduce)]
    assert reduces == [(3,), (2,), (1,), (0,)]


@pytest.mark.parametrize("seed", range(20))
def test_budget_and_exactly_once_reduction(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    depth = rng.randint(0, 3)
    root = rng.choice([None, 0]) if n > 1 else None
    cap = rng.choice([None, 150, 250, 1000])
    s = make(n, depth, rng.random() < 0.7, rng.choice([0, 200, 500, 10_000]), root, cap)
    budget = depth + 1

    def watch(sched: Schedule) -> None:
        held = sched.held_units()
        if sched.config.reshard_after_forward:
            # the unit needed now is gathered even past the byte cap, so the cap bounds
            # prefetch only: at most one unit over it
            assert len(held) <= budget, (held, sched.states)
            if cap is not None:
                assert sum(sched.unit_bytes[u] for u in held) <= max(cap, 100) + 100

    for _ in range(3):
        actions = sequential_step(s, n, root=root, watch=watch)
        reduced = [u for a in actions if isinstance(a, Reduce) for u in a.units]
        assert sorted(reduced) == list(range(n)), actions  # every unit, once
        waited = [u for a in actions if isinstance(a, WaitReduce) for u in a.units]
        assert sorted(waited) == list(range(n))
        gathers = [a.unit for a in actions if isinstance(a, Gather)]
        waits = [a.unit for a in actions if isinstance(a, WaitGather)]
        assert sorted(gathers) == sorted(waits)  # nothing left in flight
        assert all(st is UnitState.SHARDED for st in s.states)


def test_unit_without_gradient_is_still_reduced():
    s = make(3)
    s.begin_forward()
    for u in range(3):
        s.pre_forward(u)
        s.post_forward(u, True)
    s.end_forward(True)
    s.pre_backward(2)
    s.post_backward(2)
    s.pre_backward(1)
    s.post_backward(1)
    actions = s.end_backward()  # unit 0 never got a gradient (e.g. frozen input path)
    assert any(isinstance(a, Reduce) and 0 in a.units for a in actions)


def test_no_sync_frees_without_reducing():
    s = make(3)
    s.sync_grads = False
    actions = sequential_step(s, 3)
    assert not any(isinstance(a, (Reduce, WaitReduce)) for a in actions)
    assert all(st is UnitState.SHARDED for st in s.states)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "no_sync"])
def test_root_hook_after_a_unit_hook_gathers_nothing_again(sync):
    """The model's output is the last unit's output (the root's own layers skipped on this
    rank): the unit's gradient hook runs, then the root's, which moves the cursor back to the
    root. A unit that finished its backward is not gathered again, under no_sync too."""
    s = make(3, depth=2, root=0)
    s.sync_grads = sync
    out = s.begin_forward() + s.pre_forward(0)
    for u in (1, 2):
        out += s.pre_forward(u) + s.post_forward(u, True)
    out += s.end_forward(True)
    out += s.pre_backward(2) + s.pre_backward(0)  # the hooks of one tensor, in registration order
    out += s.post_backward(2) + s.pre_backward(1) + s.post_backward(1) + s.end_backward()
    gathers = [a.unit for a in out if isinstance(a, Gather) and a.for_backward]
    assert sorted(gathers) == [1, 2], gathers
    assert all(st is UnitState.SHARDED for st in s.states)


def test_eval_forward_frees_everything():
    s = make(3, reshard=False)
    s.begin_forward()
    for u in range(3):
        s.pre_forward(u)
        s.post_forward(u, False)
    s.end_forward(False)
    assert all(st is UnitState.SHARDED for st in s.states)


@pytest.mark.parametrize("max_inputs", [1, 2, 3])
def test_reduce_inputs_bounded(max_inputs):
    """At most K reduce-scatter inputs are alive; every bucket is released once, oldest first,
    before the next allocation; each is still waited at the end of backward."""
    n = 6
    s = Schedule([100] * n, [200] * n, ScheduleConfig(1, None, True, 0, max_inputs))
    for _ in range(2):
        actions = sequential_step(s, n)
        alive: list[int] = []
        released: list[int] = []
        for a in actions:
            if isinstance(a, Reduce):
                alive.append(a.bucket)
                assert len(alive) <= max_inputs, (alive, actions)
            elif isinstance(a, ReleaseReduce):
                assert alive and alive[0] == a.bucket  # oldest first
                alive.pop(0)
                released.append(a.bucket)
        buckets = [a.bucket for a in actions if isinstance(a, Reduce)]
        assert released == buckets[: len(buckets) - max_inputs]
        assert [a.bucket for a in actions if isinstance(a, WaitReduce)] == buckets


def make_keeping(n: int, keep: int, depth: int = 1, sizes=None, cap=None) -> Schedule:
    sizes = sizes or [100] * n
    return Schedule(list(sizes), [200] * n, ScheduleConfig(depth, cap, True, 0, keep_for_backward_bytes=keep))


def test_kept_units_are_not_gathered_again_for_backward():
    # [Note: units kept for backward]: 250 bytes keep units 3 and 2 (200), not 1 (300)
    s = make_keeping(4, keep=250)
    first = sequential_step(s, 4)
    assert sum(isinstance(a, Gather) and a.for_backward for a in first) == 4  # order not known yet
    second = sequential_step(s, 4)
    assert [a.unit for a in second if isinstance(a, Gather) and a.for_backward] == [1, 0]
    assert [a.unit for a in second if isinstance(a, Free)] == [0, 1, 3, 2, 1, 0]
    # the forward prefetch goes past the parked unit 2 into unit 3
    fwd = second[: second.index(WaitGather(3))]
    assert fwd.index(Gather(3)) < fwd.index(WaitGather(2))


@pytest.mark.parametrize("keep", [0, 100, 250, 10_000])
def test_keep_budget_bounds_held_units(keep):
    sizes = [100, 300, 100, 100, 200]
    kept_bytes = {0: 200, 100: 200, 250: 200, 10_000: 800}[keep]  # the last unit always

    def watch(sched: Schedule) -> None:
        parked = sched._parked
        assert len(set(sched.held_units()) - parked) <= 2 + 1, sched.states  # depth + 1 + reducing
        assert sum(sched.unit_bytes[u] for u in parked) + 200 <= max(kept_bytes, 200)

    s = make_keeping(5, keep=keep, sizes=sizes)
    for _ in range(3):
        actions = sequential_step(s, 5, watch=watch)
        assert all(st is UnitState.SHARDED for st in s.states)
    kept = {u for u in range(5) if not any(a == Gather(u, True) for a in actions)}
    assert sum(sizes[u] for u in kept) == kept_bytes, kept


def test_byte_cap_turns_keeping_off():
    s = make_keeping(4, keep=10_000, cap=250)
    sequential_step(s, 4)
    second = sequential_step(s, 4)
    assert [a.unit for a in second if isinstance(a, Gather) and a.for_backward] == [2, 1, 0]


def test_zero2_prefetches_in_forward():
    # reshard_after_forward=False keeps every unit: they are parked, so the forward prefetch
    # still runs one unit ahead (it stopped at the first kept unit before)
    s = make(4, depth=1, reshard=False)
    sequential_step(s, 4)
    second = sequential_step(s, 4)
    forward = second[: second.index(WaitGather(3)) + 1]
    assert forward == [
        Gather(0),
        Gather(1),
        WaitGather(0),
        Gather(2),
        WaitGather(1),
        Gather(3),
        WaitGather(2),
        WaitGather(3),
    ]
    assert not any(isinstance(a, Gather) for a in second[len(forward) :])


def test_second_forward_before_backward_keeps_kept_units():
    """A second forward before backward (a pipeline's warm-up micro-batches) frees what
    end_forward prefetched for backward and keeps the units kept for backward, parked."""
    s = make_keeping(3, keep=1000)
    sequential_step(s, 3)
    s.begin_forward()
    for u in range(3):
        s.pre_forward(u)
        s.post_forward(u, True)
    assert s._parked == {0, 1}
    frees = [a for a in s.begin_forward() if isinstance(a, Free)]  # e.g. a second micro-forward
    assert not frees and s._parked == {0, 1, 2}
    s = make_keeping(3, keep=100)  # only the last unit kept
    sequential_step(s, 3)
    s.begin_forward()
    for u in range(3):
        s.pre_forward(u)
        s.post_forward(u, True)
    s.end_forward(True)  # prefetches unit 1 for backward
    frees = [a for a in s.begin_forward() if isinstance(a, Free)]
    assert [a.unit for a in frees] == [1] and s._parked == {2}
