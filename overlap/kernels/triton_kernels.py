"""Triton kernels for blockwise quantize / dequantize(-accumulate) on CUDA.

One program per quantization block (the block size is the tile: a power of two). Same format
and same fp32 expressions as the torch reference ([Note: blockwise quantization format] in
reference.py): IEEE division (`div_rn`, not Triton's approximate `/`), round-half-even by the
1.5 * 2^23 trick, no fused multiply-add in the decode (launched with fp fusion off, see
[Note: Triton launches] in triton_launch.py), so results match the reference bitwise.

Tested on CPU under TRITON_INTERPRET=1 (int8/int4; the interpreter's fp32 -> fp8 cast is wrong,
so the fp8 path runs on a GPU only), and compiled for sm_90 and sm_80 by
tests/test_triton_compile.py, which checks what the interpreter cannot (globals, fusion, fp8
support per architecture).
"""

from __future__ import annotations

import torch

from overlap.kernels.reference import CodeFormat, code_numel, num_blocks_for, qmax_for
from overlap.kernels.triton_launch import LAUNCH_OPTIONS, available, on_device

try:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # the package works without triton: dispatch falls back
    triton = None
    tl = None

_FMT_FP8 = 1

__all__ = ["available", "dequantize_blockwise", "quantize_blockwise"]

