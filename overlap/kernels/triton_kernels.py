"""Triton kernels for blockwise quantize / dequantize(-accumulate) on CUDA, many rows per launch.

Same format and same fp32 expressions as the torch reference ([Note: blockwise quantization
format] and [Note: kernel numerics across devices] in reference.py): IEEE division (`div_rn`,
not Triton's approximate `/`), round-half-even by the 1.5 * 2^23 trick, no fused multiply-add
(launched with fp fusion off, see [Note: Triton launches] in triton_launch.py), so results equal
the reference bitwise.

[Note: rows per launch]
A compressed reduce-scatter encodes `world_size - 1` rows of a bucket and decodes as many; the
per-row path was about six small kernels per row. Here each op is one launch for
all rows: a 2-D grid (block groups x rows), a program covering `BLOCKS` quantization blocks of
one row (a tile of about `TILE_NUMEL` elements: one 256-element block per 4-warp program left
the GPU latency-bound). Rows are addressed by a row stride, so the encode writes straight into
the wire buffer's rows and the decode reads them there (no `to_bytes` copies). `skip` leaves one
row out (this rank's own, which never travels); the encode counts non-finite blocks into a
device counter with one atomic add per program that found any ([Note: deferred finite check] in
compression/finite.py), and can run error feedback in the same pass (`RESIDUAL`: a dense
residual in fp32 or bf16, or int8 codes and scales, as the C++ kernels do); the decode-sum adds
the rows in rank order in fp32 registers, this rank's own row in its place, as the reference
loop `out += decode(row)` does. `encode_rows` / `decode_rows` / `decode_sum_rows` in rows.py
define each launch as a loop over the single-row ops.

Tested on CPU under TRITON_INTERPRET=1 (int8/int4; the interpreter's fp32 -> fp8 cast is wrong,
so the fp8 path runs on a GPU only), and compiled for sm_90 and sm_80 by
tests/unit/test_triton_compile.py, which checks what the interpreter cannot (globals, fusion, fp8
support per architecture).
"""

from __future__ import annotations

import torch

from overlap.kernels.reference import CodeFormat, Residual, code_numel, num_blocks_for, qmax_for
from overlap.kernels.triton_launch import LAUNCH_OPTIONS, available, on_device

try:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # the package works without triton: dispatch falls back
    triton = None
    tl = None

_FMT_FP8 = 1
RESIDUAL_NONE, RESIDUAL_DENSE, RESIDUAL_INT8 = 0, 1, 2
TILE_NUMEL = 2048  # elements per program: BLOCKS = TILE_NUMEL // block blocks (at least one)

__all__ = ["available", "decode_rows", "decode_sum_rows", "dequantize_blockwise", "encode_rows", "quantize_blockwise"]

