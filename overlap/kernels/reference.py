"""Torch references for the blockwise quantization kernels: the definition every backend matches.

[Note: blockwise quantization format]
A flat tensor of `numel` elements is cut into `num_blocks = ceil(numel / block)` blocks; the last
block is padded with zeros (internally: the input is never copied to a padded buffer by the
compiled backends). Per block, in fp32:

    amax  = max |x|                              (exact)
    scale = amax / qmax                          (fp32 division; qmax = 127 int8, 7 int4, 448 fp8)
    y     = x / (scale if 0 < scale < inf else 1)
    int:  q = clamp(round_half_even(y), -qmax, qmax)          (round-to-nearest)
          q = clamp(floor(y + u), -qmax, qmax), u ~ U[0, 1)   (stochastic; E[q] = y)
    fp8:  q = float8_e4m3fn(clamp(y, -448, 448))              (round-to-nearest-even)
    decoded = float(q) * scale

Codes: int8 -> one int8 per element; int4 -> two per uint8 byte (element 2i in the low nibble,
2i+1 in the high nibble, stored as q + 8); fp8 -> the e4m3fn bit pattern as uint8 (gloo has no
float8 types). All code tensors hold `num_blocks * block` elements (padding included); scales are
`num_blocks` fp32 values.

Non-finite input: a block holding Inf or NaN gets scale = NaN and codes 0, so it decodes to NaN
across the whole block (a pass-through that cannot be missed; codecs raise instead by default).

[Note: kernel numerics across devices]
What is bitwise and why, between the Triton kernels (compiled for CUDA, or interpreted on the
CPU), this reference run on CUDA tensors, this reference run on CPU tensors, and the C++ kernels:
every result is bitwise equal (codes, scales, decoded values, error-feedback residuals, NaN
blocks as NaN), for round-to-nearest and, fed the same `noise`, for stochastic rounding. Nothing
is "within an ulp". That holds because each step is one correctly rounded IEEE fp32 operation
on every backend, evaluated in the same order:
- amax, the clamps, the selects and the int/fp8 casts are exact (no rounding at all);
- `amax / qmax` and `x / scale` divide tensor by tensor: IEEE division on every device. Not
  `tensor / python_float`: on CUDA, ATen computes a tensor divided by a CPU scalar as
  `a * (1 / b)` (its scalar fast path), two roundings, and that differs from `a / b` for 4.5% of
  scales at qmax = 127 and about half at 7 or 448. Triton's `/` is approximate
  too, so the kernels call `div_rn`; the C++ kernels use `/` with `-ffp-contract=off`;
- round-half-even: `torch.round` (nearbyint) here, `(y + 1.5 * 2^23) - 1.5 * 2^23` in Triton
  (exact for |y| <= 2^22, and |y| <= qmax); fp8: round-to-nearest-even on every backend (ATen's
  software cast, the sm_89+ `cvt.rn.satfinite` that Triton emits);
- the decode `q * scale` and the accumulating `out + q * scale` are two roundings everywhere:
  the Triton launches turn fp fusion off ([Note: Triton launches] in triton_launch.py; the
  compile test asserts no `fma.` in the PTX), the C++ flags forbid contraction, and ATen runs
  the multiply and the add as separate kernels;
- casts to bf16 / fp16 round to nearest even; a NaN becomes bf16's quiet NaN 0x7FC0 (Triton's
  `_cast_out` tests for NaN, since NVIDIA's canonical fp32 NaN 0x7FFFFFFF would round into the
  sign bit);
- denormals are kept, not flushed: Triton emits no `.ftz` unless asked, ATen and the C++ kernels
  run without flush-to-zero. A block whose scale is subnormal is exercised by the tests.
Two things are not bitwise and are not claimed: the interpreter's fp32 -> fp8 cast (wrong, so
fp8 Triton is checked on a GPU only), and stochastic rounding across devices with noise drawn
by each device's own generator (CPU and CUDA generators differ; tests pass one noise tensor).
Tests: tests/unit/triton_interpreter_check.py (Triton interpreted vs this reference, CPU), the C++
tests in tests/unit/test_kernels.py, and its GPU tests, which compare Triton on CUDA against this
reference on CUDA and on the CPU (`quantize_blockwise_ref(x.cpu())`).
"""

