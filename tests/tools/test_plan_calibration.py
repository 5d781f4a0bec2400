"""The calibration (overlap/step_model/calibration.py): its arithmetic by hand, its file, and that
`overlap plan`, `overlap tune`'s pruning and benchmarks/plan_validate.py predict through the same
model ([Note: one model]). No process group; a few seconds."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from overlap import OverlapConfig
from overlap.step_model import calibration as calib
from overlap.step_model.calibration import (
    Calibration,
    ComputeCosts,
    HostCosts,
    concurrent_throughput,
    contention_share,
    fit_link,
    fluid_queue_s,
    measured_units,
    median_calibration,
    predict_measured,
)
from overlap.step_model.cost import Link, Topology, ring_time_s
from overlap.tools.plan import trace_links
from overlap.tools.plan.calibrate import World
from overlap.tools.worlds.link import LinkSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_validate as pv

LAYER_NUMEL = 1_000_000


def test_fit_link_recovers_alpha_and_busbw():
    truth = Topology(2, 2, Link("t", alpha_s=300e-6, busbw_gbps=0.08), Link("t", 300e-6, 0.08))
    rows = [(s, ring_time_s("all_gather", s, truth)) for s in (2**20, 4 * 2**20, 16 * 2**20)]
    fit = fit_link("fit", rows, 2)
    assert fit.alpha_s == pytest.approx(300e-6) and fit.busbw_gbps == pytest.approx(0.08)
    # all-reduce: two ring passes, recovered as the same link
    four = Topology(4, 4, Link("t", 100e-6, 0.5), Link("t", 100e-6, 0.5))
    rows = [(s, ring_time_s("all_reduce", s, four)) for s in (2**20, 8 * 2**20)]
    fit = fit_link("ar", rows, 4, "all_reduce")
    assert fit.alpha_s == pytest.approx(100e-6) and fit.busbw_gbps == pytest.approx(0.5)
    # a negative intercept (noise at small sizes) clamps to alpha = 0, slope kept
    noisy = [(1e6, 0.0040), (2e6, 0.0100), (4e6, 0.0220)]
    assert fit_link("n", noisy, 2).alpha_s == 0.0
    for bad in ([(1e6, 0.01), (2e6, 0.01)], [(1e6, 0.01)], [(1e6, 0.01), (1e6, 0.02)]):
        with pytest.raises(ValueError):
            fit_link("bad", bad, 2)
    with pytest.raises(ValueError):
        fit_link("op", [(1e6, 0.01), (2e6, 0.02)], 2, "broadcast")


def test_contention_share():
    assert contention_share(0.1, 0.2) == pytest.approx(0.5)  # half speed beside comm
    assert contention_share(0.1, 0.125) == pytest.approx(0.2)
    assert contention_share(0.2, 0.1) == 0.0  # faster beside comm: noise, no negative share
    assert contention_share(0.01, 10.0) == 0.95


def test_fluid_queue_by_hand():
    assert fluid_queue_s([10, 30], 2, 2.0) == pytest.approx(30)  # independent lanes
    assert fluid_queue_s([10, 30], 2, 1.0) == pytest.approx(40)  # one shared wire
    # the first issued at full speed, the second at the remaining 0.6: 6 done by 10, 24 alone
    assert fluid_queue_s([10, 30], 2, 1.6) == pytest.approx(34)
    # 1.5: second at 0.5 beside the first; it then leads, the next at 0.5 behind it; ...
    assert fluid_queue_s([10] * 4, 2, 1.5) == pytest.approx(10 + 5 + 7.5 + 6.25)
    assert fluid_queue_s([10, 10, 10], 1, 2.0) == pytest.approx(30)  # one lane: in turn


def test_concurrent_throughput_inverts_the_queue():
    assert concurrent_throughput([10, 30], 30) == 2.0
    assert concurrent_throughput([30, 10], 40) == pytest.approx(1.0)
    assert concurrent_throughput([10, 30], 34) == pytest.approx(1.6)
    assert concurrent_throughput([10] * 4, 28.75) == pytest.approx(1.5)
    assert concurrent_throughput([10, 30], 60) == 1.0  # slower than sharing: clamped
    assert concurrent_throughput([10, 30], 25) == 2.0  # faster than independent: clamped
    with pytest.raises(ValueError):
        concurrent_throughput([0.0, 1.0], 1.0)


def _cal(scale: float, backward: float = 0.02) -> Calibration:
    host = HostCosts(unit_bytes=4 * LAYER_NUMEL, gather_issue_s=1e-3 * scale, regather_issue_s=0.5e-3 * scale,
                     gather_wait_s=2e-3 * scale, reduce_issue_s=3e-3 * scale, reduce_wait_s=4e-3 * scale)  # fmt: skip
    link = Link("l", 1e-4 * scale, 1.0 * scale)
    return Calibration(
        source="hand", backend="gloo", num_ranks=2, gather_link=link, reduce_link=link,
        compute_share_lost=0.1 * scale, comm_stretch=1.0 + 0.1 * scale, concurrent_throughput=1.0 + 0.1 * scale,
        host={"none": host, "int8/int8": host},
        compute=ComputeCosts(unit_numel=LAYER_NUMEL, forward_s=(0.01 * scale,) * 4,
                             backward_s=(backward * scale,) * 4, optimizer_s=0.005 * scale, tokens=512),
        measured={"contention_ms": [1.0 * scale, 2.0]},
    )  # fmt: skip


def test_median_calibration_takes_medians_field_by_field():
    cal = median_calibration([_cal(1.0), _cal(3.0), _cal(2.0)])
    two = _cal(2.0)
    assert cal.compute == two.compute and isinstance(cal.compute.forward_s, tuple)
    assert cal.gather_link.alpha_s == two.gather_link.alpha_s
    assert cal.gather_link.busbw_gbps == two.gather_link.busbw_gbps
    assert cal.host == two.host
    assert cal.compute_share_lost == two.compute_share_lost and cal.comm_stretch == two.comm_stretch
    with pytest.raises(ValueError):
        median_calibration([])


def test_file_round_trip_and_errors(tmp_path):
    cal = _cal(1.0)
    back = Calibration.load(cal.save(tmp_path / "cal.json"))
    assert back == replace(cal, measured={"contention_ms": [1.0, 2.0]})
    assert predict_measured(back, OverlapConfig()).step_s == predict_measured(cal, OverlapConfig()).step_s
    with pytest.raises(ValueError, match="no such file"):
        Calibration.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"source": "x"}')
    with pytest.raises(ValueError, match="not a calibration"):
        Calibration.load(tmp_path / "bad.json")
    with pytest.raises(ValueError):
        replace(cal, compute_share_lost=1.0)
    with pytest.raises(ValueError):
        replace(cal, backend="mpi")


def test_solve_increasing_finds_the_crossing_and_stops_at_the_ends():
    from overlap.step_model.calibration import solve_increasing

    assert solve_increasing(lambda x: 3 * x, 1.5, 0.1, 10.0, log=True) == pytest.approx(0.5, rel=1e-2)
    assert solve_increasing(lambda x: x + 1, 2.5, 0.0, 4.0, log=False) == pytest.approx(1.5, rel=1e-2)
    assert solve_increasing(lambda x: x, 100.0, 0.5, 2.0, log=True) == 2.0  # beyond the range: its end
    assert solve_increasing(lambda x: x, 0.1, 0.5, 2.0, log=True) == 0.5


def test_units_merge_layers_and_scale_host_work():
    cal = _cal(1.0)
    table = pv.configs(LAYER_NUMEL)
    plain = measured_units(cal, OverlapConfig(**table["default"]))
    assert len(plain) == 4 and plain[0].param_bytes == 4 * LAYER_NUMEL
    assert plain[0].gather_wait_host_s == pytest.approx(2e-3)
    merged = measured_units(cal, OverlapConfig(**table["2 layers/unit"]))
    assert len(merged) == 2 and merged[0].forward_s == pytest.approx(0.02)
    assert merged[0].reduce_issue_host_s == pytest.approx(6e-3)  # two layers' packing
    int8 = measured_units(cal, OverlapConfig(**table["int8 params+grads, EF"]))[0]
    assert int8.gather_wire_bytes is not None and int8.gather_wire_bytes < int8.param_bytes / 3
    # a codec not measured is charged as uncompressed; no host costs at all: none charged
    assert cal.host_costs("bf16/None") == cal.host["none"]
    bare = measured_units(replace(cal, host={}), OverlapConfig())[0]
    assert bare.gather_wait_host_s == bare.reduce_issue_host_s == 0.0
    assert cal.compute.achieved_tflops() == pytest.approx(6 * LAYER_NUMEL * 4 * 512 / 0.12 / 1e12)
    # the wrapper's own cost is per unit, not per layer ([Note: hook cost] in hooks.py)
    hooked = replace(cal, compute=replace(cal.compute, hook_forward_s=1e-3, hook_backward_s=3e-3))
    assert measured_units(hooked, OverlapConfig())[0].backward_s == pytest.approx(0.023)
    two = measured_units(hooked, OverlapConfig(**table["2 layers/unit"]))
    assert two[0].forward_s == pytest.approx(0.021) and two[0].backward_s == pytest.approx(0.043)
    assert pv.predict_ms(hooked, {}) > pv.predict_ms(cal, {}) + 4 * (1 + 3) * 0.99
    for overrides in table.values():  # every validated config predicts, calibrated and not
        world = World.parse("loopback")
        assert pv.predict_ms(cal, overrides) > pv.predict_ms(pv.uncalibrated(cal, world), overrides) * 0.3 > 0


def test_world_parse():
    assert World.parse("loopback") == World("loopback", 2, 1)
    assert World.parse("1gbit") == World("1gbit", 2, 1)
    assert World.parse("loopback,4") == World.parse("4ranks") == World("loopback", 4, 1)
    assert World.parse("hsdp2x2") == World("loopback", 4, 2)
    assert World.parse("1gbit,200us,hsdp2x2") == World("1gbit,200us", 4, 2)
    with pytest.raises(ValueError):
        World.parse("hsdp4x1")  # shard groups of one rank


def test_defaults_for_a_world():
    gloo = calib.default_world_calibration(2, "gloo", None)
    assert gloo.backend == "gloo" and gloo.host and gloo.comm_stretch > 1
    wire = calib.default_world_calibration(2, "gloo", LinkSpec.parse("1gbit"))
    assert wire.level == "inter" and wire.gather_link.busbw_gbps == pytest.approx(
        0.125 * calib.EMULATED_LINK_EFFICIENCY
    )
    nccl = calib.default_world_calibration(8, "nccl", None)
    assert nccl.backend == "nccl" and not nccl.host and nccl.concurrent_throughput is None
    # ranks of one host through shared memory: its host work, replicas too; a wire or NCCL: none
    shm = calib.default_world_calibration(2, "gloo", None, num_replicas=2, shared_memory=True)
    assert (
        shm.shared_memory and shm.host["none"] == calib.SHM_DEFAULT_HOST and shm.replica_link.busbw_gbps == float("inf")
    )
    assert not gloo.shared_memory and gloo.host["none"] == calib.GLOO_DEFAULT_HOST
    assert not calib.default_world_calibration(2, "gloo", LinkSpec.parse("1gbit"), shared_memory=True).shared_memory
    assert not calib.default_world_calibration(8, "nccl", None, shared_memory=True).shared_memory


def test_shared_memory_is_known_before_any_group():
    """What `overlap tune` asks before it prices a local world: the setting, the device, the size."""
    from overlap.kernels import cpu
    from overlap.transport.shm import usable_here

    cpu_ = torch.device("cpu")
    assert not usable_here(cpu_, "off", 2) and not usable_here(cpu_, "auto", 1)
    assert not usable_here(torch.device("cuda"), "auto", 2)
    assert usable_here(cpu_, "auto", 4) == (cpu.load_extension() is not None)


def test_plan_tune_and_validate_share_the_model(monkeypatch, tmp_path):
    """Each tool's prediction goes through `Calibration.predict`, with the calibration given."""
    from overlap.tools.plan.command import plan
    from overlap.tools.tune.predict import ModelProfile, UnitProfile, predict

    calls: list[tuple[str, int]] = []
    original = Calibration.predict

    def spy(self, units, config, **kw):
        calls.append((self.source, len(units)))
        return original(self, units, config, **kw)

    monkeypatch.setattr(Calibration, "predict", spy)
    cal = _cal(1.0)
    pv.predict_ms(cal, {})
    assert calls == [("hand", 4)]
    # tune: a profile of the same four layers (backward = 2 x forward, as tune assumes) predicts
    # the same step as the calibrated model itself
    profile = ModelProfile(tuple(UnitProfile(f"layers.{i}", LAYER_NUMEL, 0.01) for i in range(4)), 0, 0.0,
                           step_s=0.12 + 2 * 0.005, param_dtype=torch.float32)  # fmt: skip
    tuned, _ = predict(profile, OverlapConfig(), 2, cal)
    assert calls[-1] == ("hand", 4)
    assert tuned.step_s == pytest.approx(predict_measured(cal, OverlapConfig()).step_s)
    # plan: with a calibration file, every estimate runs through it
    calls.clear()
    plan(model="llama-8b", num_gpus=16, search=False, scaling_gpus=(), calibration=str(cal.save(tmp_path / "cal.json")))
    assert calls and all(source == "hand, links only" for source, _ in calls)  # a gloo file on GPUs: links only


