"""One process of gpu_check's compile part: this machine's Triton compiles its share of the kernel
variants (the checks of tests/test_triton_compile.py, driven here, pytest or not), then warms
Triton's on-disk cache with its share of the numerics part's launches.

    python benchmarks/gpu_compile.py --shard 0/12                 # on the GPU machine
    python benchmarks/gpu_compile.py --shard 0/1 --checks none --warm sm90 --limit 6   # no GPU

Prints one JSON line: {"checks": {"passed": [...], "failed": {name: traceback}, "skipped": {...}},
"warm": {"cases": n, "compiled": n, "errors": {...}, "seconds": s}}. Exit code 1 if a check
failed; a warm-up error is reported, not fatal (the numerics part then compiles that kernel).

[Note: warm Triton cache]
A jitted kernel compiles at its first launch with each specialization: the constexprs, the
dtypes, and which integer arguments and pointers are multiples of 16 (or equal to 1). On a bare
machine the numerics part would compile about 150 of them inside its budget. The compile part
runs first, in parallel processes, and warms the cache with the numerics part's own cases
(`numerics_cases` in gpu_check.py, built from the same seeded inputs, so the same shapes,
offsets and dtypes) while every jitted kernel of overlap.kernels is replaced by its `warmup`: the
launcher binds the same arguments, computes the same key and compiles into the on-disk cache,
and launches nothing. The numerics part then finds each kernel on disk; it reports the cache
entries it still had to add (`triton_cache_new_entries`). The compile checks themselves cannot
warm it: they compile from explicit signatures with the integers unspecialized, other keys.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------
# the compile checks, without pytest


class _Skipped(Exception):
    pass


class _MonkeyPatch:
    """The part of pytest's monkeypatch fixture the compile checks use."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, target: Any, name: str, value: Any, raising: bool = True) -> None:
        if raising and not hasattr(target, name):
            raise AttributeError(f"{target!r} has no attribute {name!r}")
        old, had = getattr(target, name, None), hasattr(target, name)
        setattr(target, name, value)
        self._undo.append(lambda: setattr(target, name, old) if had else delattr(target, name))

    def setenv(self, name: str, value: str) -> None:
        old = os.environ.get(name)
        os.environ[name] = value
        self._undo.append(lambda: os.environ.pop(name) if old is None else os.environ.__setitem__(name, old))

    def delenv(self, name: str, raising: bool = True) -> None:
        if name in os.environ:
            old = os.environ.pop(name)
            self._undo.append(lambda: os.environ.__setitem__(name, old))
        elif raising:
            raise KeyError(name)

    def syspath_prepend(self, path: str) -> None:
        sys.path.insert(0, str(path))
        self._undo.append(lambda: sys.path.remove(str(path)))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def _pytest_stand_in() -> types.ModuleType:
    """What the compile checks import from pytest, where pytest is not installed: importorskip,
    skip, mark.parametrize (recorded as pytest records it, on `pytestmark`)."""
    module = types.ModuleType("pytest")

    def importorskip(name: str, reason: str | None = None, **_: Any) -> Any:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            raise _Skipped(reason or f"{name} is not installed") from e

    def skip(reason: str = "", allow_module_level: bool = False) -> None:
        raise _Skipped(reason)

    class _Mark(types.SimpleNamespace):
        pass

    def parametrize(argnames: str, argvalues: Any, ids: Any = None, **_: Any) -> Callable[[Any], Any]:
        def mark(fn: Any) -> Any:
            fn.pytestmark = [*getattr(fn, "pytestmark", []), _Mark(name="parametrize", args=(argnames, list(argvalues)), kwargs={"ids": ids})]
            return fn

        return mark

    module.importorskip = importorskip  # type: ignore[attr-defined]
    module.skip = skip  # type: ignore[attr-defined]
    module.mark = types.SimpleNamespace(parametrize=parametrize)  # type: ignore[attr-defined]
    module.MonkeyPatch = _MonkeyPatch  # type: ignore[attr-defined]
    return module


def load_compile_checks() -> types.ModuleType:
    """tests/test_triton_compile.py as a module (its variants sharded by OVERLAP_COMPILE_SHARD)."""
    if importlib.util.find_spec("pytest") is None:
        sys.modules["pytest"] = _pytest_stand_in()
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    return importlib.import_module("test_triton_compile")


