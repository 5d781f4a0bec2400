"""A non-finite block stays non-finite when decoded into bf16.

A codec gives a block holding Inf/NaN a NaN scale, so the whole block decodes to NaN
(kernels/reference.py). NVIDIA fp32 arithmetic returns the canonical NaN, 0x7FFFFFFF, for any
NaN operand, and the Triton kernel's fp32 -> bf16 rounding on the bits carried that into the
sign: 0x8000, -0.0, a block of zeros. The interpreter's NaN (0x7FC00000) rounds correctly, so
the scale is given the GPU's bits here: the interpreter then propagates them as the GPU does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.harness import triton_or_skip

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import torch
from overlap.kernels import dequantize_blockwise_ref, quantize_blockwise_ref
from overlap.kernels import triton_kernels as tk

block, numel = 256, 512
x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
x[3] = float("nan")  # block 0 is non-finite: its scale is NaN
for bits in (8, 4):
    codes, scales = quantize_blockwise_ref(x, bits, block)
    scales.view(torch.int32)[0] = 0x7FFFFFFF  # the NaN NVIDIA's fp32 arithmetic returns
    for accumulate in (False, True):
        out = torch.zeros(numel, dtype=torch.bfloat16)
        tk.dequantize_blockwise(codes, scales, bits, block, numel, out, accumulate)
        ref = torch.zeros(numel, dtype=torch.bfloat16)
        dequantize_blockwise_ref(codes, scales, bits, block, numel, ref, accumulate)
        assert out[:block].isnan().all(), (bits, accumulate, out[:4])
        assert ref[:block].isnan().all(), (bits, accumulate, ref[:4])
        assert torch.equal(out[block:], ref[block:]), (bits, accumulate)
print("checked")
"""


def test_nan_block_decodes_to_nan_in_bf16():
    triton_or_skip()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], check=False, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "checked" in result.stdout
