"""Blockwise quantizing codecs: int8, int4 and fp8 codes with one fp32 scale per block.

They cannot carry Inf/NaN: such blocks travel as NaN and are counted ([Note: deferred finite
check] in finite.py); see [Note: codec numerics] in codecs.py for their error bounds.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from overlap.compression.codecs import Codec, Encoded
from overlap.compression.finite import NonfiniteCounter
from overlap.kernels import (
    code_numel,
    dequantize_blockwise,
    num_blocks_for,
    quantize_blockwise,
    quantize_feedback_blockwise,
    quantize_feedback_int8res_blockwise,
)
from overlap.kernels.reference import CodeFormat
from overlap.kernels.rows import Residual, decode_rows, decode_sum_rows, encode_rows

_SCALE_BYTES = 4  # fp32 per block


class _BlockwiseCodec(Codec):
    """Blockwise absmax codes through `overlap.kernels` (see [Note: codec numerics])."""

    bits: ClassVar[int]
    fmt: ClassVar[CodeFormat]
    default_block_size: ClassVar[int]

    def __init__(
        self,
        block_size: int | None = None,
        *,
        stochastic: bool = False,
        generator: torch.Generator | None = None,
        check_finite: bool = True,
    ) -> None:
        block = self.default_block_size if block_size is None else block_size
        if not isinstance(block, int) or block <= 0 or (self.bits == 4 and block % 2):
            raise ValueError(
                f"{type(self).__name__}: block_size must be a positive int"
                f"{' (even: two codes per byte)' if self.bits == 4 else ''}, got {block_size!r}"
            )
        if stochastic and self.fmt == "fp8":
            raise ValueError("FP8Codec: stochastic rounding is not available; use Int8Codec for it")
        self.block_size = block
        self.alignment_numel = block
        self.stochastic = stochastic
        self.generator = generator
        self.check_finite = check_finite
        self.nonfinite = NonfiniteCounter() if check_finite else None

    def encode(self, x: torch.Tensor, *, count: bool = True) -> Encoded:
        codes, scales = quantize_blockwise(x, self.bits, self.block_size, self.stochastic, self.generator, fmt=self.fmt)
        enc = Encoded(codes, scales, x.numel(), x.dtype)
        return self._checked(enc) if count else enc

    def encode_feedback(self, x: torch.Tensor, residual: torch.Tensor) -> Encoded:
        codes, scales = quantize_feedback_blockwise(
            x, residual, self.bits, self.block_size, self.stochastic, self.generator, fmt=self.fmt
        )
        return self._checked(Encoded(codes, scales, x.numel(), torch.float32))  # x + r, in fp32

    def encode_feedback_int8res(self, x: torch.Tensor, res_codes: torch.Tensor, res_scales: torch.Tensor) -> Encoded:
        """`encode_feedback` with the residual held as int8 codes and fp32 scales in this codec's
        blocks, decoded and re-encoded in place (`Int8Residual` in feedback.py)."""
        codes, scales = quantize_feedback_int8res_blockwise(
            x, res_codes, res_scales, self.bits, self.block_size, self.stochastic, self.generator, fmt=self.fmt
        )
        return self._checked(Encoded(codes, scales, x.numel(), torch.float32))  # x + r, in fp32

    def _checked(self, enc: Encoded) -> Encoded:
        assert enc.scales is not None
        if self.nonfinite is not None:
            self.nonfinite.add(enc.scales)  # no host sync: read by raise_if_nonfinite
        return enc

    def _counter(self, device: torch.device, count: bool, num_rows: int, numel: int) -> torch.Tensor | None:
        """The device count a kernel adds `num_rows` rows of `numel` elements into, or None."""
        if not count or self.nonfinite is None:
            return None
        return self.nonfinite.counter(device, num_rows * num_blocks_for(numel, self.block_size), num_rows)

    def raise_if_nonfinite(self, *, wait: bool = False) -> None:
        if self.nonfinite is None:
            return
        report = self.nonfinite.take(wait)
        if report.bad_blocks:
            if report.all_ranks:  # [Note: collective finite check]
                where = (f"{report.bad_blocks} blocks of {self.block_size}, counted over every rank (this "
                         f"rank checked {report.num_blocks} blocks in {report.num_encodes} encodes; every "
                         "rank raises this)")  # fmt: skip
            else:
                where = (f"{report.bad_blocks} of {report.num_blocks} blocks of {self.block_size} "
                         f"({report.num_encodes} encodes checked)")  # fmt: skip
            raise ValueError(
                f"overlap.compression.{type(self).__name__}: the input holds Inf or NaN in {where}; "
                "quantized codes cannot carry them, so "
                "those blocks were sent as NaN. Fix the overflow (lower the learning rate, use a loss "
                "scaler) or build the codec with check_finite=False to let such blocks pass through "
                "as NaN without this error."
            )

    def _wire_views(self, wire: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(codes, scales) views of `wire`'s rows for the row kernels, or None where the fp32
        scales would not be 4-byte aligned (tiny int4 blocks)."""
        n_codes, nb = code_numel(numel, self.bits, self.block_size), num_blocks_for(numel, self.block_size)
        if wire.dim() != 2 or wire.stride(1) != 1 or wire.shape[1] < n_codes + _SCALE_BYTES * nb:
            return None
        codes = wire[:, :n_codes]
        if self.bits == 8 and self.fmt == "int":
            codes = codes.view(torch.int8)
        try:
            scales = wire[:, n_codes : n_codes + _SCALE_BYTES * nb].view(torch.float32)
        except RuntimeError:  # misaligned for a float32 view
            return None
        return codes, scales

    def encode_rows_into(self, rows: torch.Tensor, wire: torch.Tensor, skip: int | None = None, residual: Any = None, *,
                         count: bool = True) -> None:  # fmt: skip
        views = self._wire_views(wire, rows.shape[1])
        fused: Residual | None = None if residual is None else residual.kernel_rows(self)
        if views is None or (residual is not None and fused is None) or not rows.is_floating_point():
            return super().encode_rows_into(rows, wire, skip, residual, count=count)
        if residual is not None:
            assert residual.rank == skip, (residual.rank, skip)
        num_encoded = rows.shape[0] - (skip is not None)
        counter = self._counter(rows.device, count or residual is not None, num_encoded, rows.shape[1])
        encode_rows(rows, *views, self.bits, self.block_size, fmt=self.fmt, skip=skip, stochastic=self.stochastic,
                    generator=self.generator, residual=fused, count=counter)  # fmt: skip

    def decode_rows_into(
        self, wire: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor, *, count: bool = True
    ) -> torch.Tensor:
        views = self._wire_views(wire, numel)
        if views is None:
            super().decode_rows_into(wire, numel, dtype, out, count=count)
            if count and self.nonfinite is not None:
                for r in range(out.shape[0]):
                    self.nonfinite.add(self.from_bytes(wire[r], numel, dtype).scales)  # type: ignore[arg-type]
            return out
        counter = self._counter(out.device, count, out.shape[0], numel)
        return decode_rows(*views, self.bits, self.block_size, numel, out, fmt=self.fmt, count=counter)

    def decode_sum_rows(
        self, wire: torch.Tensor, own: torch.Tensor, skip: int, num_rows: int, out: torch.Tensor
    ) -> torch.Tensor:
        views = self._wire_views(wire, own.numel())
        if views is None:
            return super().decode_sum_rows(wire, own, skip, num_rows, out)
        return decode_sum_rows(*views, own, skip, num_rows, self.bits, self.block_size, out, fmt=self.fmt)

    def _decode_into(self, enc: Encoded, out: torch.Tensor, accumulate: bool) -> None:
        assert enc.scales is not None, "blockwise codes travel with their scales"
        dequantize_blockwise(
            enc.codes, enc.scales, self.bits, self.block_size, enc.numel, out, accumulate, fmt=self.fmt
        )

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return code_numel(numel, self.bits, self.block_size) + _SCALE_BYTES * num_blocks_for(numel, self.block_size)

    def from_bytes(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> Encoded:
        n_codes = code_numel(numel, self.bits, self.block_size)
        nb = num_blocks_for(numel, self.block_size)
        codes = buf[:n_codes]
        if self.bits == 8 and self.fmt == "int":
            codes = codes.view(torch.int8)
        scales = buf[n_codes : n_codes + _SCALE_BYTES * nb].view(torch.float32)
        return Encoded(codes, scales, numel, dtype)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_size={self.block_size}, stochastic={self.stochastic}, "
            f"check_finite={self.check_finite})"
        )


class Int8Codec(_BlockwiseCodec):
    """int8 codes, one fp32 scale per block: ~3.9x fewer bytes than fp32 at block 256."""

    name = "int8"
    bits = 8
    fmt = "int"
    default_block_size = 256


class Int4Codec(_BlockwiseCodec):
    """int4 codes packed two per byte (q + 8 per nibble), one fp32 scale per block."""

    name = "int4"
    bits = 4
    fmt = "int"
    default_block_size = 128


class FP8Codec(_BlockwiseCodec):
    """float8 e4m3fn codes (sent as uint8: gloo has no float8), one fp32 scale per block."""

    name = "fp8"
    bits = 8
    fmt = "fp8"
    default_block_size = 256

    def __init__(self, block_size: int | None = None, *, check_finite: bool = True) -> None:
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(
                f"FP8Codec needs torch.float8_e4m3fn, which torch {torch.__version__} lacks; "
                "use param_compression='int8' or 'bf16'"
            )
        super().__init__(block_size, check_finite=check_finite)
