"""What one GPU can prove about the CUDA path in about 4 minutes; `--device cpu` dry-runs it.

On a machine with one CUDA GPU:

    PYTHONUNBUFFERED=1 timeout 420 python3 benchmarks/gpu_check.py --out gpu_check.json 2>&1 | tee gpu_check.log

Dry run (CI, tests/tools/test_gpu_check.py), and a subset of parts:

    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check.json
    python benchmarks/gpu_check.py --only numerics,world2

The checks are pytest tests, one per part, in tests/gpu (its package docstring and each file's
say what they prove; tests/gpu/parts.py lists the parts in order with their budgets: compile,
numerics, the worlds, the world-size-1 parts, bandwidth). This script runs them with
`pytest tests/gpu` in a process of its own: each part under its budget (all together 240 s; the
dry run twice each), where one that raises or overruns records the error and the run goes on,
and a watchdog that ends a part 30 s past its budget, or the whole run 30 s past the total (a
part stuck in a C++ call never sees its timeout).

The JSON at `--out` holds the environment (torch, Triton, CUDA, NCCL, driver, GPU, the private
torch APIs tensor and expert parallelism use) and one entry per part, written before the part
starts (status "running") and rewritten whenever the part has something new (a numerics case, a
world's config, a bandwidth row) and when it ends, so a run cut short by a part's budget, the
watchdog or `timeout` keeps everything measured until then. Entry: {"part", "status", "bar",
"measured", "seconds", "budget_s"}; status is "passed" / "failed" (held to its bar), "measured"
(no bar on this device), "skipped: why", "error" (with a traceback) or "running" (cut short).
Exit code 1 if any part errored, else 0: a failed bar is a result, not a crash.

The dry run runs every part it can on the CPU: the Triton kernels under Triton's interpreter
(TRITON_INTERPRET=1), the worlds on gloo with CPU tensors (the delays are `time.sleep`), the
world-size-1 parts on gloo, the bandwidth rows at a tiny size. Peak memory against FSDP2 is not a
part (at world size 1 it says little about sharding at scale): `overlap bench memory --device
cuda` measures it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
POLL_S = 0.5  # how often the watchdog reads the report
sys.path.insert(0, str(TESTS))  # the parts' table, tests/gpu/parts.py (no torch, no overlap)

from gpu.parts import CPU_BUDGET_SCALE, ENV, GRACE_S, PARTS, WATCHDOG_S


def pytest_command(paths: list[Path]) -> list[str]:
    """pytest on `paths` alone: the project's addopts (a marker filter, say) left out, the per-part
    budgets (tests/gpu/conftest.py) in place of the suite's timeout, no plugin but pytest-timeout
    (PYTEST_DISABLE_PLUGIN_AUTOLOAD: the others cost a second and a half at start)."""
    return [sys.executable, "-m", "pytest", *map(str, paths), "-q", "-p", "pytest_timeout", "-p", "no:cacheprovider",
            "-o", "addopts=", "-rfE", "--tb=short", "--no-header"]  # fmt: skip


def run_checks(out: Path, device: str, parts: list[str] | None = None, paths: list[Path] | None = None,
               watchdog_s: float | None = None, grace_s: float = GRACE_S) -> dict[str, Any]:  # fmt: skip
    """The GPU checks under pytest in a process group of their own (`paths`: tests/gpu); the
    report they wrote, with its summary. The watchdog (`watch`: WATCHDOG_S for the whole run,
    scaled for the dry run; `grace_s` past a part's budget) ends the group and says why in the
    summary; so does a SIGTERM to this process (`timeout`)."""
    env = dict(os.environ, **ENV, OVERLAP_GPU_DEVICE=device, OVERLAP_GPU_REPORT=str(out))
    env.update(OVERLAP_GPU_PARTS=",".join(parts or []), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(TESTS), str(REPO), os.environ.get("PYTHONPATH"))))
    if device == "cpu":  # before overlap's Triton kernels are defined
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    out.unlink(missing_ok=True)
    watchdog_s = watchdog_s or WATCHDOG_S * (CPU_BUDGET_SCALE if device == "cpu" else 1.0)
    proc = subprocess.Popen(pytest_command(paths or [TESTS / "gpu"]), cwd=REPO, env=env, start_new_session=True)

    def stop(signum: int, _frame: Any) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        finish(out, f"stopped by signal {signum}")
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        stopped = watch(proc, out, watchdog_s, grace_s)
        if stopped is None and proc.returncode not in (0, 1):  # 1: a part failed or errored
            stopped = f"pytest exited with code {proc.returncode}"
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if stopped:
        print(f"[gpu_check] {stopped}", flush=True)
    return finish(out, stopped)


def watch(proc: subprocess.Popen, out: Path, watchdog_s: float, grace_s: float) -> str | None:
    """Wait for the checks; why they were stopped, if they were: the whole run past `watchdog_s`,
    or a part running `grace_s` past its budget (stuck in a C++ call, out of its timeout's reach)."""
    deadline = time.monotonic() + watchdog_s
    seen: dict[int, float] = {}  # a running part, by its place in the report: when it was first seen
    while proc.poll() is None:
        now = time.monotonic()
        if now > deadline:
            return f"watchdog: the run went past {watchdog_s:.0f} s"
        for index, part in running_parts(out):
            if now - seen.setdefault(index, now) > part["budget_s"] + grace_s:
                return f"watchdog: {part['part']} ran {grace_s:g} s past its budget of {part['budget_s']:g} s"
        time.sleep(POLL_S)
    return None


def running_parts(out: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        parts = json.loads(out.read_text())["parts"]
    except (OSError, ValueError, KeyError):  # not written yet
        return []
    return [(index, part) for index, part in enumerate(parts) if part["status"] == "running"]


def finish(out: Path, stopped: str | None) -> dict[str, Any]:
    """The report as the checks left it, with its summary: the statuses counted, or why the run
    was stopped (then "error" is that reason); written back."""
    try:
        report = json.loads(out.read_text())
    except (OSError, ValueError):  # the checks never started
        report = {"environment": {}, "parts": []}
    report["summary"] = (
        {"error": stopped} if stopped else dict(Counter(p["status"].split(":")[0] for p in report["parts"]))
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(out)
    return report


def cuda_available() -> bool:
    import torch  # here: the dry run and --help need no torch in this process

    return torch.cuda.is_available()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "gpu_results" / "gpu_check.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where available")
    parser.add_argument("--only", default=",".join(PARTS), help="comma list of parts")
    args = parser.parse_args()
    missing = [name for name in ("pytest", "pytest_timeout") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"gpu_check: {missing} not installed (the extra `test`: pip install -e '.[test]')")
    device = args.device or ("cuda" if cuda_available() else "cpu")
    if device == "cuda" and not cuda_available():
        raise SystemExit("gpu_check: --device cuda but CUDA is not available (use --device cpu for the dry run)")
    wanted = args.only.split(",")
    unknown = set(wanted) - set(PARTS)
    if unknown:
        raise SystemExit(f"gpu_check: unknown parts {sorted(unknown)}; parts: {list(PARTS)}")
    report = run_checks(args.out.resolve(), device, wanted)
    for p in report["parts"]:
        print(f"[gpu_check] {p['part']:<10} {p['status']:<18} {p.get('seconds', 0):>7.1f} s", flush=True)
    print(f"[gpu_check] {report['summary']}; wrote {args.out}", flush=True)
    error = report["summary"].get("error")
    return 2 if isinstance(error, str) else 1 if error else 0  # stopped; a part errored; every part ran to its end


if __name__ == "__main__":
    sys.exit(main())
