"""Gradient accumulation under no_sync sums in reduce_dtype when it is wider than param_dtype
([Note: no_sync in reduce_dtype] in overlap/engine/reduction.py): with
param_dtype=bf16 and reduce_dtype=fp32, micro-batches add up in fp32, as FSDP2 does, not in bf16."""

from __future__ import annotations

import torch
from helpers.models import batch, loss_of, tiny_lm

import overlap

MICRO_BATCHES = 4


def accumulated_vs_reduced_each_time(rank: int, world: int) -> float:
    """The worst relative difference between the gradient shards of micro-batches accumulated
    under no_sync and those of the same micro-batches each reduced (fp32 sums of the same bf16
    gradients, in another order: equal up to fp32 rounding)."""
    config = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    accumulated = overlap.wrap(tiny_lm(), **config)
    reduced = overlap.wrap(tiny_lm(), **config)
    for micro in range(MICRO_BATCHES):
        x = batch(accumulated, rank, micro)
        if micro < MICRO_BATCHES - 1:
            with overlap.no_sync(accumulated):
                loss_of(accumulated(x)).backward()
        else:
            loss_of(accumulated(x)).backward()
        loss_of(reduced(x)).backward()  # no zero_grad: the reduced shards add up in fp32
    worst = 0.0
    for (name, a), (_, b) in zip(accumulated.named_parameters(), reduced.named_parameters()):
        ga, gb = a.grad.to_local(), b.grad.to_local()
        assert ga.dtype == gb.dtype == torch.float32, name
        scale = gb.abs().max().clamp_min(1e-30)
        worst = max(worst, ((ga - gb).abs().max() / scale).item())
    return worst


def test_no_sync_accumulates_in_reduce_dtype(world2):
    for worst in world2.run(accumulated_vs_reduced_each_time):
        assert worst < 1e-5, f"micro-batches summed in bf16? worst relative difference {worst:.2e}"
