"""The arithmetic end of a reduction through all-to-all: sum the rows every rank sent, in rank
order, and divide the gradient part by the averaging divisor, in one pass.

`sum_rows_ref` defines it (torch.add left to right into a new tensor, then `div_` on the first
`divide_numel` elements: what `comm` and `Runtime.wait_reduce` did as two passes, and bitwise
DDP's average at two ranks, see [Note: reduce-scatter through all-to-all] in transport/collectives.py). The C++
backend (csrc/reduce.cpp) computes the same operations with the same roundings, chunk by chunk
while they are in cache. CPU only: on CUDA, NCCL's reduce-scatter sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from overlap.kernels import cpu

Backend = Literal["auto", "ref", "cpp"]
_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def sum_rows_ref(rows: Sequence[torch.Tensor], divide_numel: int = 0, divisor: int = 1) -> torch.Tensor:
    """rows[0] + rows[1] + ... (left to right, in a new tensor), its first `divide_numel`
    elements then divided by `divisor`."""
    total = torch.add(rows[0], rows[1]) if len(rows) > 1 else rows[0].clone()
    for row in rows[2:]:
        total.add_(row)
    if divide_numel and divisor != 1:
        total[:divide_numel].div_(divisor)
    return total


def sum_rows(
    rows: Sequence[torch.Tensor],
    divide_numel: int = 0,
    divisor: int = 1,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sum_rows_ref`, through the C++ extension where it applies (CPU, two or more contiguous
    rows of one dtype it compiles). `out`: written instead of a new tensor (a contiguous tensor
    of the rows' shape and dtype that is none of them), and returned."""
    if len(rows) < 1 or any(r.shape != rows[0].shape or r.dtype != rows[0].dtype for r in rows):
        raise ValueError("overlap.kernels.sum_rows: rows must be one or more tensors of one shape and dtype")
    if not 0 <= divide_numel <= rows[0].numel():
        raise ValueError(f"overlap.kernels.sum_rows: divide_numel={divide_numel} outside the row")
    compiled = (
        len(rows) > 1
        and rows[0].device.type == "cpu"
        and rows[0].dtype in _COMPILED_DTYPES
        and all(r.is_contiguous() for r in rows)
    )
    if backend == "cpp" and not compiled:
        raise ValueError("overlap.kernels.sum_rows: backend='cpp' needs 2+ contiguous CPU rows of fp32/bf16/fp16/fp64")
    ext = cpu.load_extension() if compiled and backend != "ref" else None
    if backend == "cpp" and ext is None:
        raise RuntimeError("overlap.kernels: backend='cpp' requested but the extension is not built")
    if out is not None:
        if out.shape != rows[0].shape or out.dtype != rows[0].dtype or not out.is_contiguous():
            raise ValueError("overlap.kernels.sum_rows: out must be contiguous, of the rows' shape and dtype")
        if any(r.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for r in rows):
            raise ValueError("overlap.kernels.sum_rows: out must not share storage with a row")
    if ext is None:
        total = sum_rows_ref(rows, divide_numel, divisor)
        return total if out is None else out.copy_(total)
    out = torch.empty_like(rows[0]) if out is None else out
    ext.sum_rows(list(rows), out, divide_numel if divisor != 1 else 0, float(divisor))
    return out
