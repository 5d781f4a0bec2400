"""Run by tests/test_kernels.py in a fresh process with TRITON_INTERPRET=1: the Triton kernels
(interpreted on the CPU) against the torch reference, bitwise, on shapes that are not multiples
of the block: blockwise quantize / dequantize, and the fused copy-out / copy-in with cast.
Exits non-zero with the failing case on a mismatch."""

from __future__ import annotations

import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from overlap.kernels import (  # noqa: E402
    copy_in_ref,
    copy_out_ref,
    dequantize_blockwise_ref,
    num_blocks_for,
    quantize_blockwise_ref,
)
from overlap.kernels import triton_copy as tc  # noqa: E402
from overlap.kernels import triton_kernels as tk  # noqa: E402

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_input(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(6) * 100
    x[:: max(1, numel // 5)] = 0.0
    if dtype == torch.float32 and numel > 3:
        x[numel // 3] = 3e-41
    return x.to(dtype)


_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
COPY_PAIRS = [  # (flat dtype, tensors' dtype)
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
    (torch.float16, torch.bfloat16),
]
# (columns per segment, padding per segment, num_rows): odd and empty segments, a segment wider
# than one tile, and an all-multiples-of-16 layout that takes the kernels' aligned branch
COPY_LAYOUTS = [
    ([5, 0, 1, 33, 1100, 2], [0, 0, 1, 4, 7, 0], 1),
    ([3, 17, 0, 64], [1, 0, 0, 5], 3),
    ([16, 1040, 32], [0, 0, 0], 2),
    ([0], [0], 1),
]


def copy_values(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(numel, generator=gen) * 40
    special = torch.tensor([1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3e-41, float("inf"), -0.0, 3.4e38])
    k = min(numel, len(special))
    x[torch.randperm(numel, generator=gen)[:k]] = special[:k]
    return x.to(dtype)


def check_copy(gen: torch.Generator) -> int:
    cases = 0
    for cols, pads, rows in COPY_LAYOUTS:
        sizes = [c * rows for c in cols]
        valid = [s - p for s, p in zip(sizes, pads)]
        for flat_dtype, dtype in COPY_PAIRS:
            where = f"triton copy {flat_dtype}<->{dtype} rows={rows} cols={cols}"
            flat = copy_values(sum(sizes), flat_dtype, gen)
            ref = [torch.full((n,), 7.0, dtype=dtype) for n in valid]
            got = [t.clone() for t in ref]
            copy_out_ref(flat, ref, sizes, rows)
            tc.copy_out(flat, got, sizes, rows)
            for r, g in zip(ref, got):
                assert torch.equal(r.view(_INT_VIEW[dtype]), g.view(_INT_VIEW[dtype])), "copy_out " + where
            # mixed source dtypes (two launches) and a None source (zeros)
            srcs = [None if i == 1 else copy_values(n, dtype if i % 2 else flat_dtype, gen) for i, n in enumerate(valid)]
            ref_flat = torch.full((sum(sizes),), 7.0, dtype=flat_dtype)
            got_flat = ref_flat.clone()
            copy_in_ref(srcs, ref_flat, sizes, rows)
            tc.copy_in(srcs, got_flat, sizes, rows)
            iv = _INT_VIEW[flat_dtype]
            assert torch.equal(ref_flat.view(iv), got_flat.view(iv)), "copy_in " + where
            cases += 1
    return cases


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
    copy_cases = check_copy(gen)
    print(f"checked {cases} quantize and {copy_cases} copy cases: interpreted Triton == reference")


if __name__ == "__main__":
    main()
