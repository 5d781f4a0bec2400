"""Compressed communication: codecs (strategy objects), error feedback, the non-finite check.

codecs.py: the interface and the codecs that carry every value; blockwise.py: int8 / int4 / fp8;
registry.py: the codec names and how to add one; feedback.py: error-feedback residuals;
finite.py: counting the blocks a quantizing codec cannot carry, on every rank alike."""

from overlap.compression.blockwise import FP8Codec, Int4Codec, Int8Codec
from overlap.compression.codecs import BF16Codec, Codec, Encoded, IdentityCodec
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
from overlap.compression.registry import (
    GRAD_CODECS,
    PARAM_CODECS,
    make_grad_codec,
    make_param_codec,
    register_codec,
    unregister_codec,
)

__all__ = [
    "GRAD_CODECS",
    "PARAM_CODECS",
    "RESIDUAL_DTYPES",
    "BF16Codec",
    "Codec",
    "DenseResidual",
    "Encoded",
    "FP8Codec",
    "FeedbackResidual",
    "IdentityCodec",
    "Int4Codec",
    "Int8Codec",
    "Int8Residual",
    "ResidualFormat",
    "encode_with_feedback",
    "make_grad_codec",
    "make_param_codec",
    "make_residual_format",
    "quantization_residual",
    "register_codec",
    "unregister_codec",
]
