"""Trace files from a real run, and the report's arithmetic on a synthetic trace."""

from __future__ import annotations

import json

import pytest
import torch

import overlap
from models import batch, loss_of, tiny_lm
from overlap.report import format_summary, load_events, plot_timeline, summarize, union_ms
from overlap.trace import LANES


def test_union_counts_overlaps_once():
    assert union_ms([]) == 0.0
    assert union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == pytest.approx(2.5)
    assert union_ms([(0, 4000), (1000, 2000)]) == pytest.approx(4.0)


def _x(name, tid, ts_ms, dur_ms, step=1, **args):
    return {"name": name, "ph": "X", "pid": 0, "tid": tid, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3,
            "args": {"step": step, **args}}


def test_summary_arithmetic_on_synthetic_trace(tmp_path):
    c, g, r, w = (LANES.index(n) for n in ("compute", "all-gather", "reduce-scatter", "wait"))
    events = [
        _x("forward unit1", c, 0, 10),
        _x("unit2", g, 2, 10),  # gather 2..12, needed at 10: 2 ms exposed
        _x("wait gather unit2", w, 10, 2),
        _x("forward unit2", c, 12, 10),
        _x("backward unit2", c, 22, 10),
        _x("bucket0 [unit2]", r, 32, 6, step=2, issued_step=1),  # completes in the next step
        _x("wait reduce bucket0 [unit2]", w, 32, 6),
        _x("backward unit1", c, 40, 1, step=2),  # another step: ignored
    ]
    (tmp_path / "trace_rank0.json").write_text(json.dumps({"traceEvents": events}))
    loaded = load_events([tmp_path])
    (s,) = summarize(loaded, step=1)
    assert s.comm_busy_ms == pytest.approx(16.0)  # 10 gather + 6 reduce
    assert s.exposed_ms == pytest.approx(8.0)
    assert s.hidden_ms == pytest.approx(8.0) and s.efficiency == pytest.approx(0.5)
    assert s.compute_ms == pytest.approx(30.0)  # 0..10, 12..22, 22..32
    assert s.step_ms == pytest.approx(38.0)
    assert s.waits_ms["wait reduce bucket0 [unit2]"] == pytest.approx(6.0)
    assert "50.0%" in format_summary([s])


def traced_steps(rank: int, world: int, out: str) -> dict:
    model = overlap.wrap(tiny_lm(), trace_dir=out)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss_of(model(batch(model, rank, step))).backward()
        opt.step()
        opt.zero_grad()
    return {}


def test_real_trace_has_every_lane_and_draws(world2, tmp_path):
    world2.run(traced_steps, out=str(tmp_path))
    files = sorted(p.name for p in tmp_path.glob("trace_rank*.json"))
    assert files == ["trace_rank0.json", "trace_rank1.json"]
    events = load_events([tmp_path])
    for rank in (0, 1):
        lanes = {LANES[e["tid"]] for e in events if e["pid"] == rank}
        assert lanes == set(LANES), (rank, lanes)
        forwards = [e for e in events if e["pid"] == rank and e["name"].startswith("forward ") and e["args"]["step"] == 1]
        assert len(forwards) == 4  # one per block; the root unit spans the step and is not drawn
    summaries = summarize(events)
    assert [s.rank for s in summaries] == [0, 1]
    assert all(0.0 <= s.efficiency <= 1.0 and s.comm_busy_ms > 0 for s in summaries)
    pytest.importorskip("matplotlib", reason="optional extra `plot`; CI installs it")
    png = plot_timeline(events, summaries[0].step, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
