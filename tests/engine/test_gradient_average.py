"""How the sum of the ranks' gradients becomes their mean ([Note: dividing the sum] in
overlap/engine/reduction.py): the backend's ReduceOp.AVG where it
has one (NCCL, fp32 and bf16), fp16 divided before and after the sum so that the sum of scaled
gradients stays in range, and one division after the sum otherwise."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from helpers.harness import World

import overlap
from overlap.engine.reduction import gradient_divisors
from overlap.transport.backend import CommSemantics
from overlap.transport.strategy import ReduceScatter, Wire


@pytest.mark.parametrize("ranks", [2, 3, 4, 6, 8, 16, 64, 1024])
def test_fp16_divides_before_and_after_the_sum(ranks):
    pre, post, native = gradient_divisors(ranks, torch.float16, native_average=True)
    assert not native  # fp16 never relies on the backend's mean
    assert pre * post == ranks
    assert pre == 2 ** round(math.log2(pre))  # a power of two: the division before is exact
    assert math.sqrt(ranks) <= pre * math.sqrt(2) and post <= pre * math.sqrt(2)  # neither side alone


def test_divisors_by_dtype_and_backend():
    assert gradient_divisors(1, torch.float16, True) == (1.0, 1.0, False)  # nothing to average
    assert gradient_divisors(4, torch.float32, True) == (1.0, 1.0, True)
    assert gradient_divisors(4, torch.bfloat16, True) == (1.0, 1.0, True)
    assert gradient_divisors(4, torch.float32, False) == (1.0, 4.0, False)
    assert gradient_divisors(2, torch.float16, False) == (2.0, 1.0, False)  # DDP's g/2 + g/2


def test_only_nccl_on_a_device_averages_natively():
    assert CommSemantics("cuda", "nccl", True).native_average
    assert not CommSemantics("cuda", "gloo", False).native_average  # gloo raises on ReduceOp.AVG
    assert not CommSemantics("cpu", "gloo", False).native_average

    def averages(backend: str, impl: str, dtype: torch.dtype) -> bool:
        strategy = ReduceScatter()
        semantics = CommSemantics("cuda", backend, backend == "nccl")
        strategy.plan(Wire(None, 0, 2, torch.device("cuda"), semantics, "auto", impl, None))  # type: ignore[arg-type]
        return strategy.averages(dtype)

    assert averages("nccl", "native", torch.float32) and averages("nccl", "native", torch.bfloat16)
    assert not averages("nccl", "native", torch.float16)  # divided before and after instead
    assert not averages("gloo", "native", torch.float32)


class Scaled(nn.Module):
    """loss = sum(w * x): the gradient of `w` is `x`, whatever scale a test gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def fp16_mean_of_large_gradients(rank: int, world: int) -> list[float]:
    """Each rank's fp16 gradient is 40000 (as GradScaler makes them); their sum, 80000, is past
    fp16's largest value (65504), their mean is not."""
    model = overlap.wrap(Scaled(), param_dtype=torch.float16)
    model(torch.full((64,), 40000.0, dtype=torch.float16)).backward()
    grad = model.w.grad.to_local()
    assert grad.dtype == torch.float32  # the master shard's dtype
    return grad.unique().tolist()


def test_fp16_sum_of_scaled_gradients_stays_finite():
    world = World(2)
    try:
        for rank, values in enumerate(world.run(fp16_mean_of_large_gradients)):
            assert values == [40000.0], f"rank {rank}: {values} (the fp16 sum overflowed?)"
    finally:
        world.close()
