"""Blockwise quantize / dequantize(-accumulate): checked wrappers that dispatch to a backend.

Backends, fastest first: Triton on CUDA tensors (when triton imports), the C++ extension on CPU
tensors (built at first use, see [Note: just-in-time C++ build] in cpu.py), else the torch
reference (`reference.py`), which defines the format ([Note: blockwise quantization format]).
`backend=` forces one ("ref", "cpp", "triton") for tests and benchmarks.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch

from overlap.kernels import cpu, triton_launch
from overlap.kernels.reference import (
    CodeFormat,
    code_numel,
    dequantize_blockwise_ref,
    num_blocks_for,
    quantize_blockwise_ref,
)

Backend = Literal["auto", "ref", "cpp", "triton"]
_FMT_ID = {"int": 0, "fp8": 1}


def _check_format(bits: int, block: int, fmt: CodeFormat, stochastic: bool) -> None:
    if fmt not in _FMT_ID:
        raise ValueError(f"overlap.kernels: fmt must be 'int' or 'fp8', got {fmt!r}")
    if bits not in (4, 8) or (fmt == "fp8" and bits != 8):
        raise ValueError(f"overlap.kernels: bits must be 8 or 4 (int only), got bits={bits} fmt={fmt!r}")
    if not isinstance(block, int) or block <= 0 or (bits == 4 and block % 2):
        raise ValueError(f"overlap.kernels: block must be a positive int (even for 4 bits), got {block!r}")
    if stochastic and fmt == "fp8":
        raise ValueError("overlap.kernels: stochastic rounding is available for int formats only")


def _extension() -> Any:
    """The C++ ops, for backend "cpp"."""
    ext = cpu.load_extension()
    if ext is None:
        raise RuntimeError("overlap.kernels: backend='cpp' requested but the extension is not built")
    return ext


def _noise(x: torch.Tensor, block: int, stochastic: bool, generator: torch.Generator | None) -> torch.Tensor | None:
    """Stochastic rounding's uniforms for the flat `x`: `num_blocks * block` draws from
    `generator`, the same draw for every backend (None for round-to-nearest)."""
    if not stochastic:
        return None
    nb = num_blocks_for(x.numel(), block)
    return torch.rand(nb * block, generator=generator, device=x.device, dtype=torch.float32)


def _triton_usable(device: torch.device, block: int) -> bool:
    if device.type != "cuda" or block & (block - 1):  # Triton tiles are powers of two
        return False
    return triton_launch.available()


_fp8_fallback_warned: set[torch.device] = set()


def select_backend(device: torch.device, block: int, backend: Backend = "auto", *, fmt: CodeFormat = "int") -> Backend:
    """The backend `quantize_blockwise` / `dequantize_blockwise` use for `fmt` codes on `device`.

    fp8 on a GPU below sm_89 (e.g. A100) cannot use Triton ([Note: Triton launches] in
    triton_launch.py): "auto" picks the torch reference there, after one warning per device."""
    if backend != "auto":
        fp8_on_cuda = fmt == "fp8" and device.type == "cuda"
        if backend == "triton" and fp8_on_cuda and not triton_launch.supports_fp8(device):
            raise ValueError(
                f"overlap.kernels: backend='triton' has no fp8 kernel for {device} (compute capability "
                f"{triton_launch.capability(device)} < {triton_launch.FP8_MIN_CAPABILITY}); use backend='auto'"
            )
        return backend
    if device.type == "cuda":
        if not _triton_usable(device, block):
            return "ref"
        if fmt == "fp8" and not triton_launch.supports_fp8(device):
            if device not in _fp8_fallback_warned:
                _fp8_fallback_warned.add(device)
                warnings.warn(
                    f"overlap: {device} (compute capability {triton_launch.capability(device)}) has no fp8 "
                    "Triton kernels (sm_89+ only); fp8 codes use the slower torch reference there",
                    stacklevel=3,
                )
            return "ref"
        return "triton"
    if device.type == "cpu" and cpu.load_extension() is not None:
        return "cpp"
    return "ref"


def quantize_blockwise(x: torch.Tensor, bits: int, block: int, stochastic: bool = False,
                       generator: torch.Generator | None = None, *, fmt: CodeFormat = "int", backend: Backend = "auto",
                       noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Quantize `x` (any shape, read flat) blockwise -> (codes, fp32 scales).

    Stochastic rounding draws `num_blocks * block` uniforms from `generator` (on x's device);
    every backend consumes the same draw, so results are reproducible across backends. `noise`
    (those uniforms, fp32) replaces the draw.
    """
    _check_format(bits, block, fmt, stochastic)
    if not x.is_floating_point():
        raise TypeError(f"overlap.kernels.quantize_blockwise: x must be floating, got {x.dtype}")
    x = x.contiguous().view(-1)
    noise = _noise(x, block, stochastic, generator) if noise is None else noise
    chosen = select_backend(x.device, block, backend, fmt=fmt)
    if chosen == "cpp":
        return _extension().quantize_blockwise(x, bits, block, _FMT_ID[fmt], noise)
    if chosen == "triton":
        from overlap.kernels import triton_kernels

        return triton_kernels.quantize_blockwise(x, bits, block, fmt=fmt, noise=noise)
    return quantize_blockwise_ref(x, bits, block, stochastic, fmt=fmt, noise=noise)


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int,
                         out: torch.Tensor | None = None, accumulate: bool = False, *, fmt: CodeFormat = "int",
                         backend: Backend = "auto") -> torch.Tensor:  # fmt: skip
    """Decode the first `numel` elements into `out` (new fp32 if None); `accumulate` adds into it
    (sum in fp32, stored in out's dtype). Returns `out`."""
    _check_format(bits, block, fmt, False)
    nb = num_blocks_for(numel, block)
    if codes.numel() != code_numel(numel, bits, block) or scales.numel() != nb:
        raise ValueError(
            f"overlap.kernels.dequantize_blockwise: {codes.numel()} codes / {scales.numel()} scales "
            f"do not match numel={numel}, bits={bits}, block={block}"
        )
    if out is None:
        if accumulate:
            raise ValueError("overlap.kernels.dequantize_blockwise: accumulate=True needs `out`")
        out = torch.empty(numel, dtype=torch.float32, device=codes.device)
    elif out.numel() != numel or not out.is_contiguous() or not out.is_floating_point():
        raise ValueError("overlap.kernels.dequantize_blockwise: out must be contiguous, floating, numel elements")
    codes = codes.contiguous()
    scales = scales.contiguous().float()
    chosen = select_backend(codes.device, block, backend, fmt=fmt)
    if chosen == "cpp":
        _extension().dequantize_blockwise(codes, scales, bits, block, numel, out, accumulate, _FMT_ID[fmt])
        return out
    if chosen == "triton":
        from overlap.kernels import triton_kernels

        return triton_kernels.dequantize_blockwise(codes, scales, bits, block, numel, out, accumulate, fmt=fmt)
    return dequantize_blockwise_ref(codes, scales, bits, block, numel, out, accumulate, fmt)


