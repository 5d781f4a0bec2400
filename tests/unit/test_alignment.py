"""Every row the copy kernels read or write stays a multiple of 16 elements at world size >= 2:
the tag behind each gathered shard and the used-flag columns of each
reduction are padded to the chunk alignment, so the copy-out and copy-in keep their aligned,
vectorized branch ([Note: flat layout] in overlap/engine/units.py). And every copy-in's sources
share one dtype, the used flags that of the gradients, so that it is one Triton launch
([Note: copy alignment] in overlap/kernels/triton_copy.py)."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import World
from helpers.models import batch, loss_of, tiny_lm

import overlap
from overlap import kernels
from overlap.engine.units import CHUNK_ALIGN_NUMEL
from overlap.transport import collectives as comm

GATHERS = ("all_gather_flat", "all_gather_pair")
REDUCTIONS = ("reduce_scatter_flat", "reduce_scatter_and_gather")


@pytest.fixture(scope="module")
def world2():
    w = World(2)
    yield w
    w.close()


def row_lengths(rank: int, world: int, overrides: dict) -> dict:
    """The elements per rank-major row of every all-gather and reduce-scatter of two steps."""
    rows: dict[str, list[int]] = {"gather": [], "reduce": []}

    def recording(name: str, fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            first = args[0]
            if name in GATHERS:
                rows["gather"].append(first.numel())  # one rank's shard and its tag
            elif name == "reduce_scatter_flat":
                rows["reduce"].append(first.numel() // world)
            else:
                rows["reduce"].append(args[1])  # the reduction's columns of the fused rows
            return fn(*args, **kwargs)

        return call

    originals = {name: getattr(comm, name) for name in GATHERS + REDUCTIONS}
    model = overlap.wrap(tiny_lm(), **overrides)
    for name, fn in originals.items():
        setattr(comm, name, recording(name, fn))
    try:
        for step in range(2):
            loss_of(model(batch(model, rank, step))).backward()
    finally:
        for name, fn in originals.items():
            setattr(comm, name, fn)
    return rows


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"all_gather_impl": "native", "reduce_scatter_impl": "native"}, id="native"),
    ],
)
def test_rows_stay_aligned(world2, overrides):
    for rows in world2.run(row_lengths, overrides=overrides):
        assert rows["gather"] and rows["reduce"], rows
        for kind, lengths in rows.items():
            assert all(n % CHUNK_ALIGN_NUMEL == 0 for n in lengths), (kind, lengths)


def copy_in_dtypes(rank: int, world: int, overrides: dict) -> list[list[str]]:
    """The dtypes of the sources of every copy-in the runtime checks (once per bucket layout,
    then bound with the same dtypes) in two steps."""
    seen: list[list[str]] = []
    original = kernels.copy_in

    def recording(srcs, flat, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(sorted({str(t.dtype) for t in srcs if t is not None}))
        return original(srcs, flat, **kwargs)

    model = overlap.wrap(tiny_lm(), **overrides)
    kernels.copy_in = recording
    try:
        for step in range(2):
            loss_of(model(batch(model, rank, step))).backward()
    finally:
        kernels.copy_in = original
    return seen


def test_copy_in_sources_share_one_dtype(world2):
    """bf16 parameters reduced in fp32: the used flags ride in the gradients' dtype, not the
    reduce dtype (a second launch per bucket), exact either way (0 and 1)."""
    overrides = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    for seen in world2.run(copy_in_dtypes, overrides=overrides):
        assert seen and all(dtypes == ["torch.bfloat16"] for dtypes in seen), seen
