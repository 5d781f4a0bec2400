"""Planner: the cost model's arithmetic by hand, and the simulator's invariants (it replays the
runtime's own schedule, so counts and memory must match what the schedule allows)."""

from __future__ import annotations

import pytest

from overlap import OverlapConfig
from overlap.step_model.cost import LINKS, Link, Topology, UnitCost, flops_compute, ring_time_s
from overlap.step_model.simulate import simulate

LINK = Link("test", alpha_s=1e-5, busbw_gbps=10.0)


def test_ring_times_by_hand():
    topo = Topology(4, 8, LINK, LINKS["ndr400"])
    # all-gather of 1 GB over 4 ranks: 3 steps of 10 us + 3/4 * 1e9 B / 1e10 B/s = 75 ms
    assert ring_time_s("all_gather", 1e9, topo) == pytest.approx(3e-5 + 0.075)
    assert ring_time_s("reduce_scatter", 1e9, topo) == pytest.approx(3e-5 + 0.075)
    assert ring_time_s("all_reduce", 1e9, topo) == pytest.approx(2 * (3e-5 + 0.075))
    assert ring_time_s("all_gather", 1e9, Topology(1, 8, LINK, LINK)) == 0.0
    # 16 ranks on 8-rank nodes: the inter-node link bounds the ring
    big = Topology(16, 8, LINK, LINKS["ndr400"])
    assert ring_time_s("all_gather", 1e9, big) == pytest.approx(15 * 15e-6 + 15 / 16 * 1e9 / 45e9)
    with pytest.raises(ValueError):
        ring_time_s("broadcast", 1.0, topo)


def test_flops_compute():
    fwd, bwd = flops_compute(numel=1_000_000, tokens=1000, tflops=1.0)
    assert fwd == pytest.approx(2e9 / 1e12) and bwd == pytest.approx(2 * fwd)


def units(n: int = 6, fwd: float = 0.01, nbytes: int = 10_000_000) -> list[UnitCost]:
    return [UnitCost(f"u{i}", nbytes, nbytes, fwd, 2 * fwd) for i in range(n)]


TOPO = Topology(2, 2, LINK, LINK)


def test_no_comm_hidden_without_prefetch_and_all_hidden_with_it():
    t_gather = ring_time_s("all_gather", 10_000_000, TOPO)
    none = simulate(units(), OverlapConfig(prefetch_depth=0), TOPO)
    assert none.exposed_s >= 6 * t_gather  # every forward gather is exposed at least
    deep = simulate(units(fwd=0.05), OverlapConfig(prefetch_depth=2), TOPO, backend="gloo")
    # compute per unit (50 ms) dwarfs a gather (~0.5 ms): only the first gather and the last
    # reduce-scatter remain exposed
    t_reduce = ring_time_s("reduce_scatter", 10_000_000, TOPO)
    assert deep.exposed_s == pytest.approx(t_gather + t_reduce, rel=0.05)
    assert deep.step_s == pytest.approx(deep.compute_s + deep.exposed_s)


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize(("reshard", "keep"), [(True, 0), (True, 25_000_000), (True, None), (False, 0)])
def test_counts_and_memory_follow_the_schedule(depth, reshard, keep):
    n = 6
    config = OverlapConfig(prefetch_depth=depth, reshard_after_forward=reshard)
    if keep is not None:  # None: the default (128 MiB keeps all six 10 MB units)
        config = config.replace(keep_for_backward_bytes=keep)
    p = simulate(units(n), config, TOPO, record=True)
    # ZeRO-3 keeps the last unit, and more within keep_for_backward_bytes
    kept = min(n, max(1, config.keep_for_backward_bytes // 10_000_000))
    assert p.num_allgathers == (2 * n - kept if reshard else n)
    assert p.num_reduce_scatters == n
    if reshard:
        assert p.peak_unsharded_units <= depth + kept
    # compute is serial and never overlaps itself; every wait ends when its collective does
    compute = sorted((a, b) for lane, _, a, b in p.events if lane == "compute")
    assert all(b0 <= a1 + 1e-12 for (_, b0), (a1, _) in zip(compute, compute[1:]))


def test_the_step_splits_into_forward_backward_and_optimizer():
    opt_s = 0.003
    for depth in (0, 2):
        p = simulate(units(fwd=0.02), OverlapConfig(prefetch_depth=depth), TOPO, optimizer_s=opt_s, record=True)
        assert p.forward_s + p.backward_s + opt_s == pytest.approx(p.step_s)
        # the forward ends after the last forward compute and before the first backward compute
        fwd_end = max(b for lane, name, _, b in p.events if lane == "compute" and name.startswith("forward"))
        bwd_start = min(a for lane, name, a, _ in p.events if lane == "compute" and name.startswith("backward"))
        assert fwd_end <= p.forward_s + 1e-12 <= bwd_start + 1e-12
        assert p.forward_s >= 6 * 0.02 and p.backward_s >= 6 * 0.04
    # without prefetch every forward gather is exposed in the forward: it is longer
    none = simulate(units(fwd=0.02), OverlapConfig(prefetch_depth=0), TOPO)
    deep = simulate(units(fwd=0.02), OverlapConfig(prefetch_depth=2), TOPO)
    assert none.forward_s > deep.forward_s + 4 * ring_time_s("all_gather", 10_000_000, TOPO)


def test_byte_cap_bounds_memory():
    cap = 25_000_000  # two and a half units
    p = simulate(units(6), OverlapConfig(prefetch_depth=4, max_inflight_allgather_bytes=cap), TOPO)
    assert p.peak_unsharded_bytes <= cap


def test_one_nccl_lane_queues_reduce_behind_gathers():
    one = simulate(units(6, fwd=0.0001), OverlapConfig(prefetch_depth=2), TOPO, backend="nccl")
    two = simulate(units(6, fwd=0.0001), OverlapConfig(prefetch_depth=2), TOPO, backend="gloo")
    assert one.step_s > two.step_s  # comm-bound: a second lane finishes sooner
