"""Telemetry lines and alerts: each threshold fires on a synthetic step that crosses it, names
the step and the unit, and stays quiet on one that does not; a real run writes its JSONL."""

from __future__ import annotations

import json
import logging

import torch

import overlap
from models import batch, loss_of, tiny_lm
from overlap.monitor import Monitor
from overlap.stats import StepStats


def _step(step: int, **kw) -> StepStats:
    return StepStats(step=step, **kw)


def test_alerts_fire_and_name_step_and_unit(caplog):
    m = Monitor(0, torch.device("cpu"), alert_exposed_comm_share=0.3, alert_collective_slowdown=3.0,
                alert_step_gap_ms=500, alert_memory_bytes=1)
    caplog.set_level(logging.WARNING, logger="overlap")
    for i in range(6):  # steady collectives build the running median
        m.on_step(_step(i, step_ms=100, collective_ms={"unit3 (layers.2) gather": 10.0}))
    assert not [a for a in m.alerts if "gather" in a]
    m.alerts.clear()
    caplog.clear()
    m.on_step(
        _step(
            7,
            step_ms=100,
            gap_ms=900,
            allgather_wait_ms=40,
            unit_waits_ms={"unit3 (layers.2) gather": 35.0},
            collective_ms={"unit3 (layers.2) gather": 45.0},
        )
    )
    text = "\n".join(m.alerts)
    assert "step 7: exposed communication is 40%" in text and "unit3 (layers.2) gather" in text
    assert "step 7: 900 ms passed between" in text
    assert "step 7: unit3 (layers.2) gather took 45.0 ms, 4.5x its running median" in text
    assert "memory in use" in text  # threshold of 1 byte
    assert len(caplog.records) == 4


def test_quiet_when_below_thresholds():
    m = Monitor(0, torch.device("cpu"), alert_exposed_comm_share=0.5, alert_step_gap_ms=1000)
    m.on_step(_step(1, step_ms=100, allgather_wait_ms=10, gap_ms=20))
    assert m.alerts == []


def metrics_run(rank: int, world: int, path: str) -> dict:
    model = overlap.wrap(tiny_lm(), metrics_file=path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss_of(model(batch(model, rank, step))).backward()
        opt.step()
        opt.zero_grad()
    return {}


def test_metrics_file_has_one_line_per_step(world2, tmp_path):
    world2.run(metrics_run, path=str(tmp_path / "metrics_rank{rank}.jsonl"))
    for rank in (0, 1):
        lines = [json.loads(x) for x in (tmp_path / f"metrics_rank{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines] == [0, 1, 2]
        assert all(r["rank"] == rank and r["rss_bytes"] > 0 and r["step_ms"] > 0 for r in lines)
        assert lines[1]["gap_ms"] > 0 and lines[1]["allgather_bytes"] > 0