from __future__ import annotations

from typing import Literal

import torch

CodeFormat = Literal["int", "fp8"]
Residual = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""Error-feedback rows: dense (fp32 or bf16, one row of numel per encoded row), or int8 codes
and fp32 scales in the codec's blocks (one row of each per encoded row)."""

FP8_MAX = 448.0


def qmax_for(bits: int, fmt: CodeFormat) -> float:
    if fmt == "fp8":
        return FP8_MAX
    return float((1 << (bits - 1)) - 1)


def num_blocks_for(numel: int, block: int) -> int:
    return -(-numel // block)


def code_numel(numel: int, bits: int, block: int) -> int:
    """Elements in the codes tensor (bytes: int8 codes are 1 byte, int4 packs 2 per byte)."""
    padded = num_blocks_for(numel, block) * block
    return padded // 2 if bits == 4 else padded


def quantize_blockwise_ref(x: torch.Tensor, bits: int, block: int, stochastic: bool = False,
                           generator: torch.Generator | None = None, fmt: CodeFormat = "int",
                           noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Quantize flat `x` blockwise; returns (codes, scales). See [Note: blockwise quantization format].

    `noise` (fp32, num_blocks * block uniforms in [0, 1)) replaces drawing from `generator`, so
    every backend can be fed the same noise.
    """
    numel = x.numel()
    nb = num_blocks_for(numel, block)
    qmax = qmax_for(bits, fmt)
    xf = x.reshape(-1).float()
    pad = nb * block - numel
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    xb = xf.view(nb, block)
    amax = xb.abs().amax(dim=1) if nb else xf.new_empty(0)
    finite = torch.isfinite(amax)
    # tensor / tensor: IEEE division on every device ([Note: kernel numerics across devices])
    scale = torch.where(finite, amax / torch.full_like(amax, qmax), torch.full_like(amax, float("nan")))
    safe = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
    y = xb / safe[:, None]
    y = torch.where(finite[:, None], y, torch.zeros_like(y))
    if fmt == "fp8":
        codes = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)
        return codes, scale
    if stochastic:
        if noise is None:
            noise = torch.rand(nb * block, generator=generator, device=x.device)
        q = torch.floor(y + noise.view(nb, block))
    else:
        q = torch.round(y)
    q = q.clamp(-qmax, qmax)
    if bits == 8:
        return q.to(torch.int8).reshape(-1), scale
    u = (q + 8).to(torch.uint8).view(-1, 2)
    return (u[:, 0] | (u[:, 1] << 4)).contiguous(), scale


def unpack_codes_ref(codes: torch.Tensor, bits: int, fmt: CodeFormat = "int") -> torch.Tensor:
    """Codes -> their fp32 values (before scaling), padding included."""
    if fmt == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    if bits == 8:
        return codes.float()
    lo = (codes & 0xF).to(torch.int16) - 8
    hi = (codes >> 4).to(torch.int16) - 8
    return torch.stack((lo, hi), dim=1).reshape(-1).float()


def dequantize_blockwise_ref(codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int,
                             out: torch.Tensor | None = None, accumulate: bool = False,
                             fmt: CodeFormat = "int") -> torch.Tensor:  # fmt: skip
    """Decode into `out` (fp32 if None), or `out += decoded` with the sum in fp32 when accumulating."""
    q = unpack_codes_ref(codes, bits, fmt).view(-1, block)
    decoded = (q * scales[:, None]).reshape(-1)[:numel]
    if out is None:
        if accumulate:
            raise ValueError("dequantize_blockwise: accumulate=True needs an `out` tensor")
        return decoded
    flat = out.view(-1)
    if accumulate:
        flat.copy_(flat.float() + decoded)
    else:
        flat.copy_(decoded)
    return out
