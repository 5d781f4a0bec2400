"""Inputs of the kernel tests, also imported by tests/unit/triton_interpreter_check.py (run in a
fresh process with the tests folder on its path)."""

from __future__ import annotations

import torch


def random_input(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Wide dynamic range across blocks, some zeros, and (in fp32) a denormal."""
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(6) * 100
    x[:: max(1, numel // 5)] = 0.0
    if dtype == torch.float32 and numel > 3:
        x[numel // 3] = 3e-41
    return x.to(dtype)
