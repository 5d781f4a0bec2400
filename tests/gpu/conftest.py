"""The GPU checks' fixtures and hooks: which device they run on, each part's time budget, and the
JSON report (helpers/report.py), written as the parts run.

Environment (benchmarks/gpu_check.py sets them; a person running `pytest tests/gpu` may too):
  OVERLAP_GPU_DEVICE  "cuda" (the default where CUDA is available) or "cpu": the dry run, every
                      part that can run on the CPU (Triton under its interpreter). With neither,
                      every test here skips ("needs a CUDA GPU").
  OVERLAP_GPU_REPORT  the JSON report's path (none: no report).
  OVERLAP_GPU_PARTS   a comma list: only these parts run (the runner's --only).

Each test is one part (`@pytest.mark.part(name)`, budgets in parts.py): the parts run in the
table's order, each under pytest-timeout with its budget (x CPU_BUDGET_SCALE in the dry run),
never past what is left of the total; one with less than MIN_BUDGET_S left is skipped. A part
publishes its bar and measurements through the `record` fixture; a failed assert is "failed"
(a result), any other exception or the timeout is "error".
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from .helpers.common import SIZES, Sizes
from .helpers.report import PartRecord, environment, write_report
from .helpers.worlds import free_port
from .parts import CPU_BUDGET_SCALE, ENV, MIN_BUDGET_S, PARTS, TOTAL_BUDGET_S, PartSpec

HERE = Path(__file__).resolve().parent
NEEDS_CUDA = "needs a CUDA GPU (OVERLAP_GPU_DEVICE=cpu dry-runs what can run on the CPU)"


class GpuRun:
    """The session's state: the device, the clock of the total budget, the report."""

    def __init__(self, device: torch.device | None, path: Path | None) -> None:
        self.device, self.path = device, path
        self.scale = CPU_BUDGET_SCALE if device is not None and device.type == "cpu" else 1.0
        self.total_s = TOTAL_BUDGET_S * self.scale
        self.start: float | None = None  # the first part's start
        self.report: dict[str, Any] = {"environment": {}, "parts": []}
        self.records: dict[str, PartRecord] = {}

    def write(self) -> None:
        if self.path is not None:
            write_report(self.path, self.report)


RUN = pytest.StashKey[GpuRun]()


def selected_device() -> torch.device | None:
    wanted = os.environ.get("OVERLAP_GPU_DEVICE", "")
    if wanted not in ("", "cuda", "cpu"):
        raise pytest.UsageError(f"OVERLAP_GPU_DEVICE={wanted!r}: use cuda or cpu")
    if wanted == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if wanted == "cuda":
        raise pytest.UsageError("OVERLAP_GPU_DEVICE=cuda but CUDA is not available (cpu dry-runs the checks)")
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "part(name, budget_s=None, cuda_only=None): one part of the GPU check")
    device = selected_device()
    if device is not None and device.type == "cpu":  # before overlap's Triton kernels are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
    path = os.environ.get("OVERLAP_GPU_REPORT")
    run = GpuRun(device, Path(path) if path else None)
    if device is not None and run.path is not None:
        run.report["environment"] = environment(device)
        run.write()
    config.stash[RUN] = run


