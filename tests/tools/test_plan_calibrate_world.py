"""`overlap plan --calibrate`'s measurements for real: one round in a 2-rank gloo world on
loopback, on a W1 of 8 narrow layers (the full W1's compute takes a minute on 2 busy cores; these
checks are about what is measured, not how long it takes: about 5 s). Timing is not asserted (a
loaded machine moves it); what every rank must agree on and what the model needs is."""

from __future__ import annotations

import pytest

from overlap import OverlapConfig
from overlap.step_model.calibration import Calibration, measured_units, median_calibration, predict_measured
from overlap.tools.plan.calibrate import (
    CODEC_OVERRIDES,
    CalibrateConfig,
    Rig,
    World,
    calibrate_round,
    format_calibration,
    set_up_rank,
    w1,
)
from overlap.tools.plan.measure import LINK_SIZES_BYTES

pytestmark = pytest.mark.slow  # spawns worlds or runs a command end to end: `-m 'not slow'` leaves it out

NARROW_W1 = {"dim": 64, "ff": 256, "heads": 4, "batch": 2, "seq": 32}
"""W1's 8 layers, each 1/64 of the full W1's size: every measurement runs, each in milliseconds."""


def calibrate_narrow_rank(rank: int, world_size: int, cfg: CalibrateConfig) -> Calibration | None:
    """`calibrate_rank` on the narrow W1 (`Rig.build`'s `bench`, as benchmarks/plan_validate.py
    passes its own)."""
    set_up_rank()
    rig = Rig.build(cfg.world, bench=w1(**NARROW_W1))
    cals = [calibrate_round(rig, cfg.profile_steps) for _ in range(cfg.rounds)]
    return median_calibration(cals) if rank == 0 else None


def test_one_calibration_round_measures_every_term(world2):
    cfg = CalibrateConfig(world=World.parse("loopback"), rounds=1, profile_steps=1)
    cal, other = world2.run(calibrate_narrow_rank, timeout_s=600, cfg=cfg)  # 2 gloo ranks, a thread each
    assert other is None and isinstance(cal, Calibration)
    assert cal.num_ranks == 2 and cal.backend == "gloo" and cal.level == "intra"
    # ranks of one host exchange through shared memory where it is built: priced as host work
    from overlap.kernels import cpu

    assert cal.shared_memory == (cpu.load_extension() is not None)
    if cal.shared_memory:
        assert measured_units(cal, OverlapConfig())[0].gather_op == "shm"
        assert "shared memory" in format_calibration(cal)
    for link in (cal.gather_link, cal.reduce_link):
        assert link is not None and link.busbw_gbps > 0 and link.alpha_s >= 0
    for op in ("all_gather", "all_to_all"):
        sizes = [size for size, _ in cal.measured["link_rows"][op]]
        assert sizes == list(LINK_SIZES_BYTES) and all(s > 0 for _, s in cal.measured["link_rows"][op])
    c = cal.compute
    assert c is not None and len(c.forward_s) == len(c.backward_s) == 8
    assert all(x > 0 for x in (*c.forward_s, *c.backward_s, c.optimizer_s))
    assert set(cal.host) == set(CODEC_OVERRIDES)
    assert all(h.unit_bytes == 4 * c.unit_numel for h in cal.host.values())
    assert 0.0 <= cal.compute_share_lost <= 0.95 and cal.comm_stretch >= 1.0
    step = predict_measured(cal, OverlapConfig()).step_s
    assert step >= sum(c.forward_s) + sum(c.backward_s) + c.optimizer_s  # communication costs, never gains
    with pytest.raises(ValueError):
        CalibrateConfig(rounds=0)
