"""How much more than its share the busiest rank of an expert-parallel group receives when the
router picks experts at random (Megatron-Core's `moe_router_force_load_balancing`).

[Note: forced-balance skew]
Forced load balancing replaces the router's logits by normal random numbers drawn from the
expert-parallel RNG tracker, "random values with different seed for each rank" (`RandomSTE`,
megatron/core/transformer/moe/moe_utils.py); that tracker is seeded with
`seed + 1024 + 100 * expert_model_parallel_rank + expert_tensor_parallel_rank`
(`model_parallel_cuda_manual_seed`, megatron/core/tensor_parallel/random.py,
https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/tensor_parallel/random.py), so the
ranks of an EP group draw independent streams. Every token's top k of i.i.d. logits is a uniformly
random k-subset of the E experts (under group-limited routing, a uniform g of the G groups, then a
uniform k-subset of their experts). So the copies one token sends to the E/EP experts of a given
rank are hypergeometric: from a population of M experts (E, or the g·E/G of the chosen groups,
reached with probability g/G when the rank's experts lie in one group), K = E/EP of them the
rank's, k drawn, mean k·K/M and variance k·(K/M)·(1 - K/M)·(M - k)/(M - 1).

Over the group's t·EP tokens a rank receives μ = t·k copies on average with variance
σ² = t·EP·Var; the EP counts sum to exactly t·EP·k, so they are exchangeable normals whose
deviations sum to zero, and the largest exceeds μ by σ·z(EP)·sqrt(EP / (EP - 1)) in expectation,
z(n) the expected largest of n independent standard normals. Each MoE layer's dispatch and combine
end when the busiest rank has received and sent its copies, and the combine starts when that rank
has run its experts, so the layer runs at the busiest rank's load: its experts' balanced seconds
and its all-to-all bytes times `forced_balance_skew` (the balanced rows keep their whole tiles:
each expert's count varies around the mean, so scaling the rows across a tile boundary would
charge padding no expert pays). At 4,096 tokens a rank this is about one percent (Qwen3-30B-A3B
at EP 8: 1.008; DeepSeek-V3 at EP 64: 1.013; GPT-OSS 120B, top 4, at EP 8: 1.011): random routing
is balanced to within a percent or two at these batch sizes, so the rank skew it leaves is not what
makes published expert-parallel steps slower than their kernels.
"""

from __future__ import annotations

import math
from typing import Protocol


class MoeShape(Protocol):
    """What the skew reads of a MoE layer's routing (`overlap.step_model.moe.MoeShape` has it;
    named here, not imported: moe.py imports this module)."""

    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def groups(self) -> int: ...
    @property
    def group_topk(self) -> int: ...


_GRID = 4000
_SPAN = 9.0


def expected_max_normal(n: int) -> float:
    """E[max of `n` independent standard normals] (0 for one), by the midpoint rule on ±9."""
    if n <= 1:
        return 0.0
    step = 2 * _SPAN / _GRID
    total = 0.0
    for i in range(_GRID):
        x = -_SPAN + (i + 0.5) * step
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2)))
        total += x * n * pdf * cdf ** (n - 1) * step
    return total


def _hypergeometric_moments(population: int, successes: int, draws: int) -> tuple[float, float]:
    """(mean, variance) of the successes among `draws` taken without replacement."""
    p = successes / population
    var = draws * p * (1 - p) * (population - draws) / (population - 1) if population > 1 else 0.0
    return draws * p, var


def copies_variance(moe: MoeShape, ep: int) -> float:
    """Variance of the copies one token sends to one rank's experts under random routing ([Note:
    forced-balance skew])."""
    local = moe.num_experts // ep
    if moe.groups > 1 and ep % moe.groups == 0:  # the rank's experts lie in one group
        reach = moe.group_topk / moe.groups
        mean, var = _hypergeometric_moments(moe.group_topk * moe.num_experts // moe.groups, local, moe.top_k)
        return reach * (var + mean * mean) - (reach * mean) ** 2
    return _hypergeometric_moments(moe.num_experts, local, moe.top_k)[1]


def forced_balance_skew(moe: MoeShape, ep: int, tokens: float) -> float:
    """Expected copies the busiest of `ep` ranks receives over the mean, each rank routing `tokens`
    tokens at random ([Note: forced-balance skew]); 1 without expert parallelism."""
    if ep <= 1 or tokens <= 0:
        return 1.0
    mean = tokens * moe.top_k
    sigma = math.sqrt(tokens * ep * copies_variance(moe, ep))
    return 1.0 + sigma * expected_max_normal(ep) * math.sqrt(ep / (ep - 1)) / mean


def routing_skew(moe: MoeShape, ep: int, tokens: float, *, force_balance: bool, capacity_factor: float | None) -> float:
    """The busiest rank's rows over the balanced rows that price a MoE layer: `forced_balance_skew`
    under forced balancing without a capacity factor (which pads to a size known in advance), else
    1 (a learned router's skew is unpublished)."""
    if not force_balance or capacity_factor is not None:
        return 1.0
    return forced_balance_skew(moe, ep, tokens)


__all__ = ["copies_variance", "expected_max_normal", "forced_balance_skew", "routing_skew"]
