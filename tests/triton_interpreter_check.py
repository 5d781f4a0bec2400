"""Run by tests/test_kernels.py in a fresh process with TRITON_INTERPRET=1: the Triton kernels
(interpreted on the CPU) against the torch reference, bitwise, on shapes that are not multiples
of the block. Exits non-zero with the failing case on a mismatch."""

from __future__ import annotations

import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from overlap.kernels import dequantize_blockwise_ref, num_blocks_for, quantize_blockwise_ref  # noqa: E402
from overlap.kernels import triton_kernels as tk  # noqa: E402

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_input(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(6) * 100
    x[:: max(1, numel // 5)] = 0.0
    if dtype == torch.float32 and numel > 3:
        x[numel // 3] = 3e-41
    return x.to(dtype)


def main() -> None:
    gen = torch.Generator().manual_seed(2)
    cases = 0
    for numel, block in [(1, 2), (7, 4), (64, 64), (100, 16), (333, 64), (1000, 128)]:
        nb = num_blocks_for(numel, block)
        for bits in (8, 4):
            for dtype in (torch.float32, torch.bfloat16):
                x = random_input(numel, dtype, gen)
                where = f"triton int{bits} block={block} numel={numel} {dtype}"
                ref = quantize_blockwise_ref(x, bits, block)
                got = tk.quantize_blockwise(x, bits, block)
                assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), where
                noise = torch.rand(nb * block, generator=gen)
                sref = quantize_blockwise_ref(x, bits, block, True, noise=noise)
                sgot = tk.quantize_blockwise(x, bits, block, noise=noise)
                assert torch.equal(sref[0], sgot[0]) and torch.equal(sref[1], sgot[1]), "stochastic " + where
                for out_dtype in OUT_DTYPES:
                    base = torch.randn(numel, generator=gen).to(out_dtype)
                    for accumulate in (False, True):
                        r = dequantize_blockwise_ref(*ref, bits, block, numel, base.clone(), accumulate)
                        o = tk.dequantize_blockwise(*ref, bits, block, numel, base.clone(), accumulate)
                        assert torch.equal(r, o), f"dequantize acc={accumulate} out={out_dtype} " + where
                cases += 1
    print(f"checked {cases} cases: interpreted Triton == reference")


if __name__ == "__main__":
    main()