if triton is not None:
    # A jitted function may read a global only if it is a constexpr (the compiler rejects plain
    # Python numbers; the interpreter does not notice).
    _ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + M) - M rounds |y| < 2^22 half-to-even

    @triton.jit
    def _quantize_kernel(
        x_ptr, noise_ptr, codes_ptr, scales_ptr, numel,
        QMAX: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
        FMT: tl.constexpr, STOCHASTIC: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * BLOCK
        # Even and odd elements separately: int4 packs them into one byte.
        half = tl.arange(0, BLOCK // 2)
        offs_e = start + 2 * half
        offs_o = offs_e + 1
        xe = tl.load(x_ptr + offs_e, mask=offs_e < numel, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + offs_o, mask=offs_o < numel, other=0.0).to(tl.float32)
        # |x| as int bits: one integer max finds the absmax and any Inf/NaN (>= 0x7f800000).
        be = xe.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        bo = xo.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        mb = tl.maximum(tl.max(be, axis=0), tl.max(bo, axis=0))
        finite = mb < 0x7F800000
        amax = mb.to(tl.float32, bitcast=True)
        scale = tl.math.div_rn(amax, QMAX)
        safe = tl.where(finite & (scale > 0.0), scale, 1.0)
        ye = tl.where(finite, tl.math.div_rn(xe, safe), 0.0)
        yo = tl.where(finite, tl.math.div_rn(xo, safe), 0.0)
        tl.store(scales_ptr + pid, tl.where(finite, scale, float("nan")))
        if FMT == 1:
            ce = tl.minimum(tl.maximum(ye, -QMAX), QMAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            co = tl.minimum(tl.maximum(yo, -QMAX), QMAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            tl.store(codes_ptr + offs_e, ce)
            tl.store(codes_ptr + offs_o, co)
        else:
            if STOCHASTIC:
                qe = tl.floor(ye + tl.load(noise_ptr + offs_e))
                qo = tl.floor(yo + tl.load(noise_ptr + offs_o))
            else:
                qe = (ye + _ROUND_MAGIC) - _ROUND_MAGIC
                qo = (yo + _ROUND_MAGIC) - _ROUND_MAGIC
            qe = tl.minimum(tl.maximum(qe, -QMAX), QMAX).to(tl.int32)
            qo = tl.minimum(tl.maximum(qo, -QMAX), QMAX).to(tl.int32)
            if BITS == 8:
                tl.store(codes_ptr + offs_e, qe.to(tl.int8))
                tl.store(codes_ptr + offs_o, qo.to(tl.int8))
            else:
                packed = (qe + 8) | ((qo + 8) << 4)
                tl.store(codes_ptr + start // 2 + half, packed.to(tl.uint8))

    @triton.jit
    def _dequantize_kernel(
        codes_ptr, scales_ptr, out_ptr, numel,
        BLOCK: tl.constexpr, BITS: tl.constexpr, FMT: tl.constexpr, ACCUMULATE: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * BLOCK
        half = tl.arange(0, BLOCK // 2)
        offs_e = start + 2 * half
        offs_o = offs_e + 1
        me = offs_e < numel
        mo = offs_o < numel
        s = tl.load(scales_ptr + pid)
        if FMT == 1:
            ve = tl.load(codes_ptr + offs_e).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            vo = tl.load(codes_ptr + offs_o).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif BITS == 8:
            ve = tl.load(codes_ptr + offs_e).to(tl.float32)
            vo = tl.load(codes_ptr + offs_o).to(tl.float32)
        else:
            byte = tl.load(codes_ptr + start // 2 + half).to(tl.int32)
            ve = ((byte & 0xF) - 8).to(tl.float32)
            vo = ((byte >> 4) - 8).to(tl.float32)
        de = ve * s
        do = vo * s
        if ACCUMULATE:
            de = tl.load(out_ptr + offs_e, mask=me).to(tl.float32) + de
            do = tl.load(out_ptr + offs_o, mask=mo).to(tl.float32) + do
        tl.store(out_ptr + offs_e, _cast_out(de, out_ptr.dtype.element_ty), mask=me)
        tl.store(out_ptr + offs_o, _cast_out(do, out_ptr.dtype.element_ty), mask=mo)

    @triton.jit
    def _cast_out(v, ty: tl.constexpr):
        # fp32 -> bf16 round-half-even done on the bits: the GPU cast already does this, but the
        # interpreter truncates, and this keeps one definition that both can be tested against.
        # A NaN becomes bf16's quiet NaN: rounding the bits of NVIDIA's canonical NaN (0x7FFFFFFF,
        # what any arithmetic on a NaN scale gives) would carry into the sign bit: -0.0.
        if ty == tl.bfloat16:
            b = v.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            b = tl.where(v != v, 0x7FC0, b)
            return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(ty)


def _check(t: torch.Tensor, what: str, block: int) -> None:
    if triton is None:
        raise RuntimeError("overlap.kernels.triton_kernels: triton is not installed")
    if not t.is_contiguous():
        raise ValueError(f"overlap triton kernels: {what} must be contiguous")
    if block < 2 or block & (block - 1):
        raise ValueError(f"overlap triton kernels: block must be a power of two >= 2, got {block}")


def quantize_blockwise(
    x: torch.Tensor, bits: int, block: int, *, fmt: CodeFormat = "int", noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat contiguous `x` -> (codes, scales); `noise` (num_blocks * block uniforms) rounds stochastically."""
    _check(x, "x", block)
    numel = x.numel()
    nb = num_blocks_for(numel, block)
    code_dtype = torch.int8 if bits == 8 and fmt == "int" else torch.uint8
    codes = torch.empty(code_numel(numel, bits, block), dtype=code_dtype, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if nb == 0:
        return codes, scales
    if noise is not None:
        _check(noise, "noise", block)
    with on_device(x):
        _quantize_kernel[(nb,)](
            x, noise if noise is not None else x, codes, scales, numel,
            QMAX=qmax_for(bits, fmt), BLOCK=block, BITS=bits,
            FMT=_FMT_FP8 if fmt == "fp8" else 0, STOCHASTIC=noise is not None, **LAUNCH_OPTIONS,
        )  # fmt: skip
    return codes, scales


def dequantize_blockwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    out: torch.Tensor,
    accumulate: bool = False,
    *,
    fmt: CodeFormat = "int",
) -> torch.Tensor:
    """Decode into `out` (flat, contiguous), or add into it with the sum in fp32."""
    _check(codes, "codes", block)
    _check(out, "out", block)
    nb = num_blocks_for(numel, block)
    if nb:
        with on_device(out):
            _dequantize_kernel[(nb,)](
                codes, scales, out, numel,
                BLOCK=block, BITS=bits, FMT=_FMT_FP8 if fmt == "fp8" else 0, ACCUMULATE=accumulate,
                **LAUNCH_OPTIONS,
            )  # fmt: skip
    return out
