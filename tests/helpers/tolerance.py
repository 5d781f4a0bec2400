"""What the parity tests may call bitwise, and the tolerance of what they may not.

[Note: what is bitwise]
Floating-point results are bitwise reproducible when the same operations run on the same data in
the same order. That is a property of the algorithm, not of the machine, and it is what our parity
tests assert with `torch.equal` / `==` against DDP (or a single-rank reference):

- forward and backward of the same model on the same batch: after the all-gather every rank holds
  the whole parameters, and the ops see the same shapes and values as DDP's;
- the cross-rank gradient sum: an elementwise sum in a fixed rank order, the same at 2 ranks as
  DDP's all-reduce (a + b == b + a); at 4 ranks gloo's ring all-reduce associates each chunk
  differently, so world-4 parity is within rounding (test_parity's world-4 cases);
- elementwise optimizer steps (SGD, Adam, AdamW) on a shard: every element is computed by the same
  expression as the whole tensor's;
- save, load, resume, reshard and export: copies, no arithmetic; and any rerun of our own code
  path against itself.

Not bitwise, on some machine or thread count, even though equal on the one a test was written on:

- a reduction whose order differs between a sharded and a whole tensor: the global gradient norm of
  `clip_grad_norm_` is a sum of per-shard partial sums, DDP's a norm of per-tensor norms, and
  torch's CPU reductions block their sums by the vector width (8 floats under AVX2, 16 under
  AVX-512) and by the thread count, so the two roundings agree on one machine and not on the next.
  Everything after the first clipped step inherits it: the clip factor, then parameters and losses.
- a vectorized body against a scalar tail at a different offset (an op whose vector and scalar
  code round differently, applied to a shard whose tail falls inside DDP's whole tensor);
- sums associated differently (a world of 4 on gloo, HSDP's all-reduce after the reduce-scatter).

These are asserted within `reordered_rtol(numel, steps)`: the textbook bound for a sum of `numel`
terms summed blockwise/pairwise in another order is about log2(numel) units in the last place, and
each of `steps` optimizer steps can add one such error on top of the previous ones. The tolerance is
relative to the largest magnitude of the reference tensor (`assert_reordered`), so a parameter
element near zero is not held to a relative bound it cannot meet. A claim of bitwise equality that
depends on vector width, thread count or reduction order is luck, not a property: tests run green
under `ATEN_CPU_CAPABILITY=default|avx2|avx512` and `OMP_NUM_THREADS=1|2` (README "Tests").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


def shard_rows(full: torch.Tensor, local: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The rows of the whole tensor `full` that rank `rank` of `world` holds as `local` (dim 0
    split in ceil(rows / world) chunks, the last one short)."""
    rows = -(-full.shape[0] // world)
    return full[rank * rows : rank * rows + local.shape[0]]


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| relative to a's largest magnitude (0 for empty tensors)."""
    if a.numel() == 0:
        return 0.0
    return (a.float() - b.float()).abs().max().item() / max(a.abs().max().item(), 1e-12)


def reordered_rtol(numel: int, steps: int = 1, dtype: torch.dtype = torch.float32) -> float:
    """The tolerance of [Note: what is bitwise] for a result that went through `steps` updates,
    each from a sum of `numel` terms taken in another order: steps * (log2(numel) + 1) * eps."""
    assert numel >= 1 and steps >= 1, (numel, steps)
    return steps * (math.log2(numel) + 1) * torch.finfo(dtype).eps


def reordered_mismatches(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], rtol: float
) -> list[str]:
    """Names whose tensors differ by more than `rtol` times the reference's largest magnitude
    (or differ in shape/dtype), each with its worst difference."""
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    bad = []
    for name, want in expected.items():
        got = actual[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            bad.append(f"{name}: {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}")
            continue
        scale = want.detach().abs().max().item() if want.numel() else 0.0
        worst = (got.detach() - want.detach()).abs().max().item() if want.numel() else 0.0
        if not worst <= rtol * scale:  # `not <=` also catches a NaN
            bad.append(f"{name}: max |diff| {worst:.3g} > {rtol:.3g} x {scale:.3g}")
    return bad


def losses_within(actual: Sequence[float], expected: Sequence[float], rtol: float) -> bool:
    """Every loss of `actual` within `rtol` (relative) of the same step's loss in `expected`."""
    return len(actual) == len(expected) and all(abs(a - e) <= rtol * abs(e) for a, e in zip(actual, expected))
