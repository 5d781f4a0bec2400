"""What a rank's test function watches: the gradient reductions issued, the error a call raises."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from overlap.compression import IdentityCodec
from overlap.transport import coded
from overlap.transport import collectives as comm

REDUCTIONS = ("reduce_scatter_flat", "reduce_scatter_and_gather", "reduce_scatter_encoded")
"""Every gradient reduction goes through one of these (small gathers use all-to-all too)."""


@contextlib.contextmanager
def counting_reductions() -> Iterator[list[int]]:
    """A list that gets one entry per gradient reduction issued inside the block."""
    calls: list[int] = []
    owner = {name: coded if name.endswith("_encoded") else comm for name in REDUCTIONS}
    originals = {name: getattr(owner[name], name) for name in REDUCTIONS}
    for name, fn in originals.items():
        setattr(owner[name], name, lambda *a, _fn=fn, **k: (calls.append(1), _fn(*a, **k))[1])
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(owner[name], name, fn)


def identity_codecs(model: Any) -> None:
    """Send `model`'s gathers and reductions through the compressed code path with a codec that
    changes nothing (bitwise the uncompressed results)."""
    model._overlap_state.runtime.param_codec = IdentityCodec()
    model._overlap_state.runtime.grad_codec = IdentityCodec()


def error_of(call: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """The message of the ValueError `call(*args, **kwargs)` raises, else "no error"."""
    try:
        call(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"
