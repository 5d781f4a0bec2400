"""Blockwise codes of many rows at once: a compressed collective's encode and decode per bucket.

Each op is defined by a loop over the single-row ops of quantize.py (the `*_loop` functions, which
run on every backend: the C++ kernels on CPU, the reference elsewhere), and runs on CUDA as one
Triton launch for all rows ([Note: rows per launch] in triton_kernels.py), bitwise equal to the
loop. The rows live in 2-D tensors with contiguous rows and any row stride, so the encode writes
into the wire buffer of a collective and the decode reads from it, without copies.
"""

from __future__ import annotations

import torch

from overlap.kernels.quantize import (
    Backend,
    _check_format,
    dequantize_blockwise,
    finite_residual,
    quantize_blockwise,
    quantize_feedback_blockwise,
    quantize_feedback_int8res_blockwise,
    select_backend,
)
from overlap.kernels.reference import CodeFormat, Residual, num_blocks_for


def _encoded_rows(num_rows: int, skip: int | None) -> list[int]:
    return [r for r in range(num_rows) if r != skip]


def _triton(device: torch.device, block: int, backend: Backend, fmt: CodeFormat) -> bool:
    return select_backend(device, block, backend, fmt=fmt) == "triton"


def encode_rows(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, *,
                fmt: CodeFormat = "int", skip: int | None = None, stochastic: bool = False,
                generator: torch.Generator | None = None, residual: Residual | None = None,
                count: torch.Tensor | None = None, backend: Backend = "auto") -> None:  # fmt: skip
    """Quantize every row of `x` (rows, numel) except row `skip` into the same row of `codes`
    (rows, >= code_numel; int8 for int8 codes, else uint8) and `scales` (rows, >= num_blocks,
    fp32). The i-th encoded row (rows in order, `skip` left out) has row i of `residual` for
    error feedback, updated in place as `quantize_feedback_blockwise` /
    `quantize_feedback_int8res_blockwise` update theirs (a bf16 residual: x + r in fp32, what
    the codes dropped rounded back to bf16). Stochastic rounding draws (encoded rows, num_blocks
    * block) uniforms from `generator` at once, row i using row i. `count`, an int64 scalar on
    the device, gets the number of non-finite blocks added (NaN scales)."""
    _check_format(bits, block, fmt, stochastic)
    num_rows, numel = x.shape
    rows = _encoded_rows(num_rows, skip)
    nb = num_blocks_for(numel, block)
    noise = None
    if stochastic and rows:
        noise = torch.rand(len(rows), nb * block, generator=generator, device=x.device, dtype=torch.float32)
    if _triton(x.device, block, backend, fmt):
        from overlap.kernels import triton_kernels

        triton_kernels.encode_rows(x, codes, scales, bits, block, fmt=fmt, skip=skip, noise=noise,
                                   residual=residual, count=count)  # fmt: skip
        return
    encode_rows_loop(x, codes, scales, bits, block, fmt=fmt, skip=skip, noise=noise, residual=residual,
                     count=count, backend=backend)  # fmt: skip


def encode_rows_loop(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, *,
                     fmt: CodeFormat = "int", skip: int | None = None, noise: torch.Tensor | None = None,
                     residual: Residual | None = None, count: torch.Tensor | None = None,
                     backend: Backend = "auto") -> None:  # fmt: skip
    """`encode_rows` as a loop over the single-row ops (the definition), with its `noise` given."""
    loop_backend: Backend = "ref" if backend == "triton" else backend
    stochastic = noise is not None
    for i, r in enumerate(_encoded_rows(x.shape[0], skip)):
        row_noise = None if noise is None else noise[i]
        kw = {"fmt": fmt, "backend": loop_backend, "noise": row_noise}
        if residual is None:
            c, s = quantize_blockwise(x[r], bits, block, stochastic, **kw)  # type: ignore[arg-type]
        elif isinstance(residual, tuple):
            c, s = quantize_feedback_int8res_blockwise(
                x[r], residual[0][i], residual[1][i], bits, block, stochastic, **kw
            )  # type: ignore[arg-type]
        elif residual.dtype == torch.float32:
            c, s = quantize_feedback_blockwise(x[r], residual[i], bits, block, stochastic, **kw)  # type: ignore[arg-type]
        else:  # a narrower residual: x + r in fp32, what the codes dropped stored in its dtype
            target = x[r].float() + residual[i].float()
            c, s = quantize_blockwise(target, bits, block, stochastic, **kw)  # type: ignore[arg-type]
            dropped = dequantize_blockwise(c, s, bits, block, target.numel(), fmt=fmt, backend=loop_backend)
            residual[i].copy_(finite_residual(target - dropped))
        codes[r, : c.numel()].copy_(c.view(codes.dtype))
        scales[r, : s.numel()].copy_(s)
        if count is not None:
            count.add_(torch.isnan(s).sum())


def decode_rows(codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int, out: torch.Tensor, *,
                fmt: CodeFormat = "int", count: torch.Tensor | None = None,
                backend: Backend = "auto") -> torch.Tensor:  # fmt: skip
    """Decode row r of `codes` / `scales` into row r of `out` (rows, numel; any floating dtype),
    for every row; `count` (int64 scalar) gets the rows' NaN scales added. Returns `out`."""
    _check_format(bits, block, fmt, False)
    nb = num_blocks_for(numel, block)
    if _triton(codes.device, block, backend, fmt):
        from overlap.kernels import triton_kernels

        return triton_kernels.decode_rows(codes, scales, bits, block, numel, out, fmt=fmt, count=count)
    loop_backend: Backend = "ref" if backend == "triton" else backend
    for r in range(out.shape[0]):
        dequantize_blockwise(codes[r], scales[r, :nb], bits, block, numel, out[r], fmt=fmt, backend=loop_backend)
    if count is not None:
        count.add_(torch.isnan(scales[:, :nb]).sum())
    return out


def decode_sum_rows(codes: torch.Tensor, scales: torch.Tensor, own: torch.Tensor, skip: int, num_rows: int, bits: int,
                    block: int, out: torch.Tensor, *, fmt: CodeFormat = "int",
                    backend: Backend = "auto") -> torch.Tensor:  # fmt: skip
    """`out` (numel; any floating dtype) = the fp32 sum, in rank order, of `num_rows` ranks'
    rows, cast once at the end: rank `skip` adds `own`, every other rank the decode of its row of
    `codes` / `scales`. Those hold a row per rank, or one fewer, with none for `skip` (this
    rank's part stayed home). The reference loop: `acc = 0; acc += row` rank by rank."""
    _check_format(bits, block, fmt, False)
    numel = out.numel()
    if _triton(codes.device, block, backend, fmt):
        from overlap.kernels import triton_kernels

        return triton_kernels.decode_sum_rows(codes, scales, own, skip, num_rows, bits, block, out, fmt=fmt)
    loop_backend: Backend = "ref" if backend == "triton" else backend
    nb = num_blocks_for(numel, block)
    gap = num_rows - codes.shape[0]
    acc = torch.zeros(numel, dtype=torch.float32, device=out.device)
    for rank in range(num_rows):
        if rank == skip:
            acc += own
        else:
            at = rank - (rank > skip) * gap
            dequantize_blockwise(
                codes[at], scales[at, :nb], bits, block, numel, acc, True, fmt=fmt, backend=loop_backend
            )
    return out.copy_(acc)