def _calls(fn: Any) -> list[tuple[str, dict[str, Any]]]:
    """(id, keyword arguments) of each call pytest would make of a test function: the product of
    its parametrize marks (ids as given, else the values' reprs)."""
    calls: list[tuple[str, dict[str, Any]]] = [("", {})]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        argnames, argvalues = mark.args[0], list(mark.args[1])
        names = [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) else list(argnames)
        ids = mark.kwargs.get("ids")
        expanded = []
        for i, value in enumerate(argvalues):
            values = value if len(names) > 1 else (value,)
            label = str(ids[i]) if isinstance(ids, list | tuple) else "-".join(str(v) for v in values)
            for prefix, kw in calls:
                expanded.append((f"{prefix}-{label}" if prefix else label, {**kw, **dict(zip(names, values))}))
        calls = expanded
    return calls


def run_checks(which: str) -> dict[str, Any]:
    """The compile checks: "all" (every test of the file), "variants" (test_kernel_compiles of
    this process's share of the variants), "others" (every test but that one) or "none". A test
    asking for a fixture other than monkeypatch is skipped."""
    out: dict[str, Any] = {"passed": [], "failed": {}, "skipped": {}}
    if which == "none":
        return out
    out["pytest"] = "installed" if importlib.util.find_spec("pytest") is not None else "stand-in"
    try:
        module = load_compile_checks()
    except _Skipped as e:
        out["skipped"]["test_triton_compile"] = str(e)
        return out
    except Exception as e:  # noqa: BLE001  pytest's own Skipped (module level), or an import error
        if type(e).__name__ == "Skipped":
            out["skipped"]["test_triton_compile"] = str(e)
            return out
        raise
    tests = [(n, f) for n, f in vars(module).items() if n.startswith("test_") and inspect.isfunction(f)]
    if which != "all":
        tests = [(n, f) for n, f in tests if (n == "test_kernel_compiles") == (which == "variants")]
    for name, fn in tests:
        params = set(inspect.signature(fn).parameters)
        for label, kwargs in _calls(fn):
            where = f"{name}[{label}]" if label else name
            missing = params - set(kwargs) - {"monkeypatch"}
            if missing:
                out["skipped"][where] = f"needs fixtures {sorted(missing)}"
                continue
            patch = _MonkeyPatch()
            try:
                fn(**kwargs, **({"monkeypatch": patch} if "monkeypatch" in params else {}))
                out["passed"].append(where)
            except _Skipped as e:
                out["skipped"][where] = str(e)
            except Exception:  # noqa: BLE001  a failed check is this check's result
                out["failed"][where] = traceback.format_exc()[-1500:]
            finally:
                patch.undo()
    return out


# ---------------------------------------------------------------------------------------------
# the warm-up ([Note: warm Triton cache])


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


def load_gpu_check() -> types.ModuleType:
    """benchmarks/gpu_check.py as a module (not as a script: its environment stays as it is)."""
    if "gpu_check" in sys.modules:
        return sys.modules["gpu_check"]
    spec = importlib.util.spec_from_file_location("gpu_check", HERE / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


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
    gpu_check = load_gpu_check()
    on_gpu = where == "cuda"
    dev = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    cases, _skipped = gpu_check.numerics_cases(dev, False, {})
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
            except Exception as e:  # noqa: BLE001  that case's kernels compile in the numerics part
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
    args = parser.parse_args()
    index, count = (int(v) for v in args.shard.split("/"))
    # process 0 compiles the file's other checks (about as many kernels as a share of the
    # variants), processes 1..count-1 share the variants (test_triton_compile's own sharding)
    os.environ["OVERLAP_COMPILE_SHARD"] = f"{max(index - 1, 0)}/{max(count - 1, 1)}"
    os.environ.pop("TRITON_INTERPRET", None)  # compiled, never interpreted
    sys.path.insert(0, str(REPO))
    checks = run_checks(args.checks or ("all" if count == 1 else "others" if index == 0 else "variants"))
    try:
        warmed = warm(args.warm, index, count, args.limit, args.only)
    except Exception:  # noqa: BLE001  the numerics part then compiles cold; the checks stand
        warmed = {"error": traceback.format_exc()[-2000:]}
    print(json.dumps({"checks": checks, "warm": warmed}), flush=True)
    return 1 if checks["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
