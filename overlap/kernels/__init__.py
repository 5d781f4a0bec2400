"""Kernels: blockwise quantize / dequantize(-accumulate) for compressed communication, and the
fused copy-out / copy-in with cast between a unit's flat buffer and its many tensors.

Each op has a torch reference (`*_ref`) that defines it and a dispatch that picks the fastest
built backend (Triton on CUDA, the just-in-time C++ extension on CPU, else the reference). The
row ops (`encode_rows`, `decode_rows`, `decode_sum_rows`) do a compressed collective's bucket in
one call, one launch on CUDA ([Note: rows per launch] in triton_kernels.py).
"""

from overlap.kernels.copy import (
    bind_copy_in,
    bind_copy_out,
    copy_in,
    copy_in_ref,
    copy_out,
    copy_out_ref,
    select_copy_backend,
)
from overlap.kernels.quantize import (
    dequantize_blockwise,
    quantize_blockwise,
    quantize_feedback_blockwise,
    quantize_feedback_int8res_blockwise,
    select_backend,
)
from overlap.kernels.reduce import sum_rows, sum_rows_ref
from overlap.kernels.reference import code_numel, dequantize_blockwise_ref, num_blocks_for, quantize_blockwise_ref
from overlap.kernels.rows import decode_rows, decode_sum_rows, encode_rows

__all__ = [
    "bind_copy_in",
    "bind_copy_out",
    "code_numel",
    "copy_in",
    "copy_in_ref",
    "copy_out",
    "copy_out_ref",
    "decode_rows",
    "decode_sum_rows",
    "dequantize_blockwise",
    "dequantize_blockwise_ref",
    "encode_rows",
    "num_blocks_for",
    "quantize_blockwise",
    "quantize_blockwise_ref",
    "quantize_feedback_blockwise",
    "quantize_feedback_int8res_blockwise",
    "select_backend",
    "select_copy_backend",
    "sum_rows",
    "sum_rows_ref",
]
