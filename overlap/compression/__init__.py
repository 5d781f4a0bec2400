"""Compressed communication: codecs (strategy objects) and error feedback."""

from overlap.compression.codecs import (
    GRAD_CODECS,
    PARAM_CODECS,
    BF16Codec,
    Codec,
    Encoded,
    FP8Codec,
    IdentityCodec,
    Int4Codec,
    Int8Codec,
    make_grad_codec,
    make_param_codec,
)
from overlap.compression.feedback import (
    RESIDUAL_DTYPES,
    DenseResidual,
    FeedbackResidual,
    Int8Residual,
    ResidualFormat,
    encode_with_feedback,
    make_residual_format,
    quantization_residual,
)

__all__ = [
    "RESIDUAL_DTYPES",
    "DenseResidual",
    "FeedbackResidual",
    "Int8Residual",
    "ResidualFormat",
    "make_residual_format",
    "GRAD_CODECS",
    "PARAM_CODECS",
    "BF16Codec",
    "Codec",
    "Encoded",
    "FP8Codec",
    "IdentityCodec",
    "Int4Codec",
    "Int8Codec",
    "encode_with_feedback",
    "make_grad_codec",
    "make_param_codec",
    "quantization_residual",
]
