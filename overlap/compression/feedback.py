"""Error feedback: carry what quantization dropped into the next step's gradient.

[Note: error feedback residual]
The residual is a full unsharded gradient-sized buffer per rank (it lives on the sender, before
the reduce-scatter): 4 bytes per parameter element in fp32, 2 in bf16. With an fp32 residual and
round-to-nearest, `decode(enc) + residual == x + old_residual` exactly (see [Note: codec
numerics] in codecs.py); a bf16 residual halves the memory and rounds what it carries. The
residual is training state: checkpoints save it.
"""

from __future__ import annotations

import torch

from overlap.compression.codecs import Codec, Encoded


def quantization_residual(
    codec: Codec, x: torch.Tensor, enc: Encoded, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`x - decode(enc)` computed in fp32 and stored in `dtype` (flat)."""
    decoded = codec.decode(enc, torch.float32)
    return (x.reshape(-1).float() - decoded).to(dtype)


def encode_with_feedback(
    codec: Codec, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[Encoded, torch.Tensor]:
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
    dropped = target - codec.decode(enc, torch.float32)
    if residual is None:
        return enc, dropped
    residual.view(-1).copy_(dropped)
    return enc, residual

