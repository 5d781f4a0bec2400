"""Telemetry lines and alerts: each threshold fires on a synthetic step that crosses it, names
the step and the unit, and stays quiet on one that does not; a real run writes its JSONL."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from helpers.models import sgd_steps, tiny_lm

import overlap
from overlap.observe.monitor import Monitor, nvml_handle
from overlap.observe.stats import StepStats


def _step(step: int, **kw) -> StepStats:
    return StepStats(step=step, **kw)


def test_alerts_fire_and_name_step_and_unit(caplog):
    m = Monitor(
        0,
        torch.device("cpu"),
        alert_exposed_comm_share=0.3,
        alert_collective_slowdown=3.0,
        alert_step_gap_ms=500,
        alert_memory_bytes=1,
    )
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
    sgd_steps(overlap.wrap(tiny_lm(), metrics_file=path), rank)
    return {}


def test_metrics_file_has_one_line_per_step(world2, tmp_path):
    world2.run(metrics_run, path=str(tmp_path / "metrics_rank{rank}.jsonl"))
    for rank in (0, 1):
        lines = [json.loads(x) for x in (tmp_path / f"metrics_rank{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines] == [0, 1, 2]
        assert all(r["rank"] == rank and r["rss_bytes"] > 0 and r["step_ms"] > 0 for r in lines)
        assert lines[1]["gap_ms"] > 0 and lines[1]["allgather_bytes"] > 0


class FakeNvml:
    """pynvml's surface that NvmlSampler uses; counts every call. Physical GPUs 0..7 with
    UUIDs GPU-uuid0..GPU-uuid7."""

    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name: str):
        attr = object.__getattribute__(self, name)
        if name.startswith("nvml"):
            object.__getattribute__(self, "calls").append(name)
        return attr

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        if not uuid.startswith("GPU-uuid"):
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return int(uuid.removeprefix("GPU-uuid"))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(used=1000 + handle, total=2000)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=50)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 300_000

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:
        return 7

    def nvmlDeviceGetFieldValues(self, handle: int, fields: list[int]) -> list:
        return [SimpleNamespace(value=SimpleNamespace(ullVal=1))] * len(fields)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CPU-only build pretending to be CUDA: cuda:1 is physical GPU 5 (uuid5)."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 456)
    props = {1: SimpleNamespace(uuid="uuid5")}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props[torch.device(d).index])
    return torch.device("cuda", 1)


def test_no_nvml_call_unless_metrics_are_wanted(fake_cuda):
    nvml = FakeNvml()
    m = Monitor(0, fake_cuda, nvml=nvml)
    for i in range(20):
        m.on_step(_step(i, step_ms=100))
    assert nvml.calls == []


def test_nvml_samples_the_visible_gpu_every_n_steps_and_pcie_rarely(fake_cuda, tmp_path):
    nvml = FakeNvml()
    m = Monitor(
        0,
        fake_cuda,
        metrics_file=str(tmp_path / "m.jsonl"),
        alert_memory_bytes=10**9,
        gpu_sample_every_steps=5,
        nvml=nvml,
    )
    for i in range(20):
        m.on_step(_step(i, step_ms=100))
    assert nvml.calls.count("nvmlInit") == 1
    assert nvml.calls.count("nvmlDeviceGetHandleByUUID") == 1  # "GPU-uuid5" found first
    assert nvml.calls.count("nvmlDeviceGetMemoryInfo") == 4  # steps 0, 5, 10, 15
    assert nvml.calls.count("nvmlDeviceGetPcieThroughput") == 2  # once per minute: step 0 only
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(20))
    sampled = [r["step"] for r in lines if "gpu_mem_used_bytes" in r]
    assert sampled == [0, 5, 10, 15] and lines[0]["gpu_mem_used_bytes"] == 1005  # physical GPU 5
    assert all(r["memory_reserved_bytes"] == 456 for r in lines) and m.alerts == []


def test_alerts_alone_need_no_nvml(fake_cuda):
    nvml = FakeNvml()
    m = Monitor(0, fake_cuda, alert_memory_bytes=100, alert_exposed_comm_share=0.5, nvml=nvml)
    m.on_step(_step(0, step_ms=100))
    assert nvml.calls == [] and len(m.alerts) == 1 and "memory in use" in m.alerts[0]


def test_nvml_index_follows_cuda_visible_devices(monkeypatch):
    """Without a usable UUID, torch's mapping of visible devices: cuda:1 under 4,5,6,7 is 5."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="unknown"))
    nvml = FakeNvml()
    assert nvml_handle(nvml, torch.device("cuda", 1)) == 5
    assert nvml.calls[-1] == "nvmlDeviceGetHandleByIndex"
