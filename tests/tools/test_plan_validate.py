"""The simulator's fluid clock, host work and HSDP all-reduce (overlap/step_model/simulate.py)
against hand-computed timelines, and benchmarks/plan_validate.py's summary of signed errors. The
calibration arithmetic is in tests/tools/test_plan_calibration.py. No process group; < 2 s."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from overlap import OverlapConfig
from overlap.step_model.cost import Link, Topology, UnitCost, ring_time_s
from overlap.step_model.simulate import Contention, simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
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
    from overlap.step_model.simulate import link_shares

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


def test_reduce_link_times_the_gradient_exchange():
    slow = Link("a2a", 0.0, 0.5)
    topo = Topology(2, 2, LINK, LINK, reduce_link=slow)
    assert ring_time_s("all_gather", TEN_MS_BYTES, topo) == pytest.approx(10 * MS)
    assert ring_time_s("reduce_scatter", TEN_MS_BYTES, topo) == pytest.approx(20 * MS)
    p = simulate([unit("u", 0.02, 0.04)], OverlapConfig(prefetch_depth=0), topo, backend="gloo")
    assert p.step_s == pytest.approx(0.080 + 0.010)  # the final reduction is exposed, 20 ms


def test_hsdp_all_reduce_follows_the_reduction():
    """HSDP 2 x 2: the reduced shard (half the unit's 20 MB) is all-reduced over the replicas
    after its reduce-scatter (10 ms): 2 ring passes of 10 MB at 1 GB/s over 2 replicas = 10 ms,
    on the replica group's own lane, waited for at the end of backward."""
    topo = Topology(2, 2, LINK, LINK, num_replicas=2)
    plain = simulate([unit("u", 0.02, 0.04)], OverlapConfig(prefetch_depth=0), TOPO, backend="gloo")
    p = simulate([unit("u", 0.02, 0.04)], OverlapConfig(prefetch_depth=0), topo, backend="gloo", record=True)
    assert p.step_s == pytest.approx(plain.step_s + 0.010)
    start, end = event(p, "comm2", "all-reduce [u]")
    assert start == pytest.approx(0.080) and end == pytest.approx(0.090)
    assert p.num_reduce_scatters == 1


def test_validate_config_checks_its_sizes():
    from overlap.tools.plan.world import w1

    assert pv.ValidateConfig().seq == w1().seq  # the default validates W1 itself
    other = w1(seq=80)
    assert other.seq == 80 and (other.layers, other.dim, other.batch) == (w1().layers, w1().dim, w1().batch)
    for bad in ({"seq": 0}, {"rounds": 0}, {"worlds": ()}, {"configs": ("no such config",)}):
        with pytest.raises(ValueError):
            pv.ValidateConfig(**bad)


def test_burst_charge_is_the_fluid_clocks():
    """One collective beside one layer: share x its stretched time while it ends within the work,
    the whole work slowed once it outlasts it; the two agree where they meet."""
    assert pv.burst_charge_ms(40.0, 5.0, 0.45, 1.5) == pytest.approx(0.45 * 7.5)
    assert pv.burst_charge_ms(40.0, 100.0, 0.2, 1.0) == pytest.approx(40.0 * 0.2 / 0.8)
    edge = 40.0 / 0.8  # in flight exactly as long as the slowed work
    assert pv.burst_charge_ms(40.0, edge - 1e-9, 0.2, 1.0) == pytest.approx(pv.burst_charge_ms(40.0, edge, 0.2, 1.0))
    from overlap.step_model.calibration import default_world_calibration

    bursts = [{"forward": 40.0, "forward_beside_gather": 43.0, "backward": 80.0, "backward_beside_reduce": 81.0,
               "gather": 5.0, "reduce": 6.0}]  # fmt: skip
    cal = replace(default_world_calibration(2, "gloo", None), compute_share_lost=0.4, comm_stretch=2.0)
    s = pv.burst_summary(bursts, [cal])
    assert s["forward_added"] == pytest.approx(3.0) and s["backward_added"] == pytest.approx(1.0)
    assert s["forward_charged"] == pytest.approx(4.0) and s["backward_charged"] == pytest.approx(4.8)
    text = pv.format_bursts(s)
    assert "forward +3.0 ms measured, +4.0 charged" in text and "backward +1.0 measured, +4.8 charged" in text


def test_summary_signs_errors_per_world():
    def rows(*pairs: tuple[float, float]) -> list[dict[str, Any]]:
        return [{"config": f"c{i}", "measured_ms": m, "predicted_ms": p, "defaults_ms": p, "spread_ms": [m, m]}
                for i, (m, p) in enumerate(pairs)]  # fmt: skip

    results = [
        {"world": "a", "rows": rows((100, 103), (100, 99))},
        {"world": "b", "rows": rows((200, 180), (100, 112))},
    ]
    s = pv.summarize(results)
    assert s["worlds"]["a"]["mean_signed"] == pytest.approx(0.01)
    assert s["worlds"]["b"]["mean_signed"] == pytest.approx(0.01)  # -10% and +12%
    assert s["worlds"]["b"]["max_abs"] == pytest.approx(0.12) and s["worlds"]["b"]["within_10"] == 1
    assert s["mean_abs"] == pytest.approx((0.03 + 0.01 + 0.10 + 0.12) / 4)
    assert list(s["targets"].values()) == [False, False, True]
    table = pv.format_table(results)
    assert "+12.0%" in table and "-10.0%" in table and "target: every config within 10%: NO" in table
    assert s["worlds"]["a"]["round_mean_signed"] == [] and "by round" not in table  # no rounds carried


def test_summary_pairs_each_round_with_its_own_calibration():
    """Round k's error is round k's prediction against round k's measured step, averaged over
    the configs; the medians' error is unchanged by it."""
    rows = [
        {"config": "c0", "measured_ms": 100, "predicted_ms": 100, "defaults_ms": 100, "spread_ms": [90, 110],
         "round_ms": [90, 100, 110], "predicted_per_round_ms": [99, 100, 99]},
        {"config": "c1", "measured_ms": 200, "predicted_ms": 200, "defaults_ms": 200, "spread_ms": [200, 200],
         "round_ms": [200, 200, 200], "predicted_per_round_ms": [220, 200, 180]},
    ]  # fmt: skip
    w = pv.summarize([{"world": "a", "rows": rows}])["worlds"]["a"]
    assert w["mean_signed"] == pytest.approx(0.0)
    assert w["round_mean_signed"] == pytest.approx([(0.10 + 0.10) / 2, 0.0, (-0.10 - 0.10) / 2])
    assert "by round -10.0% to +10.0%" in pv.format_table([{"world": "a", "rows": rows}])


def test_phase_errors_split_the_step_error():
    """[Note: the error by phase]: per phase, predicted - measured of the medians over every step,
    averaged over configs; they add up to the step's error when each phase is steady; rows
    without phases (older runs) give None and the table leaves the line out."""

    def row(measured, predicted):  # per round, per step: (forward, backward, optimizer) ms
        return {"config": "c", "measured_ms": sum(measured[0][0]), "predicted_ms": sum(predicted[0][0]),
                "defaults_ms": 1.0, "spread_ms": [1, 1], "phase_ms": measured, "phase_predicted_ms": predicted}  # fmt: skip

    a = row([[[30, 60, 10], [31, 61, 10]], [[29, 59, 10]]], [[[33, 50, 10]] * 2, [[33, 50, 10]]])
    b = row([[[40, 80, 20]] * 3], [[[40, 90, 18]] * 3])
    e = pv.phase_errors([a, b])
    assert e is not None
    assert e["forward"] == pytest.approx(((33 - 30) + 0) / 2)
    assert e["backward"] == pytest.approx(((50 - 60) + 10) / 2)
    assert e["optimizer"] == pytest.approx((0 - 2) / 2)
    assert e["step"] == pytest.approx((100 + 140) / 2)
    table = pv.format_table([{"world": "w", "rows": [a, b]}])
    assert "where the error lies" in table and "forward +1.5 (+1.2%)" in table and "optimizer -1.0" in table
    old = {k: v for k, v in a.items() if k not in ("phase_ms", "phase_predicted_ms")}
    assert pv.phase_errors([old, b]) is None
    assert "where the error lies" not in pv.format_table([{"world": "w", "rows": [old]}])


def test_segments_are_predicted_with_the_compute_beside_them():
    """[Note: compute beside each step]: the profiles before and after a step, averaged
    layer by layer, replace the calibration's compute; nothing else of it changes."""
    before = ([1.0, 2.0], [4.0, 4.0])
    after = ([3.0, 2.0], [2.0, 6.0])
    from overlap.step_model.calibration import Calibration, ComputeCosts, default_world_calibration

    assert pv.bracket(before, after) == ([2.0, 2.0], [3.0, 5.0])

    cal = replace(default_world_calibration(2, "gloo", None),
                  compute=ComputeCosts(unit_numel=10, forward_s=(9.0, 9.0), backward_s=(9.0, 9.0), optimizer_s=0.5))  # fmt: skip
    out = pv.with_compute(cal, pv.bracket(before, after))
    assert isinstance(out, Calibration) and out.compute is not None
    assert out.compute.forward_s == (2.0, 2.0) and out.compute.backward_s == (3.0, 5.0)
    assert replace(out, compute=cal.compute) == cal


def test_table_adds_the_one_calibration_summary_when_rows_carry_it():
    row = {"config": "c0", "measured_ms": 100, "predicted_ms": 101, "defaults_ms": 90, "spread_ms": [99, 101],
           "one_calibration_ms": 95}  # fmt: skip
    table = pv.format_table([{"world": "a", "rows": [row]}])
    assert "one cal" in table and "mean signed  -5.0%" in table and "mean signed  +1.0%" in table


def test_host_cpu_names_the_machine():
    """The validation's numbers belong to one machine: the JSON and the log name its CPU."""
    text = pv.host_cpu()
    if Path("/proc/cpuinfo").exists():
        assert text.endswith(" cores") and ("AVX" in text)
    else:
        assert text == ""


def test_repredict_recovers_a_known_host_factor_from_stored_steps():
    """benchmarks/plan_repredict.py: steps 'measured' as the model predicts them with the host
    work x1.5 re-predict at +0% with the factor fitted to one config, and below 0% as stored (1x)."""
    import plan_repredict as rp

    from overlap.step_model.calibration import ComputeCosts, HostCosts, predict_measured, with_compute

    link = Link("hand", alpha_s=1e-4, busbw_gbps=1.0)
    host = HostCosts(unit_bytes=4 * 1000, gather_issue_s=1e-3, regather_issue_s=1e-3, gather_wait_s=2e-3,
                     reduce_issue_s=3e-3, reduce_wait_s=2e-3)  # fmt: skip
    from overlap.step_model.calibration import Calibration

    cal = Calibration(source="hand", backend="gloo", num_ranks=2, gather_link=link, compute_share_lost=0.3,
                      comm_stretch=1.5, host={"none": host},
                      compute=ComputeCosts(unit_numel=1000, forward_s=(0.01,) * 4, backward_s=(0.02,) * 4, optimizer_s=0.005))  # fmt: skip
    beside = [[100.0, 140.0], [120.0, 110.0]]  # per round, per step: the compute total, ms
    rows = []
    for name, overrides in (
        ("default", {}),
        ("prefetch_depth=2", {"prefetch_depth": 2}),
        ("no reshard", {"reshard_after_forward": False}),
    ):
        truth = rp.with_host(cal, 1.5)
        steps = [[predict_measured(with_compute(truth, [ms / 3e3 / 4] * 4, [2 * ms / 3e3 / 4] * 4), OverlapConfig(**overrides)).step_s * 1e3
                  for ms in r] for r in beside]  # fmt: skip
        rows.append({"config": name, "overrides": overrides, "step_ms": steps, "compute_beside_ms": beside})
    res = rp.repredict({"world": "hand", "calibration_rounds": [cal.to_dict()] * 2, "rows": rows}, "prefetch_depth=2")
    assert res["host_scale"] == pytest.approx(1.5, rel=1e-2)
    assert set(res["fitted_errors"]) == {"default", "no reshard"}
    assert all(abs(e) < 2e-3 for e in res["fitted_errors"].values())
    assert all(e < -0.01 for e in res["errors"].values())  # 1x under-predicts steps taken at 1.5x
    with pytest.raises(ValueError, match="no config"):
        rp.repredict({"world": "hand", "calibration_rounds": [cal.to_dict()] * 2, "rows": rows}, "missing")
    old = [{k: v for k, v in r.items() if k != "compute_beside_ms"} for r in rows]
    with pytest.raises(ValueError, match="no compute stored beside"):
        rp.repredict({"world": "hand", "calibration_rounds": [cal.to_dict()] * 2, "rows": old})
    with pytest.raises(ValueError, match="2 rounds of steps, 1 calibration"):
        rp.repredict({"world": "hand", "calibration_rounds": [cal.to_dict()], "rows": rows})
