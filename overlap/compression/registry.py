"""The codec each config name means (`OverlapConfig.param_compression` / `grad_compression`).

`PARAM_CODECS` and `GRAD_CODECS` are the one list of codec names: each maps a name (None: no
compression) to a factory that builds the codec, and `OverlapConfig` validates its two codec
fields against their keys. Nothing here imports `overlap.config`, so config can import this
module without a circle.

[Note: adding a codec]
Adding a codec is a change in two files:
1. The codec's module (beside codecs.py and blockwise.py): subclass `Codec` and set `name`.
2. This module: add `"name": Factory` to `PARAM_CODECS` (the weight all-gather), to
   `GRAD_CODECS` (the gradient reduce-scatter), or to both.
A factory is called with keyword options and returns a fresh codec: `block_size` and
`check_finite` for both directions, plus `stochastic` and `generator` for gradients. It takes the
options it uses and ignores the rest (`**_`); a class whose `__init__` takes them all is its own
factory. A codec built outside the package (a test, an experiment) registers at run time with
`register_codec` and leaves with `unregister_codec`; the config and `overlap.wrap` then accept
its name like any other. The registry is per process: every rank registers the codec before it
wraps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from overlap.compression.blockwise import FP8Codec, Int4Codec, Int8Codec, _BlockwiseCodec
from overlap.compression.codecs import BF16Codec, Codec, IdentityCodec

CodecFactory = Callable[..., Codec]


def _identity(**_: Any) -> Codec:
    return IdentityCodec()


def _bf16(**_: Any) -> Codec:
    return BF16Codec()


PARAM_CODECS: dict[str | None, CodecFactory] = {None: _identity, "bf16": _bf16, "int8": Int8Codec, "fp8": FP8Codec}
"""`OverlapConfig.param_compression` names -> factory(block_size=, check_finite=)."""

GRAD_CODECS: dict[str | None, CodecFactory] = {None: _identity, "bf16": _bf16, "int8": Int8Codec, "int4": Int4Codec}
"""`OverlapConfig.grad_compression` names -> factory(block_size=, stochastic=, generator=,
check_finite=)."""

_BUILT_IN = frozenset(PARAM_CODECS) | frozenset(GRAD_CODECS)


def check_codec_name(field: str, name: object) -> None:
    """Raise ValueError naming `field` and the registered names if `name` is not one of them."""
    assert field in ("param_compression", "grad_compression"), field
    codecs = PARAM_CODECS if field == "param_compression" else GRAD_CODECS
    if not (name is None or isinstance(name, str)) or name not in codecs:  # an unhashable name too
        raise ValueError(
            f"{field}={name!r} is not a registered codec; use one of {tuple(codecs)} "
            "(overlap.compression.register_codec adds one)"
        )


def block_residual_codecs() -> tuple[str, ...]:
    """The gradient codecs with blocks, whose residual `error_feedback_dtype=torch.int8` can
    store per block (see make_residual_format in feedback.py)."""
    return tuple(
        name
        for name, factory in GRAD_CODECS.items()
        if isinstance(factory, type) and issubclass(factory, _BlockwiseCodec)
    )


def register_codec(name: str, factory: CodecFactory, *, param: bool = False, grad: bool = False) -> None:
    """Make `name` a valid `param_compression` (param=True) and/or `grad_compression` (grad=True)
    ([Note: adding a codec])."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a codec name must be a non-empty str, got {name!r}")
    if not (param or grad):
        raise ValueError(f"register_codec({name!r}) needs param=True, grad=True or both")
    for wanted, codecs, field in ((param, PARAM_CODECS, "param"), (grad, GRAD_CODECS, "grad")):
        if wanted and name in codecs:
            raise ValueError(f"{field} codec {name!r} is already registered; unregister_codec it first")
    if param:
        PARAM_CODECS[name] = factory
    if grad:
        GRAD_CODECS[name] = factory


def unregister_codec(name: str) -> None:
    """Remove a codec that `register_codec` added (the built-in ones stay)."""
    if name in _BUILT_IN:
        raise ValueError(f"codec {name!r} is built in and stays registered")
    if name not in PARAM_CODECS and name not in GRAD_CODECS:
        raise ValueError(f"codec {name!r} is not registered")
    PARAM_CODECS.pop(name, None)
    GRAD_CODECS.pop(name, None)


def make_param_codec(name: str | None, *, block_size: int | None = None, check_finite: bool = True) -> Codec:
    """The codec for `OverlapConfig.param_compression` (None -> IdentityCodec)."""
    check_codec_name("param_compression", name)
    return PARAM_CODECS[name](block_size=block_size, check_finite=check_finite)


def make_grad_codec(
    name: str | None,
    *,
    block_size: int | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    check_finite: bool = True,
) -> Codec:
    """The codec for `OverlapConfig.grad_compression` (None -> IdentityCodec)."""
    check_codec_name("grad_compression", name)
    return GRAD_CODECS[name](
        block_size=block_size, stochastic=stochastic, generator=generator, check_finite=check_finite
    )
