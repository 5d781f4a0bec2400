"""The compile part in processes: this machine's Triton compiles its share of the kernel variants
(the checks of test_triton_compile.py, run with pytest), then warms Triton's on-disk cache with
its share of the numerics part's launches.

    python -m gpu.helpers.compile_worker --shard 0/12                 # from tests/, on the GPU machine
    python -m gpu.helpers.compile_worker --shard 0/1 --checks none --warm sm90 --limit 6   # no GPU

A worker prints one JSON line: {"checks": {"passed": [...], "failed": {name: traceback},
"skipped": {...}}, "warm": {"cases": n, "compiled": n, "errors": {...}, "seconds": s}}. Exit code
1 if a check failed; a warm-up error is reported, not fatal (the numerics part then compiles
that kernel). `compile_in_processes` starts the workers and gathers their lines.

[Note: warm Triton cache]
A jitted kernel compiles at its first launch with each specialization: the constexprs, the
dtypes, and which integer arguments and pointers are multiples of 16 (or equal to 1). On a bare
machine the numerics part would compile about 150 of them inside its budget. The compile part
runs first, in parallel processes, and warms the cache with the numerics part's own cases
(`numerics_cases` in numerics_cases.py, built from the same seeded inputs, so the same shapes,
offsets and dtypes) while every jitted kernel of overlap.kernels is replaced by its `warmup`: the
launcher binds the same arguments, computes the same key and compiles into the on-disk cache,
and launches nothing. The numerics part then finds each kernel on disk; it reports the cache
entries it still had to add (`triton_cache_new_entries`). The compile checks themselves cannot
warm it: they compile from explicit signatures with the integers unspecialized, other keys.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
COMPILE_PROCESSES = 14  # workers, each a share of the checks and of the warm-up
"""Measured cold on a loaded 2-core machine: a twelfth of the variants (both architectures) in
9 s; warming a case's kernel for sm_90 about 0.5 s. On 16 cores, 14 processes do the checks and
warm the numerics part's ~180 cases within the part's budget."""


# ---------------------------------------------------------------------------------------------
# the parent: start the workers, gather their lines


def compile_in_processes(warm_on: str, budget_s: float, count: int | None = None) -> dict[str, Any]:
    """Every compile check once over `count` workers (worker 0: the file's other checks; the
    others: their share of the variants), each warming its share of the numerics launches
    (`warm_on`: "cuda" or "none"); what they reported, totalled. Ends them at `budget_s`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, never interpreted
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH"))))
    count = count or max(1, min(COMPILE_PROCESSES, os.cpu_count() or 1))
    base = [sys.executable, "-m", __name__, "--warm", warm_on]
    procs = [subprocess.Popen([*base, "--shard", f"{index}/{count}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for index in range(count)]  # fmt: skip
    deadline = time.monotonic() + max(5.0, budget_s - 3)
    shards = []
    for index, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            rc, err = None, f"timed out after {budget_s - 3:.0f} s\n{err}"
        shards.append({"shard": f"{index}/{count}", "rc": rc, **worker_result(out, err)})
    checks = [s.get("checks", {}) for s in shards]
    warmed = [s.get("warm", {}) for s in shards]
    return {
        "cmd": " ".join(base[1:]), "processes": count, "all_exited_0": all(s["rc"] == 0 for s in shards),
        "checks_passed": sum(len(x.get("passed", [])) for x in checks),
        "checks_failed": {k: v for x in checks for k, v in x.get("failed", {}).items()},
        "checks_skipped": {k: v for x in checks for k, v in x.get("skipped", {}).items()},
        "warm_cases": sum(w.get("cases", 0) for w in warmed), "warm_compiled": sum(w.get("compiled", 0) for w in warmed),
        "warm_errors": {k: v for w in warmed for k, v in w.get("errors", {}).items()},
        "shards": shards,
    }  # fmt: skip


def worker_result(out: str, err: str) -> dict[str, Any]:
    """A worker's JSON line (its checks and warm-up), or what it printed instead."""
    for line in reversed(out.splitlines()):
        with contextlib.suppress(ValueError):
            result = json.loads(line)
            if isinstance(result, dict) and "checks" in result:
                return result
    return {"tail": (out + err)[-1500:]}


# ---------------------------------------------------------------------------------------------
# a worker: the compile checks under pytest


class _Outcomes:
    """A pytest plugin: each test's outcome by its name in the file."""

    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: dict[str, str] = {}
        self.skipped: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        name = report.nodeid.split("::", 1)[-1]
        if report.passed and report.when == "call":
            self.passed.append(name)
        elif report.failed:
            self.failed[name] = str(report.longrepr)[-1500:]
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped[name] = reason.removeprefix("Skipped: ")

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.failed[report.nodeid or "collection"] = str(report.longrepr)[-1500:]


def compile_checks_file() -> Path:
    found = sorted((REPO / "tests").glob("**/test_triton_compile.py"))
    assert found, f"no test_triton_compile.py under {REPO / 'tests'}"
    return found[0]


def run_checks(which: str, path: Path | None = None) -> dict[str, Any]:
    """The compile checks of `path` (test_triton_compile.py): "all" (every test of the file),
    "variants" (test_kernel_compiles of this process's share of the variants), "others" (every
    test but that one) or "none"."""
    import pytest

    outcomes = _Outcomes()
    if which == "none":
        return vars(outcomes)
    select = {"all": [], "variants": ["-k", "test_kernel_compiles"], "others": ["-k", "not test_kernel_compiles"]}[
        which
    ]
    args = [str(path or compile_checks_file()), "-q", "-p", "no:cacheprovider", "-o", "addopts=", *select]
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the one JSON line
        pytest.main(args, plugins=[outcomes])
    return vars(outcomes)


# ---------------------------------------------------------------------------------------------
# a worker: the warm-up ([Note: warm Triton cache])


class _WarmOnly:
    """Stands in for a jitted kernel: `kernel[grid](...)` compiles (Triton's `warmup`), never launches."""

    def __init__(self, kernel: Any, compiled: list[str]) -> None:
        self.kernel, self.compiled = kernel, compiled

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def warm(*args: Any, **kwargs: Any) -> Any:
            self.compiled.append(getattr(self.kernel, "__name__", repr(self.kernel)))
            return self.kernel.warmup(*args, grid=grid, **kwargs)

        return warm

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


@contextlib.contextmanager
def warm_only(compiled: list[str]) -> Iterator[int]:
    """The launched kernels of overlap's Triton modules (the jitted `*_kernel`s; the jitted helpers
    they call stay as they are) replaced by `_WarmOnly`s; yields how many."""
    from triton.runtime.jit import JITFunction

    from overlap.kernels import triton_copy, triton_kernels

    swapped = []
    for module in (triton_kernels, triton_copy):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                swapped.append((module, name, value))
                setattr(module, name, _WarmOnly(value, compiled))
    try:
        yield len(swapped)
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


class _TargetOnly:
    """Triton's active driver without a GPU: the target to compile for, device 0, no stream.
    Lets a machine without a GPU run the warm-up as far as the compiler goes (tests)."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


def warm(where: str, index: int, count: int, limit: int | None = None, only: str | None = None) -> dict[str, Any]:
    """Run every `count`-th of the numerics part's cases from the `index`-th with the kernels
    warm-only: on the GPU ("cuda"), or for sm_`NN` without one ("sm90": CPU tensors, which Triton
    specializes as it does CUDA tensors from torch's allocator, 16-byte aligned and up).
    `only`: the cases whose name contains it; `limit`: at most that many."""
    import torch
    from triton.runtime import driver

    t0 = time.monotonic()
    out: dict[str, Any] = {"where": where, "cases": 0, "compiled": 0, "kernels": 0, "errors": {}}
    if where == "none":
        return out
    from .numerics_cases import numerics_cases  # here: after main() took TRITON_INTERPRET away

    on_gpu = where == "cuda"
    dev = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    cases, _skipped = numerics_cases(dev, False, {})
    mine = [c for c in cases[index::count] if only is None or only in c[1]][:limit]
    compiled: list[str] = []
    with contextlib.ExitStack() as stack:
        if not on_gpu:  # put back as it was (reset_active would look for a GPU)
            stack.callback(setattr, driver, "_active", getattr(driver, "_active", None))
            driver.set_active(_TargetOnly(int(where.removeprefix("sm"))))
        out["kernels"] = stack.enter_context(warm_only(compiled))
        for _, name, fn in mine:
            try:
                fn()  # compares results that were never computed: only the launches matter
            except Exception as e:
                out["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            out["cases"] += 1
    out["compiled"] = len(compiled)
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default="0/1", help="i/n: this process's share")
    parser.add_argument("--checks", choices=("all", "variants", "others", "none"), default=None,
                        help="default: the checks but the variants in process 0, its share of the variants in the "
                             "others (all in a single process)")  # fmt: skip
    parser.add_argument("--warm", default="cuda", help="cuda, smNN (no GPU: compile for that target) or none")
    parser.add_argument("--limit", type=int, default=None, help="warm at most this many cases")
    parser.add_argument("--only", default=None, help="warm only the cases whose name contains this")
    parser.add_argument("--file", type=Path, default=None, help="the checks (default: test_triton_compile.py)")
    args = parser.parse_args()
    index, count = (int(v) for v in args.shard.split("/"))
    # process 0 compiles the file's other checks (about as many kernels as a share of the
    # variants), processes 1..count-1 share the variants (test_triton_compile's own sharding)
    os.environ["OVERLAP_COMPILE_SHARD"] = f"{max(index - 1, 0)}/{max(count - 1, 1)}"
    os.environ.pop("TRITON_INTERPRET", None)  # compiled, never interpreted
    checks = run_checks(args.checks or ("all" if count == 1 else "others" if index == 0 else "variants"), args.file)
    try:
        warmed = warm(args.warm, index, count, args.limit, args.only)
    except Exception:
        warmed = {"error": traceback.format_exc()[-2000:]}
    print(json.dumps({"checks": checks, "warm": warmed}), flush=True)
    return 1 if checks["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
