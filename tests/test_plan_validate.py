"""benchmarks/plan_validate.py's calibration arithmetic, and the simulator's fluid clock and host
work (overlap/plan/simulate.py) against hand-computed timelines. No process group; < 2 s."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from overlap import OverlapConfig
from overlap.tools.plan.cost import Link, Topology, UnitCost, ring_time_s
from overlap.tools.plan.simulate import Contention, simulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import plan_validate as pv

MS = 1e-3
# alpha 0, 1 GB/s busbw: at 2 ranks a collective of S unsharded bytes takes S / 2 ns
LINK = Link("hand", alpha_s=0.0, busbw_gbps=1.0)
TOPO = Topology(2, 2, LINK, LINK)
TEN_MS_BYTES = 20_000_000  # 10 ms per gather or reduction


def unit(name: str, fwd_s: float = 0.0, bwd_s: float = 0.0, nbytes: int = TEN_MS_BYTES, **host: Any) -> UnitCost:
    return UnitCost(name, nbytes, nbytes, fwd_s, bwd_s, **host)


def event(p, lane: str, name: str) -> tuple[float, float]:
    """(start, end) of the step's first event `name` on `lane`."""
    return min((a, b) for lane_, n, a, b in p.events if lane_ == lane and n == name)


# ------------------------------------------------------------------ calibration arithmetic


def test_fit_link_recovers_alpha_and_busbw():
    truth = Topology(2, 2, Link("t", alpha_s=300e-6, busbw_gbps=0.08), Link("t", 300e-6, 0.08))
    rows = [(s, ring_time_s("all_gather", s, truth)) for s in (2**20, 4 * 2**20, 16 * 2**20)]
    fit = pv.fit_link("fit", rows, 2)
    assert fit.alpha_s == pytest.approx(300e-6) and fit.busbw_gbps == pytest.approx(0.08)
    # a negative intercept (noise at small sizes) clamps to alpha = 0, slope kept
    noisy = [(1e6, 0.0040), (2e6, 0.0100), (4e6, 0.0220)]
    assert pv.fit_link("n", noisy, 2).alpha_s == 0.0
    with pytest.raises(ValueError):
        pv.fit_link("flat", [(1e6, 0.01), (2e6, 0.01)], 2)
    with pytest.raises(ValueError):
        pv.fit_link("one", [(1e6, 0.01)], 2)


def test_contention_share():
    assert pv.contention_share(0.1, 0.2) == pytest.approx(0.5)  # half speed beside comm
    assert pv.contention_share(0.1, 0.125) == pytest.approx(0.2)
    assert pv.contention_share(0.2, 0.1) == 0.0  # faster beside comm: noise, no negative share
    assert pv.contention_share(0.01, 10.0) == 0.95


def test_fluid_queue_by_hand():
    assert pv.fluid_queue_s([10, 30], 2, 2.0) == pytest.approx(30)  # independent lanes
    assert pv.fluid_queue_s([10, 30], 2, 1.0) == pytest.approx(40)  # one shared wire
    # the first issued at full speed, the second at the remaining 0.6: 6 done by 10, 24 alone
    assert pv.fluid_queue_s([10, 30], 2, 1.6) == pytest.approx(34)
    # 1.5: second at 0.5 beside the first; it then leads, the next at 0.5 behind it; ...
    assert pv.fluid_queue_s([10] * 4, 2, 1.5) == pytest.approx(10 + 5 + 7.5 + 6.25)
    assert pv.fluid_queue_s([10, 10, 10], 1, 2.0) == pytest.approx(30)  # one lane: in turn


def test_concurrent_throughput_inverts_the_queue():
    assert pv.concurrent_throughput([10, 30], 30) == 2.0
    assert pv.concurrent_throughput([30, 10], 40) == pytest.approx(1.0)
    assert pv.concurrent_throughput([10, 30], 34) == pytest.approx(1.6)
    assert pv.concurrent_throughput([10] * 4, 28.75) == pytest.approx(1.5)
    assert pv.concurrent_throughput([10, 30], 60) == 1.0  # slower than sharing: clamped
    assert pv.concurrent_throughput([10, 30], 25) == 2.0  # faster than independent: clamped
    with pytest.raises(ValueError):
        pv.concurrent_throughput([0.0, 1.0], 1.0)


@pytest.mark.parametrize("throughput", [1.0, 1.3, 1.7, 2.0])
def test_fluid_queue_agrees_with_the_simulator(throughput):
    """Four gathers of 10, 30, 10, 30 ms issued at once (prefetch 3, no compute, gloo): the
    simulator's last wait ends when `fluid_queue_s` says the batch is done."""
    sizes = [1, 3, 1, 3]
    units = [unit(f"u{i}", nbytes=k * TEN_MS_BYTES) for i, k in enumerate(sizes)]
    p = simulate(units, OverlapConfig(prefetch_depth=3), TOPO, backend="gloo", record=True,
                 contention=Contention(concurrent_throughput=throughput))  # fmt: skip
    expected = pv.fluid_queue_s([10 * k * MS for k in sizes], 2, throughput)
    assert event(p, "wait", "gather u3")[1] == pytest.approx(expected)


