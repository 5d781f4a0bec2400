"""Telemetry and alerts, once per step: what the process and the GPU did, and what looks wrong.

`Monitor.on_step(stats)` runs when a step ends (`overlap.wrap` calls it). It samples

    CPU   resident memory (RSS) and process CPU time
    GPU   memory used, utilization, power, NVLink and PCIe throughput (NVML, when a GPU and
          nvidia-ml-py are present; `max_memory_allocated` from torch as well)

appends one JSON line per step to `OverlapConfig.metrics_file` (if set), and checks the alert
thresholds of the config. An alert is one `logging` warning on the "overlap" logger naming the
step and the unit, e.g. a slow link (a collective taking far longer than its running median) or
a starving data loader (a long gap between steps) shows up while it happens.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from overlap.stats import StepStats

log = logging.getLogger("overlap")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_sample() -> dict[str, float]:
    """RSS bytes and CPU seconds (user + system) of this process."""
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * _PAGE_BYTES
    except OSError:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = os.times()
    return {"rss_bytes": rss, "cpu_s": times.user + times.system}


class NvmlSampler:
    """GPU counters through NVML (nvidia-ml-py); `available` is False without a GPU or NVML."""

    def __init__(self, device_index: int) -> None:
        self.available = False
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self.available = True
        except Exception:  # no driver, no package, no GPU: CPU-only telemetry
            self.available = False

    def sample(self) -> dict[str, float]:
        if not self.available:
            return {}
        nv, h = self._nvml, self._handle
        out: dict[str, float] = {}
        memory = nv.nvmlDeviceGetMemoryInfo(h)
        out["gpu_mem_used_bytes"] = memory.used
        out["gpu_mem_total_bytes"] = memory.total
        out["gpu_util_pct"] = nv.nvmlDeviceGetUtilizationRates(h).gpu
        out["gpu_power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1e3
        for name, counter in (
            ("pcie_tx_kbps", "NVML_PCIE_UTIL_TX_BYTES"),
            ("pcie_rx_kbps", "NVML_PCIE_UTIL_RX_BYTES"),
        ):
            try:
                out[name] = nv.nvmlDeviceGetPcieThroughput(h, getattr(nv, counter))
            except Exception:
                pass
        try:  # NVLink throughput counters (field values API; not on every part/driver)
            fields = [nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX]
            values = nv.nvmlDeviceGetFieldValues(h, fields)
            out["nvlink_tx_kib"] = float(values[0].value.ullVal)
            out["nvlink_rx_kib"] = float(values[1].value.ullVal)
        except Exception:
            pass
        return out


class Monitor:
    """Per-step sampling, JSONL metrics and threshold alerts. Thresholds of None are off."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        metrics_file: str | None = None,
        alert_exposed_comm_share: float | None = None,
        alert_collective_slowdown: float | None = None,
        alert_step_gap_ms: float | None = None,
        alert_memory_bytes: int | None = None,
        history: int = 50,
    ) -> None:
        self.rank = rank
        self.device = device
        self.path = Path(metrics_file.replace("{rank}", str(rank))) if metrics_file else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.alert_exposed_comm_share = alert_exposed_comm_share
        self.alert_collective_slowdown = alert_collective_slowdown
        self.alert_step_gap_ms = alert_step_gap_ms
        self.alert_memory_bytes = alert_memory_bytes
        self._history: dict[str, deque[float]] = {}
        self._history_len = history
        self._nvml = NvmlSampler(device.index or 0) if device.type == "cuda" else None
        self.alerts: list[str] = []  # every alert raised, for tests and summaries

    def on_step(self, stats: StepStats) -> dict[str, Any]:
        record: dict[str, Any] = {
            "time": time.time(),
            "rank": self.rank,
            "step": stats.step,
            "step_ms": stats.step_ms,
            "gap_ms": stats.gap_ms,
            "exposed_comm_ms": stats.exposed_comm_ms,
            "allgather_bytes": stats.allgather_bytes,
            "reduce_scatter_bytes": stats.reduce_scatter_bytes,
            "max_unsharded_bytes": stats.max_unsharded_bytes,
            **process_sample(),
        }
        if self.device.type == "cuda":
            record["max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
            if self._nvml is not None:
                record.update(self._nvml.sample())
        self._check(stats, record)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def _alert(self, message: str) -> None:
        self.alerts.append(message)
        log.warning("overlap rank %d: %s", self.rank, message)

    def _check(self, stats: StepStats, record: dict[str, Any]) -> None:
        step = stats.step
        share = stats.exposed_comm_ms / stats.step_ms if stats.step_ms > 0 else 0.0
        if self.alert_exposed_comm_share is not None and share > self.alert_exposed_comm_share:
            worst = max(stats.unit_waits_ms.items(), key=lambda kv: kv[1], default=("-", 0.0))
            self._alert(
                f"step {step}: exposed communication is {share:.0%} of the step "
                f"(threshold {self.alert_exposed_comm_share:.0%}); largest wait: {worst[0]} "
                f"{worst[1]:.1f} ms"
            )
        if self.alert_step_gap_ms is not None and stats.gap_ms > self.alert_step_gap_ms:
            self._alert(
                f"step {step}: {stats.gap_ms:.0f} ms passed between the previous step and this "
                f"forward (threshold {self.alert_step_gap_ms:.0f} ms): is the data loader keeping up?"
            )
        memory = record.get("gpu_mem_used_bytes", record.get("rss_bytes", 0))
        if self.alert_memory_bytes is not None and memory > self.alert_memory_bytes:
            self._alert(
                f"step {step}: memory in use {memory / 2**30:.2f} GiB exceeds "
                f"{self.alert_memory_bytes / 2**30:.2f} GiB"
            )
        for label, ms in stats.collective_ms.items():
            past = self._history.setdefault(label, deque(maxlen=self._history_len))
            if (
                self.alert_collective_slowdown is not None
                and len(past) >= 5
                and ms > self.alert_collective_slowdown * statistics.median(past)
            ):
                self._alert(
                    f"step {step}: {label} took {ms:.1f} ms, "
                    f"{ms / statistics.median(past):.1f}x its running median "
                    f"({statistics.median(past):.1f} ms): a slow link or a straggling rank?"
                )
            past.append(ms)