def test_links_from_a_trace(tmp_path):
    """Collective spans of two sizes (the fastest of each counts: the others queued) give the
    link back; one size alone keeps the base's latency."""
    import json

    truth = Topology(2, 2, Link("t", 50e-6, 2.0), Link("t", 50e-6, 2.0))

    def span(tid: int, name: str, nbytes: int, seconds: float) -> dict:
        return {"ph": "X", "tid": tid, "name": name, "ts": 0, "dur": seconds * 1e6, "args": {"bytes": nbytes}}

    events = []
    for nbytes in (8 * 2**20, 32 * 2**20):
        t = ring_time_s("all_gather", nbytes, truth)
        events += [span(1, "unit0", nbytes, t), span(1, "unit1", nbytes, 3 * t)]  # the second queued
    events.append(span(2, "bucket0", 16 * 2**20, 0.010))
    (tmp_path / "trace_rank0.json").write_text(json.dumps({"traceEvents": events}))
    base = calib.default_world_calibration(2, "nccl", None)
    cal = trace_links.from_trace(tmp_path, base)
    assert cal.gather_link.alpha_s == pytest.approx(50e-6) and cal.gather_link.busbw_gbps == pytest.approx(2.0)
    assert cal.reduce_link.alpha_s == base.gather_link.alpha_s
    assert ring_time_s("reduce_scatter", 16 * 2**20, cal.topology()) == pytest.approx(0.010)
    with pytest.raises(ValueError, match="no trace"):
        trace_links.from_trace(tmp_path / "empty", base)


