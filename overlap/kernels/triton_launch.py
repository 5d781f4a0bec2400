"""How every Triton kernel of the package is launched: options, device, fp8 support.

[Note: Triton launches]
- `LAUNCH_OPTIONS` go to every launch, and tests/unit/test_triton_compile.py compiles every kernel
  variant with the same options. `enable_fp_fusion=False`: Triton contracts `a * b + c` into a
  fused multiply-add by default (3.9; its default changes in 3.10), which rounds once instead of
  twice, so the decode would no longer equal the torch reference bitwise. The quantize and copy
  kernels get it too, so that no future edit silently contracts an expression.
- Triton's launcher takes the *current* CUDA device and its current stream, whatever device the
  arguments are on. Every launch therefore runs under `on_device(t)` (`torch.cuda.device`), which
  switches the device but keeps that device's current stream: the runtime's
  `torch.cuda.stream(...)` context still decides the stream.
- fp8 (`tl.float8e4nv`) exists from sm_89 on (Ada, Hopper); below it Triton refuses to compile
  the fp8 variants, so the dispatch (quantize.py) sends fp8 to another backend there.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any

import torch

LAUNCH_OPTIONS: dict[str, Any] = {"num_warps": 4, "enable_fp_fusion": False}
FP8_MIN_CAPABILITY = (8, 9)  # tl.float8e4nv: Ada / Hopper and later

_capability: dict[int, tuple[int, int]] = {}


@functools.cache
def available() -> bool:
    """Whether Triton is installed; the package works without it (dispatch falls back). Asked of
    the installation, not by importing triton (~0.2 s that `import overlap` need not pay: the
    kernel modules import it when a kernel first runs)."""
    return importlib.util.find_spec("triton") is not None


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Make `t`'s CUDA device current for a launch (see [Note: Triton launches]); a no-op for
    CPU tensors (the interpreter)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of `device` (cached: a host query, no device work)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capability.get(index)
    if cap is None:
        cap = tuple(torch.cuda.get_device_capability(index))  # type: ignore[assignment]
        _capability[index] = cap  # type: ignore[assignment]
    return cap  # type: ignore[return-value]


def supports_fp8(device: torch.device) -> bool:
    """Whether the Triton fp8 kernels compile for `device` (sm_89 or later)."""
    return capability(device) >= FP8_MIN_CAPABILITY
