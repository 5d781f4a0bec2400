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

The compiled backends compute the same expressions in the same order, with no fused
multiply-add, so round-to-nearest results are bitwise equal to these references.
"""

from __future__ import annotations

from typing import Literal

import torch

CodeFormat = Literal["int", "fp8"]

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


def quantize_blockwise_ref(
    x: torch.Tensor,
    bits: int,
    block: int,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    fmt: CodeFormat = "int",
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    scale = torch.where(finite, amax / qmax, torch.full_like(amax, float("nan")))
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


def dequantize_blockwise_ref(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    fmt: CodeFormat = "int",
) -> torch.Tensor:
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
