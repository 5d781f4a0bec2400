"""The GPU check's JSON report, written as it grows, so that a run cut short by a budget, the
watchdog or `timeout` keeps everything measured until then.

{"environment": {...}, "parts": [entry, ...], "summary": {status: count}}. An entry is on disk
before its part starts (status "running") and again whenever the part publishes something
(`PartRecord.progress`: a numerics case, a world's config, a bandwidth row) and when it ends:
{"part", "status", "bar", "measured", "seconds", "budget_s"}; status is "passed" / "failed"
(held to its bar; "failure" says how it missed), "measured" (no bar on this device),
"skipped: why", "error" (with "error" and "traceback": a crash or a part past its budget) or
"running" (cut short).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..parts import ENV
from .common import SIZES, WORLD_SIZES

REPO = Path(__file__).resolve().parents[3]
_write_lock = threading.Lock()


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Atomically: a reader (or a crash) never sees half a file."""
    with _write_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        tmp.replace(path)


class PartRecord:
    """What a part's test publishes: its bar, its measurements (on disk at each `progress`), and
    whether passing means "passed" or only "measured" (no bar on this device: `unjudged`)."""

    def __init__(self, entry: dict[str, Any], write: Callable[[], None]) -> None:
        self.entry, self._write = entry, write
        self.passed_status = "passed"

    @property
    def bar(self) -> str | None:
        return self.entry["bar"]

    @bar.setter
    def bar(self, text: str) -> None:
        self.entry["bar"] = text

    def progress(self, measured: dict[str, Any]) -> None:
        """The part's results so far, on disk now (a timeout keeps them)."""
        self.entry["measured"] = measured
        self._write()

    def unjudged(self, why: str) -> None:
        """No bar on this device: the part passes as "measured", its bar says why."""
        self.passed_status = "measured"
        self.entry["bar"] = f"{self.entry['bar'] or ''} ({why})".strip()


def environment(device: torch.device) -> dict[str, Any]:
    """torch, Triton, CUDA, NCCL, driver, GPU, the private torch APIs tensor and expert
    parallelism use, and the sizes the parts run at."""
    kind = device.type
    env: dict[str, Any] = {"device": kind, "torch": torch.__version__, "python": platform.python_version(),
                           "env": ENV, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
                           "sizes": asdict(SIZES[kind]), "world_sizes": asdict(WORLD_SIZES[kind]),
                           "cpus": os.cpu_count()}  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:  # the private torch APIs tensor and expert parallelism reach, on this torch
        from overlap.engine.torch_compat import probe

        env["torch_private_api"] = probe()
    except Exception as e:
        env["torch_private_api"] = f"unknown ({type(e).__name__}: {e})"
    with contextlib.suppress(Exception):
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5, check=False
        )
        env["git_head"] = head.stdout.strip() or None
    if kind == "cuda":
        env.update(cuda_facts(device))
    return env


def cuda_facts(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Callable[[], Any]] = {
        "gpu": lambda: torch.cuda.get_device_name(device),
        "capability": lambda: torch.cuda.get_device_capability(device),
        "multiprocessors": lambda: torch.cuda.get_device_properties(device).multi_processor_count,
        "memory_bytes": lambda: torch.cuda.get_device_properties(device).total_memory,
        "cuda": lambda: torch.version.cuda,
        "nccl": lambda: str(torch.cuda.nccl.version()),
        "nvidia_smi": lambda: subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False).stdout.strip(),
    }  # fmt: skip
    env: dict[str, Any] = {}
    for key, fact in facts.items():
        try:
            env[key] = fact()
        except Exception as e:
            env[key] = f"unknown ({type(e).__name__}: {e})"
    smi = str(env.get("nvidia_smi", "")).split(",")
    env["driver"] = smi[1].strip() if len(smi) > 1 else None
    return env
