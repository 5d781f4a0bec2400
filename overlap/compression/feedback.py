"""Error feedback: carry what quantization dropped into the next step's gradient.

[Note: error feedback residual]
The residual lives on the sender, before the reduce-scatter: per bucket, one row per peer rank
(the chunk that rank r receives from this rank), `world_size - 1` rows, because this rank's own
chunk never crosses the wire, is never encoded and would always carry a zero residual (see
`coded.reduce_scatter_encoded`). All rows of a bucket are updated by one fused encode where the
codec has one (`kernel_rows`, [Note: rows per launch] in kernels/triton_kernels.py).
`FeedbackResidual` maps a peer rank to its row. How a row is stored is a `ResidualFormat`,
chosen once by `OverlapConfig.error_feedback_dtype`:

- float32 (`DenseResidual`): 4 bytes per element. With round-to-nearest,
  `decode(enc) + residual == x + old residual` exactly (see [Note: codec numerics] in codecs.py):
  nothing is ever lost, the running sum of what was sent is the running sum of the gradients
  minus the last residual.
- bfloat16 (`DenseResidual`): 2 bytes per element; the stored residual is rounded to 8 significant
  bits, a relative error of at most 2^-8 of each element's residual.
- int8 (`Int8Residual`, blockwise codecs only): 1 + 4 / block bytes per element. The residual is
  quantized blockwise by the same kernels as the gradient codes, over the codec's own blocks: int8
  codes and one fp32 scale per block, scale = absmax(residual of the block) / 127. For a
  round-to-nearest codec the residual of a block is at most half of that block's quantization step
  (|r| <= bound = scale_codec / 2; stochastic rounding: < scale_codec), so each stored element is
  within absmax(r) / 254 <= bound / 254 of the exact residual. The absmax of the residual itself
  (rather than the codec's bound) costs no extra memory, is never looser and reuses the dispatched
  quantize kernels (C++ on CPU, Triton on CUDA).

A non-finite block (Inf or NaN in the gradient, which the codec sends as NaN and reports,
[Note: deferred finite check] in finite.py) leaves a zero residual, in every backend
(`kernels.quantize.finite_residual`): what it dropped is unknown, and a NaN kept in the residual
would come back in every later step, so that a step skipped after the error (a loss scaler's
overflow, a caught ValueError) could never be followed by a clean one.

With a lossy store (bf16, int8) the storage error e_t = stored - exact residual of step t is not
fed back: over T steps, sum(decoded) == sum(gradients) - stored residual + sum_t e_t exactly,
so the running sum drifts by at most sum_t |e_t| (int8: <= T * bound / 254 per element, a
random walk of that step for gradients that vary; fp32: no drift at all). Without feedback the
drift is up to T * bound. The residuals are training state: checkpoints save them
(`FeedbackResidual.saved` / `from_saved`).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from overlap.compression.blockwise import _BlockwiseCodec
from overlap.compression.codecs import Codec, Encoded
from overlap.kernels import code_numel, dequantize_blockwise, num_blocks_for, quantize_blockwise
from overlap.kernels.quantize import finite_residual
from overlap.kernels.rows import Residual

RESIDUAL_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
"""What `OverlapConfig.error_feedback_dtype` accepts (int8: blockwise gradient codecs only)."""
_SCALE_BYTES = 4  # fp32 per block


def quantization_residual(
    codec: Codec, x: torch.Tensor, enc: Encoded, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`x - decode(enc)` computed in fp32 and stored in `dtype` (flat)."""
    decoded = codec.decode(enc, torch.float32)
    return (x.reshape(-1).float() - decoded).to(dtype)


