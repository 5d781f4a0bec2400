"""Codecs: how a flat tensor travels on the wire. Strategy objects chosen once by the config.

This module holds the interface (`Codec`, `Encoded`) and the codecs that carry every value
(identity, bf16); the blockwise quantizing ones are in blockwise.py, the config names in
registry.py.

A codec turns a flat tensor into an `Encoded` (codes, optional per-block scales) and back. The
collectives call `encode` on the sender and `decode` / `decode_accumulate` on the receiver; the
schedule never asks which codec is in use (DESIGN.md, layer 4).

Wire layout for the collectives: a chunk whose numel is a multiple of `alignment_numel` encodes
to `wire_bytes(chunk_numel)` bytes, [codes | fp32 scales]. `to_chunk_bytes` lays out a rank-major
buffer chunk-major for one uint8 all-to-all (reduce-scatter); concatenating each rank's
`to_bytes(encode(shard))` (all-gather) gives the same layout; `from_chunk_bytes` splits either.

[Note: codec numerics]
- identity: the tensor itself (no copy); bitwise.
- bf16: round-to-nearest-even cast; exact for bf16-representable inputs; Inf/NaN pass through
  (finite fp32 values above bf16's max round to Inf, as any bf16 cast does).
- int8 / int4 / fp8: blockwise absmax scaling ([Note: blockwise quantization format] in
  overlap/kernels/reference.py). Per element, |x - decode(encode(x))| <= scale / 2 with
  scale = absmax(block) / qmax (qmax = 127 int8, 7 int4) for round-to-nearest, < scale for
  stochastic rounding (which is unbiased instead); fp8 e4m3 keeps 3 mantissa bits: relative
  error <= 2^-4 for |x| >= 2^-6 * scale, absolute <= 2^-10 * scale below. Blocks whose scale is
  subnormal add up to 128 * 2^-149 of absolute error. -0.0 decodes to +0.0.
- Inf/NaN: a block holding Inf/NaN decodes to NaN across the whole block, so loss scalers and
  NaN checks downstream still see it. With `check_finite=True` (the default) quantizing codecs
  also count such blocks on the device, and `raise_if_nonfinite()`, which the runtime calls once
  per step, raises ValueError for them on every rank at the same step: at once on CPU, two steps
  late on CUDA, where it does not block the host ([Note: deferred finite check] and [Note:
  collective finite check] in finite.py). `check_finite=False` skips the count.
- Error feedback: with round-to-nearest, `decode(enc) + (x - decode(enc)) == x` exactly in fp32
  (the residual is always exactly representable: Sterbenz's lemma, since a nonzero code is within
  a factor of 2 of its input). `encode_with_feedback` below keeps that residual; a non-finite
  element of it (a non-finite block, or a NaN carried by bf16) is kept as 0 instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

import torch

from overlap.compression.finite import NonfiniteCounter
from overlap.kernels.quantize import finite_residual


class Encoded(NamedTuple):
    """A tensor as it travels: `codes` (and `scales`, fp32 per block, or None), flat."""

    codes: torch.Tensor
    scales: torch.Tensor | None
    numel: int
    dtype: torch.dtype  # of the tensor that was encoded; decode() returns this dtype


class Codec(ABC):
    """Encode a flat tensor for the wire and decode (or decode-and-add) it on the receiver."""

    name: ClassVar[str]
    alignment_numel: int = 1
    """Chunks whose numel is a multiple of this encode to independent, contiguous slices of one
    encoding of the whole tensor (codes and scales both split evenly): pad shards to it."""

    nonfinite: NonfiniteCounter | None = None
    """Where a codec that cannot carry Inf/NaN counts them ([Note: deferred finite check])."""

    @abstractmethod
    def encode(self, x: torch.Tensor, *, count: bool = True) -> Encoded:
        """Encode `x` (read flat; any floating dtype); `count=False`: leave its non-finite
        blocks out of the count (a gather counts what it decodes instead)."""

    @abstractmethod
    def _decode_into(self, enc: Encoded, out: torch.Tensor, accumulate: bool) -> None:
        """Write (or add, summing in fp32) the decoded values into flat, contiguous `out`."""

    @abstractmethod
    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes that `numel` elements of `dtype` occupy on the wire (codes + scales)."""

    def encode_feedback(self, x: torch.Tensor, residual: torch.Tensor) -> Encoded:
        """Encode `x + residual` and set `residual` (contiguous fp32, x's numel) to what the
        encoding dropped, in place (see [Note: error feedback residual] in feedback.py)."""
        target = residual.view(-1)
        target.add_(x.reshape(-1))  # x + r == r + x in IEEE arithmetic
        enc = self.encode(target)
        if enc.codes.data_ptr() == target.data_ptr():  # an encoding that aliases its input
            enc = enc._replace(codes=enc.codes.clone())
        finite_residual(torch.sub(target, self.decode(enc, torch.float32), out=target))
        return enc

    def raise_if_nonfinite(self, *, wait: bool = False) -> None:
        """Raise ValueError if encodes since the last check met Inf/NaN that this codec cannot
        carry. Call once per step, on every rank: on CUDA it reports the counts of two checks
        ago without blocking the host, or everything up to now with `wait=True` ([Note:
        deferred finite check] in finite.py). Codecs that carry Inf/NaN (identity, bf16) have
        nothing to report."""

    def agree_nonfinite(self, total: torch.Tensor) -> None:
        """Note the non-finite count of every rank, one element on the device, which
        `reduce_scatter_encoded` appends to the reduced shard ([Note: collective finite check]
        in finite.py); the next check reports it instead of this rank's own count."""
        if self.nonfinite is not None:
            self.nonfinite.agree(total)

    # ------------------------------------------------------------------ many rows per call
    # A collective's encode and decode of a bucket ([Note: rows per launch] in
    # kernels/triton_kernels.py): `wire` is (rows, >= wire_bytes) uint8, each row [codes | scales]
    # as `to_bytes` lays them out, usually a strided view of the collective's buffer. These
    # defaults loop over the rows; blockwise codecs override them with one launch per call.

    def encode_rows_into(self, rows: torch.Tensor, wire: torch.Tensor, skip: int | None = None, residual: Any = None, *,
                         count: bool = True) -> None:  # fmt: skip
        """Encode row r of `rows` (num_rows, n) into `wire[r]` for every r but `skip`, with
        error feedback from `residual` (a `FeedbackResidual` whose rank is `skip`) if given."""
        for r in range(rows.shape[0]):
            if r == skip:
                continue
            enc = self.encode(rows[r], count=count) if residual is None else residual.encode(self, rows[r], r)
            wire[r, : self.wire_bytes(enc.numel, rows.dtype)].copy_(self.to_bytes(enc))

    def decode_rows_into(
        self, wire: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor, *, count: bool = True
    ) -> torch.Tensor:
        """Decode `wire[r]` (encoded from `numel` elements of `dtype`) into `out[r]` (rows,
        numel), for every row; `count`: count their non-finite blocks. Returns `out`."""
        for r in range(out.shape[0]):
            self.decode_into(self.from_bytes(wire[r], numel, dtype), out[r])
        return out

    def decode_sum_rows(
        self, wire: torch.Tensor, own: torch.Tensor, skip: int, num_rows: int, out: torch.Tensor
    ) -> torch.Tensor:
        """`out` = the sum in fp32, in rank order, of `num_rows` ranks' parts, cast once: rank
        `skip` adds `own` (never encoded), every other rank the decode of its row of `wire`,
        which holds a row per rank or one fewer, none for `skip`. Returns `out`."""
        numel = own.numel()
        gap = num_rows - wire.shape[0]
        acc = torch.zeros(numel, dtype=torch.float32, device=own.device)
        for rank in range(num_rows):
            if rank == skip:
                acc += own  # exact, in its place in the rank order
            else:
                self.decode_accumulate(self.from_bytes(wire[rank - (rank > skip) * gap], numel, own.dtype), acc)
        return out.copy_(acc)

    def decode(self, enc: Encoded, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new flat tensor of `dtype` (default: the encoded tensor's dtype)."""
        out = torch.empty(enc.numel, dtype=dtype or enc.dtype, device=enc.codes.device)
        self._decode_into(enc, out, accumulate=False)
        return out

    def decode_accumulate(self, enc: Encoded, out: torch.Tensor) -> torch.Tensor:
        """`out += decode(enc)`, summed in fp32 and stored in out's dtype. Returns `out`."""
        self._check_out(enc, out, "decode_accumulate")
        self._decode_into(enc, out.view(-1), accumulate=True)
        return out

    def decode_into(self, enc: Encoded, out: torch.Tensor) -> torch.Tensor:
        """Write the decoded values into `out` (contiguous, numel elements, any floating dtype)."""
        self._check_out(enc, out, "decode_into")
        self._decode_into(enc, out.view(-1), accumulate=False)
        return out

    def _check_out(self, enc: Encoded, out: torch.Tensor, what: str) -> None:
        if out.numel() != enc.numel or not out.is_contiguous():
            raise ValueError(
                f"{type(self).__name__}.{what}: out must be contiguous with "
                f"{enc.numel} elements, got shape {tuple(out.shape)}"
            )

    def to_chunk_bytes(self, enc: Encoded, num_chunks: int) -> torch.Tensor:
        """The wire bytes of `num_chunks` equal chunks, chunk-major: [codes_0 scales_0 codes_1 ...].

        For all-to-all / all-gather of one uint8 buffer: chunk r is bytes
        [r * wire_bytes(chunk_numel), (r + 1) * wire_bytes(chunk_numel)). Needs the chunk numel
        to be a multiple of `alignment_numel` (see [Note: codec numerics]).
        """
        self._check_chunks(enc.numel, num_chunks)
        parts = [enc.codes.reshape(-1).view(torch.uint8).view(num_chunks, -1)]
        if enc.scales is not None:
            parts.append(enc.scales.reshape(-1).view(torch.uint8).view(num_chunks, -1))
        return torch.cat(parts, dim=1).view(-1) if len(parts) > 1 else parts[0].reshape(-1)

    def from_chunk_bytes(
        self, buf: torch.Tensor, num_chunks: int, chunk_numel: int, dtype: torch.dtype
    ) -> list[Encoded]:
        """Split a chunk-major byte buffer (from `to_chunk_bytes`, or gathered / exchanged
        `to_bytes` of equal chunks) into one `Encoded` per chunk (views, no copy)."""
        step = self.wire_bytes(chunk_numel, dtype)
        if buf.dtype != torch.uint8 or buf.numel() != num_chunks * step:
            raise ValueError(
                f"{type(self).__name__}.from_chunk_bytes: expected {num_chunks} x {step} uint8 "
                f"bytes, got {buf.numel()} {buf.dtype}"
            )
        return [self.from_bytes(buf[r * step : (r + 1) * step], chunk_numel, dtype) for r in range(num_chunks)]

    def _check_chunks(self, numel: int, num_chunks: int) -> None:
        if num_chunks <= 0 or numel % num_chunks or (numel // num_chunks) % self.alignment_numel:
            raise ValueError(
                f"{type(self).__name__}: {numel} elements do not split into {num_chunks} chunks "
                f"of a multiple of {self.alignment_numel} elements; pad the shards to it"
            )

    def to_bytes(self, enc: Encoded) -> torch.Tensor:
        """One flat uint8 tensor (codes, then scales) of `wire_bytes` bytes, for byte collectives."""
        parts = [enc.codes.reshape(-1).view(torch.uint8)]
        if enc.scales is not None:
            parts.append(enc.scales.reshape(-1).view(torch.uint8))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def from_bytes(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> Encoded:
        """Inverse of `to_bytes` (views into `buf`, no copy)."""
        raise NotImplementedError  # overridden by every concrete codec

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class IdentityCodec(Codec):
    """No compression: the tensor itself travels (the encoding is a view of the input)."""

    name = "identity"

    def encode(self, x: torch.Tensor, *, count: bool = True) -> Encoded:
        return Encoded(x.reshape(-1), None, x.numel(), x.dtype)

    def _decode_into(self, enc: Encoded, out: torch.Tensor, accumulate: bool) -> None:
        _store(out, enc.codes, accumulate)

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * dtype.itemsize

    def from_bytes(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> Encoded:
        return Encoded(buf[: numel * dtype.itemsize].view(dtype), None, numel, dtype)


class BF16Codec(Codec):
    """bfloat16 on the wire (round-to-nearest-even); Inf/NaN pass through."""

    name = "bf16"

    def encode(self, x: torch.Tensor, *, count: bool = True) -> Encoded:
        return Encoded(x.reshape(-1).to(torch.bfloat16), None, x.numel(), x.dtype)

    def _decode_into(self, enc: Encoded, out: torch.Tensor, accumulate: bool) -> None:
        _store(out, enc.codes, accumulate)

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * 2

    def from_bytes(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> Encoded:
        return Encoded(buf[: numel * 2].view(torch.bfloat16), None, numel, dtype)


def _store(out: torch.Tensor, values: torch.Tensor, accumulate: bool) -> None:
    flat = out.view(-1)
    if not accumulate:
        flat.copy_(values)
    elif flat.dtype == torch.float32:
        flat.add_(values)  # promotes `values` to fp32 per element
    else:
        flat.copy_(flat.float() + values.float())