def test_cli_plans_with_a_calibration_and_refuses_a_bad_file(tmp_path, capsys):
    from overlap.tools.cli import main

    inter = replace(calib.default_world_calibration(8, "nccl", None), source="a test file", level="inter",
                    gather_link=Link("slow", 20e-6, 5.0))  # fmt: skip
    path = inter.save(tmp_path / "cal.json")
    args = ["plan", "--model", "llama-8b", "--gpus", "16", "--no-search"]
    assert main([*args, "--calibration", str(path)]) == 0
    slow = capsys.readouterr().out
    assert "a test file" in slow and "inter-node link" in slow
    assert main(args) == 0
    preset = capsys.readouterr().out
    assert slow != preset  # the 5 GB/s link replaced ndr400 between nodes
    with pytest.raises(SystemExit, match="no such file"):
        main([*args, "--calibration", str(tmp_path / "missing.json")])


def test_gathers_are_timed_by_the_collective_that_carries_them():
    """gloo gathers an uncompressed unit of two ranks as a pair exchange, compressed units as
    an exchange and small shards through all-to-all: those units are timed by the all-to-all
    link; the rest by all-gather's."""
    assert calib.gather_op("gloo", 2, False, 12 * 2**20) == "all_to_all"
    assert calib.gather_op("gloo", 2, True, 3 * 2**20) == "all_to_all"  # int8: an exchange too
    assert calib.gather_op("gloo", 4, True, 3 * 2**20) == "all_to_all"
    assert calib.gather_op("gloo", 4, False, 12 * 2**20) == "all_gather"
    assert calib.gather_op("gloo", 4, False, 64 * 2**10) == "all_to_all"
    assert calib.gather_op("nccl", 2, False, 12 * 2**20) == "all_gather"
    slow_a2a = replace(_cal(1.0), reduce_link=Link("a2a", 0.0, 0.5), host={})
    plain = measured_units(slow_a2a, OverlapConfig())[0]
    int8 = measured_units(slow_a2a, OverlapConfig(param_compression="int8"))[0]
    topo = slow_a2a.topology()
    assert plain.gather_op == "all_to_all" and plain.gather_s(topo) == pytest.approx(
        ring_time_s("all_to_all", 4e6, topo)
    )
    assert int8.gather_op == "all_to_all" and int8.gather_s(topo) == pytest.approx(
        ring_time_s("all_to_all", 1e6 + 16 * 2**10, topo), rel=0.05
    )
    assert measured_units(replace(slow_a2a, num_ranks=4), OverlapConfig())[0].gather_op == "all_gather"


