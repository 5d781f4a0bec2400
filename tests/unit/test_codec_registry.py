"""The codec registry: the config accepts exactly its names, an unknown name's error names the
field and lists the registered codecs, and a codec registered at run time trains through
`overlap.wrap` like a built-in one."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import tiny_lm, train_steps

import overlap
from overlap import OverlapConfig
from overlap.compression import (
    GRAD_CODECS,
    PARAM_CODECS,
    IdentityCodec,
    Int8Codec,
    make_grad_codec,
    make_param_codec,
    register_codec,
    unregister_codec,
)


class ToyCodec(IdentityCodec):
    """The identity codec under another name: exact, so training with it is bitwise."""

    name = "toy"


def toy_factory(**_: object) -> ToyCodec:
    return ToyCodec()


def test_builtin_names_are_unchanged():
    assert tuple(PARAM_CODECS) == (None, "bf16", "int8", "fp8")
    assert tuple(GRAD_CODECS) == (None, "bf16", "int8", "int4")
    for name in PARAM_CODECS:
        OverlapConfig(param_compression=name)
    for name in GRAD_CODECS:
        OverlapConfig(grad_compression=name)
    assert isinstance(make_grad_codec(None), IdentityCodec)
    assert make_grad_codec("int8", block_size=64).block_size == 64


@pytest.mark.parametrize("field,names", [("param_compression", PARAM_CODECS), ("grad_compression", GRAD_CODECS)])
def test_unknown_codec_error_names_the_field_and_the_registered_codecs(field, names):
    for bad in ("int2", ["int8"]):
        with pytest.raises(ValueError) as info:
            OverlapConfig(**{field: bad})
        text = str(info.value)
        assert text.startswith(f"{field}={bad!r}") and str(tuple(names)) in text, text
    make = make_param_codec if field == "param_compression" else make_grad_codec
    with pytest.raises(ValueError, match=f"{field}='int2'"):
        make("int2")


def test_registered_codec_is_valid_until_unregistered():
    with pytest.raises(ValueError, match="'toy' is not a registered codec"):
        OverlapConfig(grad_compression="toy")
    register_codec("toy", toy_factory, grad=True)
    try:
        assert OverlapConfig(grad_compression="toy").grad_compression == "toy"
        assert isinstance(make_grad_codec("toy"), ToyCodec)
        with pytest.raises(ValueError, match="param_compression='toy' is not a registered codec"):
            OverlapConfig(param_compression="toy")  # registered for gradients only
        with pytest.raises(ValueError, match="already registered"):
            register_codec("toy", toy_factory, grad=True)
        with pytest.raises(ValueError, match="per codec block: it needs grad_compression='int8' or 'int4'"):
            OverlapConfig(grad_compression="toy", error_feedback=True, error_feedback_dtype=torch.int8)
    finally:
        unregister_codec("toy")
    assert "toy" not in GRAD_CODECS
    with pytest.raises(ValueError, match="is not a registered codec"):
        OverlapConfig(grad_compression="toy")
    with pytest.raises(ValueError, match="built in"):
        unregister_codec("int8")
    with pytest.raises(ValueError, match="param=True, grad=True"):
        register_codec("toy", toy_factory)


def test_block_residual_follows_the_registered_class():
    """A blockwise codec registered by its class may keep an int8 error-feedback residual."""
    register_codec("toy8", Int8Codec, grad=True)
    try:
        OverlapConfig(grad_compression="toy8", error_feedback=True, error_feedback_dtype=torch.int8)
    finally:
        unregister_codec("toy8")


def train(rank: int, world: int, grad_compression: str | None, steps: int = 4) -> dict:
    # The registry is per process: each rank registers before it wraps.
    register_codec("toy", toy_factory, grad=True)
    try:
        torch.manual_seed(0)
        base = tiny_lm(dim=32, hidden=64)
        ours = overlap.wrap(copy.deepcopy(base), grad_compression=grad_compression)
        codec = type(ours._overlap_state.runtime.grad_codec).__name__
        opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
        losses = [loss for _, loss in train_steps(ours, opt, rank, steps)]
        shards = {n: p.to_local().detach().clone() for n, p in ours.named_parameters()}
        return {"losses": losses, "shards": shards, "codec": codec}
    finally:
        unregister_codec("toy")


def test_registered_codec_trains_bitwise_like_no_compression(world2):
    plain = world2.run(train, grad_compression=None)
    toy = world2.run(train, grad_compression="toy")
    for rank, (t, p) in enumerate(zip(toy, plain)):
        assert t["codec"] == "ToyCodec" and p["codec"] != "ToyCodec", (t["codec"], p["codec"])
        assert t["losses"] == p["losses"], (rank, t["losses"], p["losses"])
        for name, shard in p["shards"].items():
            assert torch.equal(t["shards"][name], shard), (rank, name)
