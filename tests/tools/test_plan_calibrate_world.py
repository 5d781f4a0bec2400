"""`overlap plan --calibrate`'s measurements for real: one round in a 2-rank gloo world on
loopback (about 30 s on 2 busy cores). Timing is not asserted (a loaded machine moves it);
what every rank must agree on and what the model needs is."""

from __future__ import annotations

import pytest

from overlap import OverlapConfig
from overlap.step_model.calibration import Calibration, predict_measured
from overlap.tools.plan.calibrate import CODEC_OVERRIDES, CalibrateConfig, World, calibrate_rank
from overlap.tools.plan.measure import LINK_SIZES_BYTES
from overlap.tools.worlds.launch import run_local_world

pytestmark = pytest.mark.slow  # spawns worlds or runs a command end to end: `-m 'not slow'` leaves it out


def test_one_calibration_round_measures_every_term():
    cfg = CalibrateConfig(world=World.parse("loopback"), rounds=1, profile_steps=1)
    cal, other = run_local_world(calibrate_rank, 2, cfg, threads_per_rank=1, timeout_s=300, deadline_s=600)
    assert other is None and isinstance(cal, Calibration)
    assert cal.num_ranks == 2 and cal.backend == "gloo" and cal.level == "intra"
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