def test_compute_profile_takes_each_steps_slowest_rank():
    """[Note: slowest rank per step]: in each step the rank with the largest forward+backward
    sum gives all its layers; per layer, the median over steps."""
    from overlap.tools.plan.measure import slowest_per_step

    # 2 ranks x 3 steps x (2 forward layers, 2 backward layers)
    samples = torch.tensor([
        [[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0], [3.0, 1.0, 2.0, 2.0]],  # sums 6, 6, 8
        [[1.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 2.0], [1.0, 1.0, 2.0, 2.0]],  # sums 7, 5, 6
    ], dtype=torch.float64)  # fmt: skip
    fwd, bwd = slowest_per_step(samples, 2)
    # slowest: rank 1, rank 0, rank 0 -> forward [1,1,3] and [2,1,1], backward [2,2,2] twice
    assert fwd == [1.0, 1.0] and bwd == [2.0, 2.0]
    samples[1, 1, 0] = 9.0  # rank 1 is now the slowest in step 1 too: [1,2,2,2], [9,1,1,2], [3,1,2,2]
    assert slowest_per_step(samples, 2) == ([3.0, 1.0], [2.0, 2.0])
    assert slowest_per_step(samples[:1], 2) == ([1.0, 1.0], [2.0, 2.0])  # one rank: its own medians


