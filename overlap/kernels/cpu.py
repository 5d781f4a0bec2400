"""The C++ CPU extension (`csrc/quantize.cpp`, `csrc/copy.cpp`, `csrc/reduce.cpp`, `csrc/shm.cpp`,
`csrc/pool.cpp`), built just in time at first use and cached.

[Note: just-in-time C++ build]
`setup.py` never imports torch (pip's build isolation would need a second torch), so the
extension is compiled by `torch.utils.cpp_extension.load` the first time a CPU kernel runs. The
build is keyed by what it depends on (`build_key()`: torch's version, Python's, the compiler and
its version, the flags and the sources' bytes) and lands in its own folder under
`$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), so two environments or two
checkouts never rebuild each other's build: each finds its own, or an identical one. A folder that
already holds the module is loaded directly (no ninja run); otherwise cpp_extension compiles it
under a lock that a killed build cannot leave held ([Note: a build killed midway]), so concurrent
ranks build once, and the wait is announced on stderr with its reason and then its duration. Any failure - no compiler, no ninja, a compile error - makes
`load_extension()` return None with one warning, and the torch reference runs instead.
`OVERLAP_NO_EXT=1` skips the build.

[Note: a build killed midway]
cpp_extension serializes builders with a lock *file* in the build folder (its `FileBaton`): a
build killed midway (Ctrl-C, a job's time limit, a rank taken down with its world) leaves that
file behind, and every later build waits on it forever. So the compile runs under an `flock` of
`overlap.flock` in the same folder, which the kernel releases when its holder exits, however it
exits: whoever holds it is the only overlap process building there, so a `lock` file it finds is
stale and is removed before cpp_extension runs. Ranks that start together still build once: the
others wait on the flock (announced on stderr) and then find `built.ok`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_CSRC = Path(__file__).resolve().parents[2] / "csrc"
# -ffp-contract=off: no fused multiply-add, so results stay bitwise equal to the torch reference;
# -fno-trapping-math lets the float clamps vectorise (results unchanged: no FP traps are used).
_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]

_DONE = "built.ok"  # written once the module has built and loaded
_lock = threading.Lock()
_module: Any | None = None  # the torch.ops.overlap_cpu namespace once loaded
_tried = False
build_seconds: float | None = None
"""Wall time of the load (compile or cache hit) in this process; None until attempted."""


def source_paths() -> list[Path]:
    """The extension's sources: one module, ops registered under torch.ops.overlap_cpu."""
    return [_CSRC / name for name in ("quantize.cpp", "copy.cpp", "reduce.cpp", "shm.cpp", "pool.cpp")]


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


def build_key() -> str:
    """A hash of everything the compiled module depends on ([Note: just-in-time C++ build])."""
    digest = hashlib.sha256()
    parts = [torch.__version__, sys.version, platform.machine(), _compiler_id(), " ".join(_CFLAGS)]
    for part in parts:
        digest.update(part.encode() + b"\0")
    for src in source_paths():
        digest.update(src.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def module_name() -> str:
    """The extension's name, and so its build folder's: `overlap_cpu_kernels_<build_key()>`."""
    return f"overlap_cpu_kernels_{build_key()}"


def _compiler_id() -> str:
    """The C++ compiler cpp_extension will call (`$CXX`, else `c++`) and its version line."""
    cxx = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
        first = done.stdout.splitlines()[0] if done.stdout else ""
    except (OSError, subprocess.SubprocessError):
        first = "unavailable"
    return f"{cxx}: {first}"


def _say(message: str) -> None:
    # One line per machine, not one per rank: spawned and torchrun ranks set LOCAL_RANK.
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


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

        start = time.perf_counter()
        name = module_name()
        build_dir = _build_root() / name
        built, done = build_dir / f"{name}.so", build_dir / _DONE
        compiled = False
        if not (done.is_file() and built.is_file()):  # keyed by sources and toolchain: nothing to check
            if not cpp_extension.is_ninja_available():
                raise RuntimeError("ninja is not installed (`pip install ninja`)")

            def compile_module() -> None:
                _say(
                    f"overlap: compiling the C++ CPU kernels for torch {torch.__version__} into "
                    f"{build_dir} (once per torch, compiler and source version; 20-60 s)…"
                )
                cpp_extension.load(
                    name=name,
                    sources=[str(src) for src in sources],
                    extra_cflags=_CFLAGS,
                    build_directory=str(build_dir),
                    is_python_module=False,  # registers torch.ops.overlap_cpu.* (TORCH_LIBRARY)
                    verbose=False,
                )
                _say(f"overlap: C++ CPU kernels ready ({time.perf_counter() - start:.0f} s)")

            compiled = build_once(_mkdir(build_dir), done, compile_module)
        if not compiled:  # cpp_extension.load loads what it compiled; a cached or another rank's build is loaded here
            torch.ops.load_library(str(built))
        build_seconds = time.perf_counter() - start
        return torch.ops.overlap_cpu
    except Exception as exc:  # any build/load failure: fall back, never break
        warnings.warn(
            f"overlap: could not build the C++ CPU kernels ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); "
            "using the slower torch reference kernels. Set OVERLAP_NO_EXT=1 to silence this.",
            stacklevel=3,
        )
        return None


def build_once(build_dir: Path, done: Path, compile_module: Callable[[], None]) -> bool:
    """Run `compile_module` unless `done` exists, holding an exclusive `flock` on
    `build_dir / "overlap.flock"` ([Note: a build killed midway]); write `done` after it. True if
    this process compiled."""
    with open(build_dir / "overlap.flock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = time.perf_counter()
            _say(f"overlap: waiting for another process building the C++ CPU kernels in {build_dir}…")
            fcntl.flock(handle, fcntl.LOCK_EX)
            _say(f"overlap: waited {time.perf_counter() - waited:.0f} s for the C++ CPU kernels' build")
        try:
            if done.is_file():  # built while this process waited
                return False
            (build_dir / "lock").unlink(missing_ok=True)  # cpp_extension's baton, left by a killed build
            compile_module()
            done.write_text(f"{time.time()}\n")  # after the link: a reader never sees half a .so
            return True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_root() -> Path:
    """`$TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions` (cpp_extension's own default)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "torch_extensions"


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