if triton is not None:
    # A jitted function may read a global only if it is a constexpr (the compiler rejects plain
    # Python numbers; the interpreter does not notice).
    _ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + M) - M rounds |y| < 2^22 half-to-even
    _INF_BITS = tl.constexpr(0x7F800000)  # |x| as int bits at or above this: Inf or NaN

    @triton.jit
    def _scale_of(x, QMAX: tl.constexpr):
        """Per row of the tile: (scale, divisor, finite), as the reference computes them. |x| as
        int bits: one integer max finds the absmax and any Inf/NaN (>= 0x7f800000)."""
        mb = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        finite = mb < _INF_BITS
        scale = tl.math.div_rn(mb.to(tl.float32, bitcast=True), QMAX)
        safe = tl.where(finite & (scale > 0.0), scale, 1.0)
        return scale, safe, finite

    @triton.jit
    def _code_values(codes_ptr, blk, mask, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, BITS: tl.constexpr,
                     FMT: tl.constexpr):  # fmt: skip
        """The fp32 values (before scaling) of the codes of blocks `blk`, a [BLOCKS, BLOCK] tile."""
        if BITS == 4:
            half = tl.arange(0, BLOCK // 2)
            byte = tl.load(codes_ptr + blk[:, None] * (BLOCK // 2) + half[None, :], mask=mask[:, None], other=0)
            byte = byte.to(tl.int32)
            lo = ((byte & 0xF) - 8).to(tl.float32)
            hi = ((byte >> 4) - 8).to(tl.float32)
            return tl.reshape(tl.join(lo, hi), [BLOCKS, BLOCK])  # element 2i low nibble, 2i+1 high
        else:
            cols = tl.arange(0, BLOCK)
            c = tl.load(codes_ptr + blk[:, None] * BLOCK + cols[None, :], mask=mask[:, None], other=0)
            if FMT == 1:
                return c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                return c.to(tl.float32)

    @triton.jit
    def _encode_kernel(
        x_ptr, x_stride, noise_ptr, noise_stride, codes_ptr, codes_stride, scales_ptr, scales_stride,
        res_ptr, res_stride, res_scales_ptr, res_scales_stride, count_ptr, numel, num_blocks, skip,
        QMAX: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, BITS: tl.constexpr, FMT: tl.constexpr,
        STOCHASTIC: tl.constexpr, RESIDUAL: tl.constexpr, COUNT: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(1)  # the r-th encoded row: residual and noise row r
        row = (r + (r >= skip).to(tl.int32)).to(tl.int64)  # the row of x and of the codes
        r = r.to(tl.int64)
        blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        blk_ok = blk < num_blocks
        offs = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        valid = offs < numel  # padding reads as 0, as the reference pads
        x = tl.load(x_ptr + row * x_stride + offs, mask=valid, other=0.0).to(tl.float32)
        if RESIDUAL == 1:  # x + residual (the reference adds x into the residual: r + x, the same)
            x = x + tl.load(res_ptr + r * res_stride + offs, mask=valid, other=0.0).to(tl.float32)
        elif RESIDUAL == 2:  # the int8 residual decoded (numel elements, padding 0), then + x
            rs = tl.load(res_scales_ptr + r * res_scales_stride + blk, mask=blk_ok, other=0.0)
            rv = _code_values(res_ptr + r * res_stride, blk, blk_ok, BLOCK, BLOCKS, 8, 0)
            x = tl.where(valid, rv * rs[:, None], 0.0) + x
        scale, safe, finite = _scale_of(x, QMAX)
        y = tl.where(finite[:, None], tl.math.div_rn(x, safe[:, None]), 0.0)
        scale = tl.where(finite, scale, float("nan"))
        tl.store(scales_ptr + row * scales_stride + blk, scale, mask=blk_ok)
        out = codes_ptr + row * codes_stride
        if FMT == 1:
            q8 = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(tl.float8e4nv)
            tl.store(out + offs, q8.to(tl.uint8, bitcast=True), mask=blk_ok[:, None])
            q = q8.to(tl.float32)
        else:
            if STOCHASTIC:
                noise = tl.load(noise_ptr + r * noise_stride + offs, mask=blk_ok[:, None], other=0.0)
                v = y + noise
                # Triton lowers floor to `cvt.rmi.ftz`: a negative denormal (y denormal, noise 0)
                # would floor to -0, not -1 as torch.floor does.
                q = tl.floor(v)
                q = tl.where((v < 0.0) & (q == 0.0), -1.0, q)
            else:
                q = (y + _ROUND_MAGIC) - _ROUND_MAGIC
            q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
            qi = q.to(tl.int32)
            if BITS == 8:
                tl.store(out + offs, qi.to(tl.int8), mask=blk_ok[:, None])
            else:
                lo, hi = tl.split(tl.reshape(qi + 8, [BLOCKS, BLOCK // 2, 2]))
                half = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
                tl.store(out + half, (lo | (hi << 4)).to(tl.uint8), mask=blk_ok[:, None])
        if RESIDUAL != 0:  # what the codes dropped: x - decode(codes); 0 across a non-finite block
            dropped = x - q * scale[:, None]
            dropped = tl.where(dropped - dropped == 0.0, dropped, 0.0)  # [Note: error feedback residual]
            if RESIDUAL == 1:
                tl.store(res_ptr + r * res_stride + offs, _cast_out(dropped, res_ptr.dtype.element_ty), mask=valid)
            else:  # re-encoded as int8, round-to-nearest, in the same blocks (padding 0)
                dropped = tl.where(valid, dropped, 0.0)
                rscale, rsafe, rfinite = _scale_of(dropped, 127.0)
                ry = tl.where(rfinite[:, None], tl.math.div_rn(dropped, rsafe[:, None]), 0.0)
                rq = tl.minimum(tl.maximum((ry + _ROUND_MAGIC) - _ROUND_MAGIC, -127.0), 127.0)
                tl.store(res_ptr + r * res_stride + offs, rq.to(tl.int32).to(tl.int8), mask=blk_ok[:, None])
                tl.store(res_scales_ptr + r * res_scales_stride + blk, tl.where(rfinite, rscale, float("nan")),
                         mask=blk_ok)  # fmt: skip
        if COUNT:
            bad = tl.sum((blk_ok & (finite == 0)).to(tl.int64), axis=0)
            tl.atomic_add(count_ptr, bad, mask=bad > 0)

    @triton.jit
    def _decode_kernel(
        codes_ptr, codes_stride, scales_ptr, scales_stride, out_ptr, out_stride, count_ptr, numel, num_blocks,
        BLOCK: tl.constexpr, BLOCKS: tl.constexpr, BITS: tl.constexpr, FMT: tl.constexpr,
        ACCUMULATE: tl.constexpr, COUNT: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(1).to(tl.int64)
        blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        blk_ok = blk < num_blocks
        offs = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        valid = offs < numel
        s = tl.load(scales_ptr + row * scales_stride + blk, mask=blk_ok, other=0.0)
        d = _code_values(codes_ptr + row * codes_stride, blk, blk_ok, BLOCK, BLOCKS, BITS, FMT) * s[:, None]
        out = out_ptr + row * out_stride + offs
        if ACCUMULATE:
            d = tl.load(out, mask=valid, other=0.0).to(tl.float32) + d
        tl.store(out, _cast_out(d, out_ptr.dtype.element_ty), mask=valid)
        if COUNT:
            bad = tl.sum((blk_ok & (s != s)).to(tl.int64), axis=0)
            tl.atomic_add(count_ptr, bad, mask=bad > 0)

    @triton.jit
    def _decode_sum_kernel(
        codes_ptr, codes_stride, scales_ptr, scales_stride, own_ptr, out_ptr, numel, num_blocks, num_rows,
        skip, gap, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, BITS: tl.constexpr, FMT: tl.constexpr,
    ):  # fmt: skip
        blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        blk_ok = blk < num_blocks
        offs = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        valid = offs < numel
        own = tl.load(own_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCKS, BLOCK], dtype=tl.float32)
        for rank in range(num_rows):  # rank order, this rank's own row in its place
            ranks = tl.zeros([BLOCKS], dtype=tl.int32) + rank
            peer = ranks != skip  # a tensor: the interpreter masks with tensors only
            at = (ranks - (ranks > skip).to(tl.int32) * gap).to(tl.int64)  # gap 1: no row for `skip`
            s = tl.load(scales_ptr + at * scales_stride + blk, mask=blk_ok & peer, other=0.0)
            d = _code_values(codes_ptr + (at * codes_stride)[:, None], blk, blk_ok & peer, BLOCK, BLOCKS, BITS, FMT)
            acc = acc + tl.where(peer[:, None], d * s[:, None], own)
        tl.store(out_ptr + offs, _cast_out(acc, out_ptr.dtype.element_ty), mask=valid)

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


def blocks_per_program(block: int) -> int:
    """Quantization blocks one program covers ([Note: rows per launch]): a power of two."""
    return max(1, TILE_NUMEL // block)


def _check(t: torch.Tensor, what: str, block: int) -> None:
    if triton is None:
        raise RuntimeError("overlap.kernels.triton_kernels: triton is not installed")
    if (t.dim() == 2 and t.shape[0] > 0 and t.stride(1) != 1) or (t.dim() == 1 and not t.is_contiguous()):
        raise ValueError(f"overlap triton kernels: {what} must be contiguous (rows: along each row)")
    if block < 2 or block & (block - 1):
        raise ValueError(f"overlap triton kernels: block must be a power of two >= 2, got {block}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1) if t.dim() == 1 else t


def _stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else 0


def encode_rows(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, *,
                fmt: CodeFormat = "int", skip: int | None = None, noise: torch.Tensor | None = None,
                residual: Residual | None = None, count: torch.Tensor | None = None) -> None:  # fmt: skip
    """Quantize each row of `x` (rows, numel) but `skip` into the same row of `codes` / `scales`
    (rows, code_numel) / (rows, num_blocks), in one launch ([Note: rows per launch]).

    The r-th encoded row uses row r of `noise` (encoded rows, num_blocks * block uniforms:
    stochastic rounding) and of `residual` (error feedback, updated in place: dense fp32 / bf16
    rows of numel, or int8 codes and fp32 scales rows in the same blocks); `count` (an int64
    scalar) gets the number of non-finite blocks added."""
    x2, codes2, scales2 = _rows(x), _rows(codes), _rows(scales)
    for t, what in ((x2, "x"), (codes2, "codes"), (scales2, "scales")):
        _check(t, what, block)
    num_rows, numel = x2.shape
    nb = num_blocks_for(numel, block)
    encoded = num_rows - (skip is not None)
    if nb == 0 or encoded <= 0:
        return
    assert codes2.shape[1] >= code_numel(numel, bits, block) and scales2.shape[1] >= nb, (codes2.shape, scales2.shape)
    mode, res, res_scales = RESIDUAL_NONE, x2, scales2
    if isinstance(residual, tuple):
        mode, (res, res_scales) = RESIDUAL_INT8, (_rows(residual[0]), _rows(residual[1]))
    elif residual is not None:
        mode, res = RESIDUAL_DENSE, _rows(residual)
    if residual is not None:
        assert res.shape[0] == encoded and res_scales.shape[0] >= 1, (res.shape, encoded)
        _check(res, "residual", block)
    noise2 = x2 if noise is None else noise.view(encoded, -1)
    if noise is not None:
        _check(noise2, "noise", block)
    blocks = blocks_per_program(block)
    with on_device(x):
        _encode_kernel[(triton.cdiv(nb, blocks), encoded)](
            x2, _stride(x2), noise2, _stride(noise2), codes2, _stride(codes2), scales2, _stride(scales2),
            res, _stride(res), res_scales, _stride(res_scales), count if count is not None else scales2,
            numel, nb, num_rows if skip is None else skip,
            QMAX=qmax_for(bits, fmt), BLOCK=block, BLOCKS=blocks, BITS=bits, FMT=_FMT_FP8 if fmt == "fp8" else 0,
            STOCHASTIC=noise is not None, RESIDUAL=mode, COUNT=count is not None, **LAUNCH_OPTIONS,
        )  # fmt: skip


def decode_rows(codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int, out: torch.Tensor,
                accumulate: bool = False, *, fmt: CodeFormat = "int",
                count: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Decode each row of `codes` / `scales` into (or, accumulating, add into, in fp32) the same
    row of `out` (rows, numel), in one launch; `count` gets the NaN scales added."""
    codes2, scales2, out2 = _rows(codes), _rows(scales), _rows(out)
    for t, what in ((codes2, "codes"), (scales2, "scales"), (out2, "out")):
        _check(t, what, block)
    nb = num_blocks_for(numel, block)
    if nb and out2.shape[0]:
        blocks = blocks_per_program(block)
        with on_device(out):
            _decode_kernel[(triton.cdiv(nb, blocks), out2.shape[0])](
                codes2, _stride(codes2), scales2, _stride(scales2), out2, _stride(out2),
                count if count is not None else scales2, numel, nb,
                BLOCK=block, BLOCKS=blocks, BITS=bits, FMT=_FMT_FP8 if fmt == "fp8" else 0, ACCUMULATE=accumulate,
                COUNT=count is not None, **LAUNCH_OPTIONS,
            )  # fmt: skip
    return out


def decode_sum_rows(codes: torch.Tensor, scales: torch.Tensor, own: torch.Tensor, skip: int, num_rows: int, bits: int,
                    block: int, out: torch.Tensor, *, fmt: CodeFormat = "int") -> torch.Tensor:  # fmt: skip
    """`out` = the sum, in fp32 and in rank order, of `num_rows` rows: rank `skip` contributes
    `own` (numel elements), every other rank the decode of its row of `codes` / `scales`, which
    hold `num_rows` rows or, when they hold one fewer, none for `skip`. One launch."""
    codes2, scales2 = _rows(codes), _rows(scales)
    for t, what in ((codes2, "codes"), (scales2, "scales"), (own, "own"), (out, "out")):
        _check(t, what, block)
    numel = out.numel()
    nb = num_blocks_for(numel, block)
    gap = num_rows - codes2.shape[0]
    assert gap in (0, 1) and scales2.shape[0] == codes2.shape[0] and own.numel() == numel, (gap, own.numel(), numel)
    if nb:
        blocks = blocks_per_program(block)
        with on_device(out):
            _decode_sum_kernel[(triton.cdiv(nb, blocks),)](
                codes2, _stride(codes2), scales2, _stride(scales2), own, out, numel, nb, num_rows, skip, gap,
                BLOCK=block, BLOCKS=blocks, BITS=bits, FMT=_FMT_FP8 if fmt == "fp8" else 0, **LAUNCH_OPTIONS,
            )  # fmt: skip
    return out


def quantize_blockwise(x: torch.Tensor, bits: int, block: int, *, fmt: CodeFormat = "int", noise: torch.Tensor | None = None,
                       residual: Residual | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Flat contiguous `x` -> (codes, scales); `noise` (num_blocks * block uniforms) rounds
    stochastically; `residual` (dense fp32 / bf16 of numel, or int8 (codes, scales)) runs error
    feedback fused into the quantize, one pass ([Note: rows per launch]), updated in place."""
    if residual is None:
        _check(x, "x", block)
    numel = x.numel()
    nb = num_blocks_for(numel, block)
    code_dtype = torch.int8 if bits == 8 and fmt == "int" else torch.uint8
    codes = torch.empty(code_numel(numel, bits, block), dtype=code_dtype, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    encode_rows(x, codes, scales, bits, block, fmt=fmt, noise=noise, residual=residual)
    return codes, scales


def quantize_feedback_blockwise(x: torch.Tensor, residual: Residual, bits: int, block: int, *, fmt: CodeFormat = "int",
                                noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Error feedback fused into the quantize: `quantize_blockwise` with a `residual`."""
    return quantize_blockwise(x, bits, block, fmt=fmt, noise=noise, residual=residual)


dequantize_blockwise = decode_rows
"""Decode into `out` (flat, contiguous: one row), or add into it with the sum in fp32."""