def test_shared_memory_collectives_are_host_work(tmp_path):
    """[Note: shared-memory collectives]: where ranks share a host, uncompressed gathers and
    reductions are the post and pull on the training thread, no wire: their step is compute
    plus host work whatever the links and the contention; a codec's exchange stays on gloo."""
    from overlap.step_model.cost import SHARED_MEMORY
    from overlap.transport.shm_segments import MAX_RING_BYTES

    assert calib.gather_op("gloo", 2, False, 12 * 2**20, True) == "shm"
    assert calib.gather_op("gloo", 4, False, 12 * 2**20, True) == "shm"
    assert calib.gather_op("gloo", 2, True, 3 * 2**20, True) == "all_to_all"  # int8: gloo's exchange
    assert calib.gather_op("gloo", 4, False, MAX_RING_BYTES, True) == "all_gather"  # beyond the ring
    assert calib.gather_op("nccl", 2, False, 12 * 2**20, True) == "all_gather"
    assert calib.reduce_op("gloo", False, 12 * 2**20, True) == "shm"
    assert (
        calib.reduce_op("gloo", True, 3 * 2**20, True) == calib.reduce_op("gloo", False, 12 * 2**20) == "reduce_scatter"
    )
    assert ring_time_s("shm", 2**30, Topology(4, 4, Link("slow", 1.0, 1e-3), Link("slow", 1.0, 1e-3))) == 0.0

    shm = replace(_cal(1.0), shared_memory=True)
    unit = measured_units(shm, OverlapConfig())[0]
    assert unit.gather_op == unit.reduce_op == "shm" and unit.gather_s(shm.topology()) == 0.0
    step = predict_measured(shm, OverlapConfig())
    assert step.exposed_s == 0.0
    # no time on a wire, so neither the links nor the contention move it; host work does
    slow = replace(
        shm, gather_link=Link("slow", 1e-2, 1e-3), reduce_link=None, compute_share_lost=0.9, comm_stretch=5.0
    )
    assert predict_measured(slow, OverlapConfig()).step_s == pytest.approx(step.step_s)
    compute = sum(shm.compute.forward_s) + sum(shm.compute.backward_s) + shm.compute.optimizer_s
    assert step.step_s > compute + 4 * (1e-3 + 2e-3 + 3e-3 + 4e-3) * 0.99
    busy = replace(shm, host={k: h.scaled(2.0) for k, h in shm.host.items()})
    assert predict_measured(busy, OverlapConfig()).step_s > step.step_s
    # int8 on both: gloo carries the codecs' exchanges, so the link times them again
    int8 = OverlapConfig(param_compression="int8", grad_compression="int8", error_feedback=True)
    assert measured_units(shm, int8)[0].gather_op == "all_to_all"
    assert predict_measured(slow, int8).step_s > predict_measured(shm, int8).step_s * 1.5
    # HSDP replicas on one host: their all-reduce is shared memory too, and the file keeps it
    hsdp = replace(shm, num_replicas=2, replica_link=SHARED_MEMORY)
    back = Calibration.load(hsdp.save(tmp_path / "shm.json"))
    assert back.shared_memory and back.replica_link == SHARED_MEMORY
    assert predict_measured(back, OverlapConfig()).step_s == pytest.approx(step.step_s)
