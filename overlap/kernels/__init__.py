"""Kernels for compressed communication: blockwise quantize / dequantize(-accumulate).

Each op has a torch reference (`*_ref`) that defines it and a dispatch that picks the fastest
built backend (Triton on CUDA, the just-in-time C++ extension on CPU, else the reference).
"""

from overlap.kernels.quantize import (
    dequantize_blockwise,
    quantize_blockwise,
    select_backend,
)
from overlap.kernels.reference import (
    code_numel,
    dequantize_blockwise_ref,
    num_blocks_for,
    quantize_blockwise_ref,
)

__all__ = [
    "code_numel",
    "dequantize_blockwise",
    "dequantize_blockwise_ref",
    "num_blocks_for",
    "quantize_blockwise",
    "quantize_blockwise_ref",
    "select_backend",
]
