"""The C++ CPU extension (`csrc/quantize.cpp`, `csrc/copy.cpp`, `csrc/reduce.cpp`), built just in time at first use and cached.

[Note: just-in-time C++ build]
`setup.py` never imports torch (pip's build isolation would need a second torch), so the
extension is compiled by `torch.utils.cpp_extension.load` the first time a CPU kernel runs. The
build lands in `$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`) and later processes,
ranks included, load it from there (cpp_extension takes a file lock, so concurrent ranks build
once). Any failure - no compiler, no ninja, a compile error - makes `load_extension()` return
None with one warning, and the torch reference runs instead. `OVERLAP_NO_EXT=1` skips the build.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

_CSRC = Path(__file__).resolve().parents[2] / "csrc"
# -ffp-contract=off: no fused multiply-add, so results stay bitwise equal to the torch reference;
# -fno-trapping-math lets the float clamps vectorise (results unchanged: no FP traps are used).
_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]

_lock = threading.Lock()
_module: Any | None = None  # the torch.ops.overlap_cpu namespace once loaded
_tried = False
build_seconds: float | None = None
"""Wall time of the load (compile or cache hit) in this process; None until attempted."""


def source_paths() -> list[Path]:
    """The extension's sources: one module, ops registered under torch.ops.overlap_cpu."""
    return [_CSRC / "quantize.cpp", _CSRC / "copy.cpp", _CSRC / "reduce.cpp"]


def load_extension() -> Any | None:
    """The compiled module, building it once per machine; None (after one warning) if unavailable."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _module = _build()
        _tried = True
    return _module


def _build() -> Any | None:
    global build_seconds
    if os.environ.get("OVERLAP_NO_EXT", "") not in ("", "0"):
        return None
    sources = source_paths()
    missing = [src for src in sources if not src.is_file()]
    if missing:
        warnings.warn(
            f"overlap: C++ kernel source {missing[0]} not found (installed without csrc/?); "
            "using the torch reference kernels",
            stacklevel=3,
        )
        return None
    try:
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not installed (`pip install ninja`)")
        start = time.perf_counter()
        build_dir = _build_dir(cpp_extension)
        if build_dir is None or not _is_built(build_dir):
            print("overlap: compiling CPU kernels (once)…", file=sys.stderr, flush=True)
        cpp_extension.load(
            name="overlap_cpu_kernels",
            sources=[str(src) for src in sources],
            extra_cflags=_CFLAGS,
            build_directory=None if build_dir is None else str(build_dir),
            is_python_module=False,  # registers torch.ops.overlap_cpu.* (TORCH_LIBRARY)
            verbose=False,
        )
        build_seconds = time.perf_counter() - start
        return torch.ops.overlap_cpu
    except Exception as exc:  # noqa: BLE001  # any build/load failure: fall back, never break
        warnings.warn(
            f"overlap: could not build the C++ CPU kernels ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); "
            "using the slower torch reference kernels. Set OVERLAP_NO_EXT=1 to silence this.",
            stacklevel=3,
        )
        return None


def _build_dir(cpp_extension: ModuleType) -> Path | None:
    """Where cpp_extension builds (honours TORCH_EXTENSIONS_DIR); None if torch hides it."""
    get = getattr(cpp_extension, "_get_build_directory", None)  # private, present in 2.11-2.13
    if get is None:
        return None
    root = Path(get("overlap_cpu_kernels", verbose=False))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _is_built(build_dir: Path) -> bool:
    # A cheap guess for the message only: cpp_extension itself decides whether to rebuild.
    sos = list(build_dir.glob("overlap_cpu_kernels*.so"))
    newest = max(src.stat().st_mtime for src in source_paths())
    return bool(sos) and all(so.stat().st_mtime >= newest for so in sos)