def quantize_feedback_blockwise(x: torch.Tensor, residual: torch.Tensor, bits: int, block: int,
                                stochastic: bool = False, generator: torch.Generator | None = None, *,
                                fmt: CodeFormat = "int", backend: Backend = "auto",
                                noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Error feedback in one call: quantize `x + residual` blockwise -> (codes, fp32 scales) and
    set `residual` (contiguous fp32, x's numel) to what the codes dropped, in place:
    `decode(codes) + residual == x + old residual` in fp32, exactly for round-to-nearest.

    The C++ and Triton backends fuse the four passes (add, quantize, decode, subtract) into one
    pass over memory, block by block; the reference is their composition, which computes the
    same fp32 values. `noise` as in `quantize_blockwise`.
    """
    _check_format(bits, block, fmt, stochastic)
    if residual.dtype != torch.float32 or residual.numel() != x.numel() or not residual.is_contiguous():
        raise ValueError(
            "overlap.kernels.quantize_feedback_blockwise: residual must be contiguous fp32 with "
            f"x's {x.numel()} elements, got {residual.dtype} shape {tuple(residual.shape)}"
        )
    x = x.contiguous().view(-1)
    target = residual.view(-1)
    chosen = select_backend(x.device, block, backend, fmt=fmt)
    if chosen in ("cpp", "triton"):
        noise = _noise(x, block, stochastic, generator) if noise is None else noise
        if chosen == "triton":
            from overlap.kernels import triton_kernels

            return triton_kernels.quantize_feedback_blockwise(x, target, bits, block, fmt=fmt, noise=noise)
        return _extension().quantize_feedback_blockwise(x, target, bits, block, _FMT_ID[fmt], noise)
    target.add_(x)  # x + r == r + x in IEEE arithmetic
    codes, scales = quantize_blockwise(target, bits, block, stochastic, generator, fmt=fmt, backend=chosen, noise=noise)
    decoded = dequantize_blockwise(codes, scales, bits, block, x.numel(), fmt=fmt, backend=chosen)
    finite_residual(torch.sub(target, decoded, out=target))
    return codes, scales


def finite_residual(residual: torch.Tensor) -> torch.Tensor:
    """Set the non-finite elements of an error-feedback residual to 0, in place: what a
    non-finite block (or a NaN element, bf16) dropped is unknown, and a NaN kept would come back
    in every later step ([Note: error feedback residual] in compression/feedback.py)."""
    return residual.masked_fill_(~torch.isfinite(residual), 0.0)


def quantize_feedback_int8res_blockwise(x: torch.Tensor, res_codes: torch.Tensor, res_scales: torch.Tensor, bits: int,
                                        block: int, stochastic: bool = False, generator: torch.Generator | None = None,
                                        *, fmt: CodeFormat = "int", backend: Backend = "auto",
                                        noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Error feedback with the residual kept as int8 blockwise codes (same `block`): quantize
    `x + decode(res_codes, res_scales)` -> (codes, fp32 scales) and re-encode what the codes
    dropped into `res_codes` / `res_scales`, in place. Defined as the composition below
    (`dequantize_blockwise`, `quantize_feedback_blockwise`, `quantize_blockwise`, which
    `Int8Residual` in compression/feedback.py ran before); the C++ and Triton backends compute
    the same fp32 operations block by block, so the same bits, with no full-size fp32
    temporaries. `noise` as in `quantize_blockwise`.
    """
    _check_format(bits, block, fmt, stochastic)
    numel = x.numel()
    nb = num_blocks_for(numel, block)
    if (
        res_codes.dtype != torch.int8
        or res_codes.numel() != code_numel(numel, 8, block)
        or not res_codes.is_contiguous()
        or res_scales.dtype != torch.float32
        or res_scales.numel() != nb
        or not res_scales.is_contiguous()
    ):
        raise ValueError(
            "overlap.kernels.quantize_feedback_int8res_blockwise: the residual must be contiguous int8 "
            f"codes ({code_numel(numel, 8, block)}) and fp32 scales ({nb}) for {numel} elements in "
            f"blocks of {block}, got {res_codes.dtype} {tuple(res_codes.shape)} / {res_scales.dtype} "
            f"{tuple(res_scales.shape)}"
        )
    x = x.contiguous().view(-1)
    chosen = select_backend(x.device, block, backend, fmt=fmt)
    if chosen in ("cpp", "triton"):
        noise = _noise(x, block, stochastic, generator) if noise is None else noise
        if chosen == "triton":
            from overlap.kernels import triton_kernels

            residual_codes = (res_codes, res_scales)
            return triton_kernels.quantize_feedback_blockwise(x, residual_codes, bits, block, fmt=fmt, noise=noise)
        return _extension().quantize_feedback_int8res_blockwise(
            x, res_codes, res_scales, bits, block, _FMT_ID[fmt], noise
        )
    residual = dequantize_blockwise(res_codes, res_scales, 8, block, numel, backend=chosen)
    codes, scales = quantize_feedback_blockwise(
        x, residual, bits, block, stochastic, generator, fmt=fmt, backend=chosen, noise=noise
    )
    new_codes, new_scales = quantize_blockwise(residual, 8, block, backend=chosen)
    res_codes.copy_(new_codes.view(res_codes.shape))
    res_scales.copy_(new_scales.view(res_scales.shape))
    return codes, scales
