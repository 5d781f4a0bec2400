"""Trace files from a real run, and the report's arithmetic on a synthetic trace."""

from __future__ import annotations

import json

import pytest
from helpers.models import sgd_steps, tiny_lm

import overlap
from overlap.observe.report import format_summary, load_events, plot_timeline, summarize, union_ms
from overlap.observe.timing import Span
from overlap.observe.trace import LANES, TraceRecorder


def test_union_counts_overlaps_once():
    assert union_ms([]) == 0.0
    assert union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == pytest.approx(2.5)
    assert union_ms([(0, 4000), (1000, 2000)]) == pytest.approx(4.0)


def _x(name, tid, ts_ms, dur_ms, step=1, **args):
    return {
        "name": name,
        "ph": "X",
        "pid": 0,
        "tid": tid,
        "ts": ts_ms * 1e3,
        "dur": dur_ms * 1e3,
        "args": {"step": step, **args},
    }


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
    sgd_steps(overlap.wrap(tiny_lm(), trace_dir=out), rank)
    return {}


def test_real_trace_has_every_lane_and_draws(world2, tmp_path):
    world2.run(traced_steps, out=str(tmp_path))
    files = sorted(p.name for p in tmp_path.glob("trace_rank*.json"))
    assert files == ["trace_rank0.json", "trace_rank1.json"]
    events = load_events([tmp_path])
    for rank in (0, 1):
        lanes = {LANES[e["tid"]] for e in events if e["pid"] == rank}
        assert lanes == set(LANES), (rank, lanes)
        forwards = [
            e for e in events if e["pid"] == rank and e["name"].startswith("forward ") and e["args"]["step"] == 1
        ]
        assert len(forwards) == 4  # one per block; the root unit spans the step and is not drawn
    summaries = summarize(events)
    assert [s.rank for s in summaries] == [0, 1]
    assert all(0.0 <= s.efficiency <= 1.0 and s.comm_busy_ms > 0 for s in summaries)
    pytest.importorskip("matplotlib", reason="optional extra `plot`; CI installs it")
    png = plot_timeline(events, summaries[0].step, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_device_spans_land_in_the_step_they_were_recorded_in(tmp_path):
    """CUDA: step 0's communication is harvested at the end of step 1; the file keeps it in
    step 0, where the report finds it (collectives by issue step, waits by step)."""
    ms = 1_000_000
    rec = TraceRecorder(tmp_path, rank=0, max_steps=2)
    rec.span("compute", "backward unit1", 0, 30 * ms)
    rec.finish_step()  # step 0 ends: nothing from the device yet
    rec.span("compute", "backward unit1", 40 * ms, 70 * ms)
    rec.record_spans(
        [
            Span("collective", "gather", "unit1", 0, 2 * ms, 10.0, 100, True),
            Span("collective", "reduce", "bucket0 [unit1]", 0, 20 * ms, 6.0, 50, True),
            Span("collective", "all_reduce", "bucket0 [unit1]", 0, 26 * ms, 2.0, 50, True),
            Span("stall", "gather", "unit1", 0, 10 * ms, 2.0, 0, True),
            Span("step", "step", "step", 0, 0, 30.0, 0, True),  # not drawn
        ]
    )
    rec.finish_step()
    events = load_events([tmp_path])
    names = {(e["args"]["step"], LANES[e["tid"]], e["name"]) for e in events}
    assert names == {
        (0, "compute", "backward unit1"),
        (1, "compute", "backward unit1"),
        (0, "all-gather", "unit1"),
        (0, "reduce-scatter", "bucket0 [unit1]"),
        (0, "reduce-scatter", "all-reduce bucket0 [unit1]"),
        (0, "wait", "wait gather unit1"),
    }
    (s,) = summarize(events, step=0)
    assert s.comm_busy_ms == pytest.approx(18.0)  # 2..12 gather, 20..28 reduce + all-reduce
    assert s.exposed_ms == pytest.approx(2.0) and s.waits_ms == {"wait gather unit1": pytest.approx(2.0)}
    # a span later than the file keeps (max_steps) is dropped, not misfiled
    rec.record_spans([Span("stall", "gather", "unit1", 0, 0, 1.0)])
    rec.finish_step()
    assert all(e["args"]["step"] >= 1 for e in load_events([tmp_path]))