def _cal(scale: float) -> pv.Calibration:
    host = pv.HostCosts(gather_issue_s=1e-3 * scale, regather_issue_s=0.5e-3 * scale, gather_wait_s=2e-3 * scale,
                        reduce_issue_s=3e-3 * scale, reduce_wait_s=4e-3 * scale)  # fmt: skip
    link = Link("l", 1e-4 * scale, 1.0 * scale)
    return pv.Calibration(
        link="loopback", world_size=2, layer_numel=1_000_000,
        gather_link=link, reduce_link=link,
        forward_s=[0.01 * scale] * 4, backward_s=[0.02 * scale] * 4, optimizer_s=0.005 * scale,
        host={"none": host, "int8/int8": host},
        cpu_contention=0.1 * scale, comm_stretch=1.0 + 0.1 * scale, concurrent_throughput=1.0 + 0.1 * scale,
        contention_ms=(1.0 * scale, 2.0, 3.0, 4.0), concurrency_ms=(1.0, 2.0 * scale, 3.0),
    )  # fmt: skip


def test_median_calibration_takes_medians_field_by_field():
    cal = pv.median_calibration([_cal(1.0), _cal(3.0), _cal(2.0)])
    two = _cal(2.0)
    assert cal.forward_s == two.forward_s and cal.optimizer_s == two.optimizer_s
    assert cal.gather_link.alpha_s == two.gather_link.alpha_s
    assert cal.gather_link.busbw_gbps == two.gather_link.busbw_gbps
    assert cal.host == two.host
    assert cal.cpu_contention == two.cpu_contention and cal.contention_ms == two.contention_ms
    assert isinstance(cal.contention_ms, tuple)
    with pytest.raises(ValueError):
        pv.median_calibration([])


def test_build_units_merges_layers_and_scales_host_work():
    cal = _cal(1.0)
    table = pv.configs(cal.layer_numel)
    plain = pv.build_units(cal, table["default"], host_aware=True)
    assert len(plain) == 4 and plain[0].param_bytes == 4 * cal.layer_numel
    assert plain[0].gather_wait_host_s == pytest.approx(2e-3)
    merged = pv.build_units(cal, table["2 layers/unit"], host_aware=True)
    assert len(merged) == 2 and merged[0].forward_s == pytest.approx(0.02)
    assert merged[0].reduce_issue_host_s == pytest.approx(6e-3)  # two layers' packing
    int8 = pv.build_units(cal, table["int8 params+grads, EF"], host_aware=True)[0]
    assert int8.gather_wire_bytes is not None and int8.gather_wire_bytes < int8.param_bytes / 3
    bare = pv.build_units(cal, table["default"], host_aware=False)[0]
    assert bare.gather_wait_host_s == bare.reduce_issue_host_s == 0.0
    for overrides in table.values():  # every validated config predicts, both models
        assert pv.predict_ms(cal, overrides, True) > pv.predict_ms(cal, overrides, False) * 0.5 > 0


# ------------------------------------------------------------------ the fluid clock


def test_defaults_are_the_plain_lane_model():
    units = [unit(f"u{i}", 0.004, 0.008) for i in range(5)]
    for backend in ("gloo", "nccl"):
        for depth in (0, 1, 2):
            cfg = OverlapConfig(prefetch_depth=depth)
            a = simulate(units, cfg, TOPO, backend=backend)
            b = simulate(units, cfg, TOPO, backend=backend, contention=Contention())
            assert a.step_s == pytest.approx(b.step_s) and a.exposed_s == pytest.approx(b.exposed_s)


def test_host_work_lands_on_the_training_thread():
    """One unit, no prefetch: gather 10 ms exposed, forward 20, backward 40, reduce 10 exposed;
    host work at each point adds to the step where the runtime does it."""
    cfg = OverlapConfig(prefetch_depth=0)
    bare = simulate([unit("u", 0.020, 0.040)], cfg, TOPO, backend="gloo")
    assert bare.step_s == pytest.approx(0.080)
    host = {"gather_issue_host_s": 1 * MS, "gather_wait_host_s": 2 * MS, "reduce_issue_host_s": 3 * MS,
            "reduce_wait_host_s": 4 * MS}  # fmt: skip
    p = simulate([unit("u", 0.020, 0.040, **host)], cfg, TOPO, backend="gloo", record=True)
    assert p.step_s == pytest.approx(0.080 + 0.010) and p.host_s == pytest.approx(0.010)
    assert event(p, "host", "copy-out u") == pytest.approx((11 * MS, 13 * MS))  # after the wait
    assert event(p, "comm0", "gather u") == pytest.approx((1 * MS, 11 * MS))  # after its issue