def encode_with_feedback(codec: Codec, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[Encoded, torch.Tensor]:
    """Encode `x + residual` and update `residual` in place to what this encoding dropped.

    `residual` is a flat fp32 or bf16 buffer with x's numel (None: start from zero; a new fp32
    buffer is returned). Returns (the encoding, the residual buffer).
    """
    if residual is not None and (residual.numel() != x.numel() or not residual.is_contiguous()):
        raise ValueError(
            f"encode_with_feedback: residual must be contiguous with {x.numel()} elements, "
            f"got shape {tuple(residual.shape)}"
        )
    if residual is not None and residual.dtype == torch.float32:
        # In place, fused where a kernel exists (Codec.encode_feedback): the same fp32
        # operations as below, so decode(enc) + residual == x + old residual, exactly.
        return codec.encode_feedback(x, residual), residual
    target = x.reshape(-1).float()
    if residual is not None:
        target = target + residual.view(-1)
    # Never in place on `target`: it may be the caller's gradient (fp32 x, no residual), and the
    # identity codec's encoding is a view of it.
    enc = codec.encode(target)
    dropped = finite_residual(target - codec.decode(enc, torch.float32))
    if residual is None:
        return enc, dropped
    residual.view(-1).copy_(dropped)
    return enc, residual


class ResidualFormat(ABC):
    """How residual rows are stored and restored (a strategy; see [Note: error feedback
    residual]). A format's tensors each have one leading row dimension; a row is the tuple of
    their rows, holding one flat residual of `numel` elements."""

    name: ClassVar[str]

    @abstractmethod
    def allocate(self, num_rows: int, numel: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Zero residuals: `num_rows` rows of `numel` elements."""

    @abstractmethod
    def restore(self, row: tuple[torch.Tensor, ...], numel: int) -> torch.Tensor:
        """The stored residual as a new flat fp32 tensor."""

    @abstractmethod
    def store(self, row: tuple[torch.Tensor, ...], residual: torch.Tensor) -> None:
        """Write the flat fp32 `residual` into `row`."""

    @abstractmethod
    def row_nbytes(self, numel: int) -> int:
        """Bytes one row of `numel` elements occupies."""

    def encode(self, codec: Codec, x: torch.Tensor, row: tuple[torch.Tensor, ...]) -> Encoded:
        """Encode `x` + the stored residual; store what this encoding dropped in its place."""
        target = self.restore(row, x.numel())
        enc = codec.encode_feedback(x, target)  # target becomes x + old residual - decoded
        self.store(row, target)
        return enc

    def params(self) -> dict[str, Any]:
        """What identifies the format in a checkpoint (see `format_from_params`)."""
        return {"name": self.name}

    def kernel_rows(self, tensors: tuple[torch.Tensor, ...], codec: Codec) -> Residual | None:
        """The rows as the fused encode kernels take them (`kernels.rows.Residual`), or None
        when `codec` cannot update them in its encode (the rows then go one by one)."""
        return None


@dataclass(frozen=True)
class DenseResidual(ResidualFormat):
    """Each element in `dtype` (float32: exact feedback; bfloat16: half the bytes)."""

    dtype: torch.dtype = torch.float32
    name: ClassVar[str] = "dense"

    def allocate(self, num_rows: int, numel: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(num_rows, numel, dtype=self.dtype, device=device),)

    def restore(self, row: tuple[torch.Tensor, ...], numel: int) -> torch.Tensor:
        return row[0].to(torch.float32, copy=True)

    def store(self, row: tuple[torch.Tensor, ...], residual: torch.Tensor) -> None:
        row[0].copy_(residual.view(-1))

    def row_nbytes(self, numel: int) -> int:
        return numel * self.dtype.itemsize

    def encode(self, codec: Codec, x: torch.Tensor, row: tuple[torch.Tensor, ...]) -> Encoded:
        return encode_with_feedback(codec, x, row[0])[0]  # fp32: in place, fused

    def params(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": str(self.dtype).removeprefix("torch.")}

    def kernel_rows(self, tensors: tuple[torch.Tensor, ...], codec: Codec) -> Residual | None:
        return tensors[0] if isinstance(codec, _BlockwiseCodec) else None  # fp32 or bf16 rows


@dataclass(frozen=True)
class Int8Residual(ResidualFormat):
    """int8 codes and one fp32 scale (absmax / 127) per block of `block_size` elements."""

    block_size: int
    name: ClassVar[str] = "int8"

    def allocate(self, num_rows: int, numel: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        num_codes, num_blocks = code_numel(numel, 8, self.block_size), num_blocks_for(numel, self.block_size)
        codes = torch.zeros(num_rows, num_codes, dtype=torch.int8, device=device)
        scales = torch.zeros(num_rows, num_blocks, dtype=torch.float32, device=device)
        return codes, scales

    def restore(self, row: tuple[torch.Tensor, ...], numel: int) -> torch.Tensor:
        codes, scales = row
        return dequantize_blockwise(codes, scales, 8, self.block_size, numel)

    def store(self, row: tuple[torch.Tensor, ...], residual: torch.Tensor) -> None:
        codes, scales = quantize_blockwise(residual, 8, self.block_size)
        row[0].copy_(codes)
        row[1].copy_(scales)

    def row_nbytes(self, numel: int) -> int:
        return code_numel(numel, 8, self.block_size) + _SCALE_BYTES * num_blocks_for(numel, self.block_size)

    def encode(self, codec: Codec, x: torch.Tensor, row: tuple[torch.Tensor, ...]) -> Encoded:
        if isinstance(codec, _BlockwiseCodec) and codec.block_size == self.block_size:
            # restore, encode_feedback and store in one kernel (the same bits; on CPU one pass
            # over memory without the fp32 residual: kernels.quantize_feedback_int8res_blockwise)
            return codec.encode_feedback_int8res(x, *row)
        return super().encode(codec, x, row)

    def params(self) -> dict[str, Any]:
        return {"name": self.name, "block_size": self.block_size}

    def kernel_rows(self, tensors: tuple[torch.Tensor, ...], codec: Codec) -> Residual | None:
        if isinstance(codec, _BlockwiseCodec) and codec.block_size == self.block_size:
            return tensors[0], tensors[1]
        return None


def make_residual_format(dtype: torch.dtype, codec: Codec) -> ResidualFormat:
    """The format for `OverlapConfig.error_feedback_dtype` with gradient codec `codec`."""
    if dtype in (torch.float32, torch.bfloat16):
        return DenseResidual(dtype)
    if dtype == torch.int8:
        if not isinstance(codec, _BlockwiseCodec):
            raise ValueError(
                f"error_feedback_dtype=torch.int8 needs a blockwise grad_compression ('int8' or "
                f"'int4'), got {codec!r}: its residual is bounded per block only there; use "
                "torch.float32 or torch.bfloat16"
            )
        return Int8Residual(codec.block_size)
    raise ValueError(f"error_feedback_dtype must be one of {RESIDUAL_DTYPES}, got {dtype!r}")


def warn_residual_memory(
    residual_dtype: torch.dtype | None, world_size: int, shard_numel: int, device: torch.device
) -> str | None:
    """At wrap, on an accelerator: warn what a float32 residual will take (what the warning says,
    or None). It is the default because it is exact (no drift, and the numerics the CPU tests
    pin), but at (world_size - 1) rows of this rank's gradient columns it is about (W - 1) / W of
    the fp32 model per device, often more than the sharded parameters and optimizer state it
    sits beside, so a run that fits without error feedback may not fit with it. The warning
    names the bytes and the knob; it changes nothing."""
    if residual_dtype != torch.float32 or device.type == "cpu" or world_size < 2:
        return None
    num_bytes = (world_size - 1) * DenseResidual(torch.float32).row_nbytes(shard_numel)
    message = (
        f"overlap.wrap: error feedback will keep up to {num_bytes / 2**30:.2f} GiB ({num_bytes} bytes) "
        f"of float32 residuals per {device.type} device ({world_size - 1} peer rows of this rank's "
        f"{shard_numel} gradient elements, 4 bytes each); OverlapConfig(error_feedback_dtype="
        "torch.bfloat16) halves it, torch.int8 (grad_compression 'int8' or 'int4') takes about a "
        "quarter, each a small bounded rounding of the residual ([Note: error feedback residual] "
        "in overlap/compression/feedback.py)"
    )
    warnings.warn(message, stacklevel=2)
    return message


def format_from_params(params: dict[str, Any]) -> ResidualFormat:
    """Inverse of `ResidualFormat.params`."""
    if params["name"] == DenseResidual.name:
        return DenseResidual(getattr(torch, params["dtype"]))
    if params["name"] == Int8Residual.name:
        return Int8Residual(params["block_size"])
    raise ValueError(f"unknown error-feedback residual format {params!r}")


@dataclass
class FeedbackResidual:
    """One bucket's error-feedback residual on one rank: a row of `numel` elements for every
    peer rank, in `format` ([Note: error feedback residual])."""

    format: ResidualFormat
    rank: int  # this rank, in the reduce-scatter group: it has no row
    world_size: int
    numel: int
    tensors: tuple[torch.Tensor, ...]  # the format's, world_size - 1 rows each

    @classmethod
    def zeros(
        cls, fmt: ResidualFormat, rank: int, world_size: int, numel: int, device: torch.device
    ) -> FeedbackResidual:
        return cls(fmt, rank, world_size, numel, fmt.allocate(world_size - 1, numel, device))

    def _row(self, peer: int) -> tuple[torch.Tensor, ...]:
        assert peer != self.rank and 0 <= peer < self.world_size, (
            f"rank {self.rank}: no residual row for rank {peer} (world size {self.world_size})"
        )
        index = peer if peer < self.rank else peer - 1
        return tuple(t[index] for t in self.tensors)

    def encode(self, codec: Codec, x: torch.Tensor, peer: int) -> Encoded:
        """Encode `x` (the chunk for rank `peer`, numel elements) with feedback from its row."""
        if x.numel() != self.numel:
            raise ValueError(f"FeedbackResidual.encode: the chunk has {x.numel()} elements, the residual {self.numel}")
        return self.format.encode(codec, x, self._row(peer))

    def kernel_rows(self, codec: Codec) -> Residual | None:
        """Every peer's row at once, in rank order, for `codec.encode_rows_into`'s fused kernel
        (None: encode row by row through `encode`)."""
        return self.format.kernel_rows(self.tensors, codec)

    def restore(self, peer: int) -> torch.Tensor:
        """The residual of rank `peer`'s chunk as a new flat fp32 tensor (zeros for this rank)."""
        if peer == self.rank:
            return torch.zeros(self.numel, dtype=torch.float32, device=self.tensors[0].device)
        return self.format.restore(self._row(peer), self.numel)

    @property
    def nbytes(self) -> int:
        return (self.world_size - 1) * self.format.row_nbytes(self.numel)

    def saved(self) -> dict[str, Any]:
        """A picklable copy on the CPU, for checkpoints (`from_saved` reads it back)."""
        return {
            "format": self.format.params(),
            "rank": self.rank,
            "world_size": self.world_size,
            "numel": self.numel,
            "tensors": tuple(t.cpu() for t in self.tensors),  # checkpoint save only, never per step
        }

    @classmethod
    def from_saved(
        cls, saved: dict[str, Any] | torch.Tensor, fmt: ResidualFormat, rank: int, world_size: int, device: torch.device
    ) -> FeedbackResidual:
        """The residual that `saved()` returned (or, from a checkpoint of format 1, a dense
        (world_size, numel) tensor, whose own row is dropped) on `device`, converted to `fmt`
        if it was stored in another format."""
        if isinstance(saved, torch.Tensor):  # checkpoint format 1: every rank's row, own row zero
            if saved.dim() != 2 or saved.shape[0] != world_size:
                raise ValueError(
                    f"overlap.checkpoint: an error-feedback residual of shape {tuple(saved.shape)} "
                    f"does not have one row per rank of world size {world_size}"
                )
            keep = [r for r in range(world_size) if r != rank]
            saved = {
                "format": DenseResidual(saved.dtype).params(),
                "rank": rank,
                "world_size": world_size,
                "numel": saved.shape[1],
                "tensors": (saved[keep],),
            }
        if (saved["rank"], saved["world_size"]) != (rank, world_size):
            raise ValueError(
                f"overlap.checkpoint: an error-feedback residual of rank {saved['rank']} of "
                f"{saved['world_size']} cannot be restored on rank {rank} of {world_size}"
            )
        tensors = tuple(t.to(device) for t in saved["tensors"])
        old = cls(format_from_params(saved["format"]), rank, world_size, saved["numel"], tensors)
        if old.format == fmt:
            return old
        new = cls.zeros(fmt, rank, world_size, old.numel, device)
        for peer in range(world_size):
            if peer != rank:
                fmt.store(new._row(peer), old.restore(peer))
        return new
