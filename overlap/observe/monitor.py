"""Telemetry and alerts, once per step: what the process and the GPU did, and what looks wrong.

`Monitor.on_step(stats)` runs when a step ends (`overlap.wrap` calls it). It samples

    CPU   resident memory (RSS) and process CPU time
    GPU   allocator memory from torch every step; memory used, utilization, power, NVLink and
          PCIe throughput from NVML every few steps (when nvidia-ml-py is present and a
          metrics file is written)

appends one JSON line per step to `OverlapConfig.metrics_file` (if set), and checks the alert
thresholds of the config. With neither a metrics file nor an alert it samples nothing. An alert is one `logging` warning on the "overlap" logger naming the
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

from overlap.observe.stats import StepStats

log = logging.getLogger("overlap")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident memory now (/proc/self/statm); its peak where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def process_sample() -> dict[str, float]:
    """RSS bytes and CPU seconds (user + system) of this process."""
    times = os.times()
    return {"rss_bytes": rss_bytes(), "cpu_s": times.user + times.system}


def nvml_handle(nvml: Any, device: torch.device) -> Any:
    """The NVML handle of CUDA `device`.

    NVML numbers physical GPUs; CUDA numbers the visible ones (CUDA_VISIBLE_DEVICES, MIG), so
    cuda:0 under CUDA_VISIBLE_DEVICES=4,5 is NVML's GPU 4. Looked up by the device's UUID
    ("GPU-..." for a whole GPU, "MIG-..." for a MIG instance), else through torch's mapping of
    the visible devices."""
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # no UUID from this torch build
        uuid = ""
    names = [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"] if uuid else []
    for name in names:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(name)
        except Exception:
            continue
    return nvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))


class NvmlSampler:
    """GPU counters through NVML (nvidia-ml-py); `available` is False without a GPU or NVML.

    `nvml`: the pynvml module (None: import it), injectable for tests."""

    def __init__(self, device: torch.device, nvml: Any = None) -> None:
        self.available = False
        self._handle: Any = None
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            self._nvml = nvml
            self._handle = nvml_handle(nvml, device)
            self.available = True
        except Exception:  # no driver, no package, no GPU: CPU-only telemetry
            self.available = False

    def sample(self, pcie: bool = False) -> dict[str, float]:
        """Memory, utilization, power, NVLink counters. `pcie`: PCIe throughput as well, which
        NVML measures by counting bytes over 20 ms per direction: ~40 ms of this thread."""
        if not self.available:
            return {}
        nv, h = self._nvml, self._handle
        out: dict[str, float] = {}
        memory = nv.nvmlDeviceGetMemoryInfo(h)
        out["gpu_mem_used_bytes"] = memory.used
        out["gpu_mem_total_bytes"] = memory.total
        out["gpu_util_pct"] = nv.nvmlDeviceGetUtilizationRates(h).gpu
        out["gpu_power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1e3
        for name, counter in (("pcie_tx_kbps", "NVML_PCIE_UTIL_TX_BYTES"), ("pcie_rx_kbps", "NVML_PCIE_UTIL_RX_BYTES")):
            if not pcie:
                break
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
    """Per-step sampling, JSONL metrics and threshold alerts. Thresholds of None are off.

    Nothing is sampled unless a metrics file or an alert asks: with neither, `on_step` reads
    no counters and makes no NVML call. NVML (metrics file only) is read every
    `gpu_sample_every_steps` steps, its PCIe counters at most every `pcie_interval_s` seconds.
    On CUDA the times of a step arrive a step late (see overlap/observe/stats.py), so alerts name the
    step they concern, which is the one before the step just finished.
    """

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
        gpu_sample_every_steps: int = 10,
        pcie_interval_s: float = 60.0,
        nvml: Any = None,
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
        self.gpu_sample_every_steps = gpu_sample_every_steps
        self.pcie_interval_s = pcie_interval_s
        self._nvml_module = nvml
        self._nvml: NvmlSampler | None = None  # made at the first sample
        self._num_steps = 0
        self._last_pcie_s = float("-inf")
        self.alerts: list[str] = []  # every alert raised, for tests and summaries

    @property
    def wanted(self) -> bool:
        """Whether anybody reads what on_step samples: a metrics file or an alert."""
        thresholds = (
            self.alert_exposed_comm_share,
            self.alert_collective_slowdown,
            self.alert_step_gap_ms,
            self.alert_memory_bytes,
        )
        return self.path is not None or any(t is not None for t in thresholds)

    def on_step(self, stats: StepStats) -> dict[str, Any]:
        record: dict[str, Any] = {
            "time": time.time(),
            "rank": self.rank,
            "step": stats.step,
            "step_ms": stats.step_ms,
            "gap_ms": stats.gap_ms,
            "exposed_comm_ms": stats.exposed_comm_ms,
            "device_timed": stats.device_timed,
            "allgather_bytes": stats.allgather_bytes,
            "reduce_scatter_bytes": stats.reduce_scatter_bytes,
            "max_unsharded_bytes": stats.max_unsharded_bytes,
        }
        if not self.wanted:
            return record
        record.update(process_sample())
        if self.device.type == "cuda":
            # allocator counters on the host: no device sync, no NVML
            record["max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
            record["memory_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
            if self.path is not None:
                record.update(self._sample_gpu())
        self._num_steps += 1
        self._check(stats, record)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def _sample_gpu(self) -> dict[str, float]:
        """NVML counters on every `gpu_sample_every_steps`-th step (the first included)."""
        if self._num_steps % self.gpu_sample_every_steps != 0:
            return {}
        if self._nvml is None:
            self._nvml = NvmlSampler(self.device, self._nvml_module)
        now = time.monotonic()
        pcie = now - self._last_pcie_s >= self.pcie_interval_s
        if pcie:
            self._last_pcie_s = now
        return self._nvml.sample(pcie=pcie)

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
        # CUDA: this process's allocator pool (every step, no NVML); CPU: resident memory
        memory = record.get("memory_reserved_bytes", record.get("rss_bytes", 0))
        if self.alert_memory_bytes is not None and memory > self.alert_memory_bytes:
            self._alert(
                f"step {step}: memory in use {memory / 2**30:.2f} GiB exceeds {self.alert_memory_bytes / 2**30:.2f} GiB"
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