def part_of(item: pytest.Item) -> tuple[str, PartSpec] | None:
    """(name, budget) of a part's test; a marker's budget_s / cuda_only override the table's."""
    marker = item.get_closest_marker("part")
    if marker is None:
        return None
    name = marker.args[0]
    spec = PARTS.get(name, PartSpec(60))
    return name, spec._replace(**{k: v for k, v in marker.kwargs.items() if v is not None})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The parts in the table's order (others' tests keep their places), only those asked for,
    skipped where they cannot run."""
    run = config.stash[RUN]
    wanted = {p for p in os.environ.get("OVERLAP_GPU_PARTS", "").split(",") if p}
    dropped = [i for i in items if wanted and (p := part_of(i)) and p[0] not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i not in dropped]
    order = list(PARTS)

    def rank(item: pytest.Item) -> int:
        name = part_of(item)[0]  # type: ignore[index]
        return order.index(name) if name in order else len(order)

    slots = [k for k, item in enumerate(items) if part_of(item)]
    for k, item in zip(slots, sorted((items[k] for k in slots), key=rank)):
        items[k] = item
    for item in items:
        here = Path(item.path).is_relative_to(HERE)
        if run.device is None and ((here and item.get_closest_marker("cuda")) or part_of(item)):
            item.add_marker(pytest.mark.skip(reason=NEEDS_CUDA))
        elif run.device is not None and run.device.type == "cpu" and (p := part_of(item)) and p[1].cuda_only:
            item.add_marker(pytest.mark.skip(reason="no CUDA"))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """The part's entry on disk before it starts and after it ends; its budget as pytest-timeout's
    marker (read after this hook's first half)."""
    part = part_of(item)
    run = item.config.stash[RUN]
    if part is None:
        yield
        return
    name, spec = part
    run.start = run.start or time.monotonic()
    budget = min(spec.budget_s * run.scale, run.total_s - (time.monotonic() - run.start))
    entry: dict[str, Any] = {
        "part": name,
        "status": "running",
        "budget_s": round(budget, 1),
        "bar": None,
        "measured": None,
    }
    run.report["parts"].append(entry)
    run.records[item.nodeid] = PartRecord(entry, run.write)
    if budget < MIN_BUDGET_S:
        item.add_marker(pytest.mark.skip(reason="out of time"))
    else:
        item.add_marker(pytest.mark.timeout(budget, method="signal"), append=False)
    run.write()
    t0 = time.monotonic()
    yield
    entry["seconds"] = round(time.monotonic() - t0, 2)
    run.write()
    gc.collect()  # the part's memory back before the next one
    if run.device is not None and run.device.type == "cuda":
        torch.cuda.empty_cache()
    shown = f"{str(entry.get('measured'))[:400]} {entry.get('error', '')[:300]}"
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and run.path is not None:  # the runner's progress lines
        reporter.write_line(f"[gpu_check] {name}: {entry['status']} ({entry['seconds']} s) {shown}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[Any]:
    """The entry's status from the test's outcome: passed / measured, failed (an assert: the bar
    missed), skipped, error (any other exception, the part's timeout among them)."""
    outcome = yield
    report = outcome.get_result()
    record = item.config.stash[RUN].records.get(item.nodeid)
    if record is None:
        return
    entry = record.entry
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry["status"] = f"skipped: {reason.removeprefix('Skipped: ')}"
    elif report.passed and report.when == "call":
        entry["status"] = record.passed_status
    elif report.failed and call.excinfo is not None:
        error = call.excinfo.value
        if report.when == "call" and isinstance(error, AssertionError):
            entry.update(status="failed", failure=str(error)[:2000])
        elif entry["status"] != "error":
            timed_out = call.excinfo.typename == "Failed" and str(error).startswith("Timeout")
            text = (
                f"Timeout: ran past its budget of {entry['budget_s']:.0f} s"
                if timed_out
                else f"{call.excinfo.typename}: {error}"
            )
            entry.update(status="error", error=text[:2000], traceback=str(report.longrepr)[-4000:])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The report's summary: the parts' statuses counted."""
    run = session.config.stash.get(RUN, None)
    if run is not None and run.report["parts"]:
        run.report["summary"] = dict(Counter(p["status"].split(":")[0] for p in run.report["parts"]))
        run.write()


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="package")
def device(pytestconfig: pytest.Config) -> Iterator[torch.device]:
    """The device the parts run on, with the parts' environment (ENV) set while they run."""
    selected = pytestconfig.stash[RUN].device
    if selected is None:
        pytest.skip(NEEDS_CUDA)
    if selected.type == "cuda":
        torch.cuda.set_device(selected)
    with environ(ENV):
        yield selected


@pytest.fixture(scope="package")
def sizes(device: torch.device) -> Sizes:
    return SIZES[device.type]


@pytest.fixture(scope="package")
def world1(device: torch.device) -> Iterator[None]:
    """A process group of this process alone (NCCL on CUDA) for the world-size-1 parts."""
    if dist.is_initialized():
        yield
        return
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=120), device_id=device if cuda else None)  # fmt: skip
    yield
    dist.destroy_process_group()


@pytest.fixture
def record(request: pytest.FixtureRequest) -> PartRecord:
    """The part's entry in the report: its bar and measurements, on disk as they grow."""
    part = request.config.stash[RUN].records.get(request.node.nodeid)
    assert part is not None, f"{request.node.nodeid}: `record` is for tests marked @pytest.mark.part"
    return part


@pytest.fixture(scope="package")
def world_results() -> dict[str, dict[str, Any]]:
    """The worlds' measurements by part, for the memory part."""
    return {}
