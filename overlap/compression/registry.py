"""The codec each config name means (`OverlapConfig.param_compression` / `grad_compression`)."""

from __future__ import annotations

import torch

from overlap.compression.blockwise import FP8Codec, Int4Codec, Int8Codec
from overlap.compression.codecs import BF16Codec, Codec, IdentityCodec

PARAM_CODECS = (None, "bf16", "int8", "fp8")
GRAD_CODECS = (None, "bf16", "int8", "int4")


def make_param_codec(
    name: str | None, *, block_size: int | None = None, check_finite: bool = True
) -> Codec:
    """The codec for `OverlapConfig.param_compression` (None -> IdentityCodec)."""
    if name is None:
        return IdentityCodec()
    if name == "bf16":
        return BF16Codec()
    if name == "int8":
        return Int8Codec(block_size, check_finite=check_finite)
    if name == "fp8":
        return FP8Codec(block_size, check_finite=check_finite)
    raise ValueError(f"param_compression must be one of {PARAM_CODECS}, got {name!r}")


def make_grad_codec(
    name: str | None,
    *,
    block_size: int | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    check_finite: bool = True,
) -> Codec:
    """The codec for `OverlapConfig.grad_compression` (None -> IdentityCodec)."""
    if name is None:
        return IdentityCodec()
    if name == "bf16":
        return BF16Codec()
    if name in ("int8", "int4"):
        cls = Int8Codec if name == "int8" else Int4Codec
        return cls(block_size, stochastic=stochastic, generator=generator, check_finite=check_finite)
    raise ValueError(f"grad_compression must be one of {GRAD_CODECS}, got {name!r}")