def test_backward_regather_has_its_own_issue_cost():
    units = [unit(f"u{i}", 0.02, 0.04, gather_issue_host_s=2 * MS, backward_gather_issue_host_s=0.0) for i in range(3)]
    zero3 = OverlapConfig(prefetch_depth=0, keep_for_backward_bytes=0)  # units 1 and 0 re-gathered
    cheap = simulate(units, zero3, TOPO, backend="gloo")
    units = [unit(f"u{i}", 0.02, 0.04, gather_issue_host_s=2 * MS) for i in range(3)]
    full = simulate(units, zero3, TOPO, backend="gloo")
    assert full.step_s - cheap.step_s == pytest.approx(2 * 2 * MS)  # units 1 and 0 re-gather


@pytest.mark.parametrize(("throughput", "b_done_ms"), [(None, 10.0), (2.0, 10.0), (1.5, 15.0), (1.0, 20.0)])
def test_a_shared_link_serves_collectives_in_issue_order(throughput, b_done_ms):
    """Two 10 ms gathers issued together on gloo's two lanes: the first issued runs at full
    speed; the second gets what the link has left (throughput - 1), then all of it."""
    units = [unit("a"), unit("b")]
    p = simulate(units, OverlapConfig(prefetch_depth=1), TOPO, backend="gloo", record=True,
                 contention=Contention(concurrent_throughput=throughput))  # fmt: skip
    assert event(p, "comm0", "gather a")[1] == pytest.approx(10 * MS)
    assert event(p, "comm1", "gather b")[1] == pytest.approx(b_done_ms * MS)


@pytest.mark.parametrize(("throughput", "b_done_ms"), [(None, 10.0), (1.5, 30.0)])
def test_a_shared_link_completes_in_issue_order(throughput, b_done_ms):
    """Gather a (30 ms) issued before gather b (10 ms): on a shared link b's bytes are through
    at 20 ms (half speed beside a) but it completes with a, at 30 ms; independent lanes: 10."""
    units = [unit("a", nbytes=3 * TEN_MS_BYTES), unit("b")]
    p = simulate(units, OverlapConfig(prefetch_depth=1), TOPO, backend="gloo", record=True,
                 contention=Contention(concurrent_throughput=throughput))  # fmt: skip
    assert event(p, "comm1", "gather b")[1] == pytest.approx(b_done_ms * MS)
    assert event(p, "comm0", "gather a")[1] == pytest.approx(30 * MS)


def test_link_shares():
    from overlap.tools.plan.simulate import link_shares

    assert link_shares(2, None) == [1.0, 1.0]
    assert link_shares(3, 1.5) == [1.0, 0.5, 0.0]
    assert link_shares(2, 2.5) == [1.0, 1.0]
    assert link_shares(0, 1.0) == []


@pytest.mark.parametrize(
    ("share", "stretch", "end_ms"),
    [
        (0.0, 1.0, 30.0),  # no contention: forward of a from 10 to 30
        (0.5, 1.0, 35.0),  # gather b in flight 10..20: the thread does 5 ms there, 15 after
        (0.5, 2.0, 40.0),  # b stretched to 10..30; the thread does 10 ms there, 10 after
    ],
)
def test_compute_and_comm_slow_each_other(share, stretch, end_ms):
    """nccl (one lane): gather a 0..10 (waited), gather b queued behind it; a's 20 ms forward
    runs beside b's gather."""
    units = [unit("a", fwd_s=0.020), unit("b", fwd_s=0.001)]
    p = simulate(units, OverlapConfig(prefetch_depth=1), TOPO, backend="nccl", record=True,
                 contention=Contention(compute_share_lost=share, comm_stretch=stretch))  # fmt: skip
    start, end = event(p, "compute", "forward a")
    assert start == pytest.approx(10 * MS) and end == pytest.approx(end_ms * MS)


def test_contention_arguments_are_checked():
    with pytest.raises(ValueError):
        Contention(compute_share_lost=1.0)
    with pytest.raises(ValueError):
        Contention(comm_stretch=0.5)
    with pytest.raises(ValueError):
        Contention(concurrent_throughput=0.0)
    with pytest.raises(ValueError, match="not both"):
        simulate([unit("u")], OverlapConfig(), TOPO, cpu_contention=0.5, contention=Contention())


def test_reduce_link_times_the_gradient_exchange():
    slow = Link("a2a", 0.0, 0.5)
    topo = Topology(2, 2, LINK, LINK, reduce_link=slow)
    assert ring_time_s("all_gather", TEN_MS_BYTES, topo) == pytest.approx(10 * MS)
    assert ring_time_s("reduce_scatter", TEN_MS_BYTES, topo) == pytest.approx(20 * MS)
    p = simulate([unit("u", 0.02, 0.04)], OverlapConfig(prefetch_depth=0), topo, backend="gloo")
    assert p.step_s == pytest.approx(0.080 + 0.010)  # the final reduction is exposed, 20 ms
