"""The busiest expert-parallel rank under forced load balancing's random router: the closed form of
[Note: forced-balance skew] against sampled routing, and what moe_seconds charges for it."""

from __future__ import annotations

import math

import pytest
import torch

from overlap.step_model.hardware import ACCELERATORS
from overlap.step_model.moe import MoeShape, moe_seconds
from overlap.step_model.moe_skew import copies_variance, expected_max_normal, forced_balance_skew, routing_skew


def _sampled_rank_copies(moe: MoeShape, ep: int, tokens: int, trials: int) -> torch.Tensor:
    """(trials, ep) copies each rank receives when every token takes the top k of normal logits,
    group-limited as Megatron-Core's router does (top group_topk groups by their top-2 sum)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(trials, tokens * ep, moe.num_experts, generator=gen)
    if moe.groups > 1:
        per_group = moe.num_experts // moe.groups
        grouped = logits.view(trials, tokens * ep, moe.groups, per_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(-1, group_scores.topk(moe.group_topk, dim=-1).indices, 1.0)
        logits = logits.masked_fill(keep.repeat_interleave(per_group, dim=-1) == 0, float("-inf"))
    experts = logits.topk(moe.top_k, dim=-1).indices
    ranks = experts // (moe.num_experts // ep)
    return torch.nn.functional.one_hot(ranks, ep).sum(dim=(1, 2)).double()


def test_expected_max_normal_matches_closed_forms() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)


PLAIN = MoeShape(num_experts=32, top_k=4, expert_ffn_hidden=8)
GROUPED = MoeShape(num_experts=32, top_k=4, expert_ffn_hidden=8, groups=4, group_topk=2)


@pytest.mark.parametrize("moe", [PLAIN, GROUPED], ids=["plain", "group-limited"])
def test_variance_and_busiest_rank_match_sampled_routing(moe: MoeShape) -> None:
    ep, tokens, trials = 8, 256, 200
    copies = _sampled_rank_copies(moe, ep, tokens, trials)
    assert copies.sum(dim=1).eq(tokens * ep * moe.top_k).all()
    # the ranks' copies sum to a constant, so their spread about the mean (over ep, not ep - 1) is
    # each rank's variance
    per_token_var = copies.var(dim=1, unbiased=False).mean().item() / (tokens * ep)
    assert per_token_var == pytest.approx(copies_variance(moe, ep), rel=0.1)
    sampled_skew = (copies.max(dim=1).values.mean() / (tokens * moe.top_k)).item()
    assert sampled_skew - 1 == pytest.approx(forced_balance_skew(moe, ep, tokens) - 1, rel=0.1)


def test_skew_applies_only_to_forced_balancing_without_capacity() -> None:
    moe = MoeShape(num_experts=128, top_k=8, expert_ffn_hidden=768)
    assert routing_skew(moe, 8, 4096, force_balance=False, capacity_factor=None) == 1.0
    assert routing_skew(moe, 8, 4096, force_balance=True, capacity_factor=1.0) == 1.0
    assert routing_skew(moe, 1, 4096, force_balance=True, capacity_factor=None) == 1.0
    skew = routing_skew(moe, 8, 4096, force_balance=True, capacity_factor=None)
    assert 1.005 < skew < 1.01  # about one percent at these batch sizes ([Note: forced-balance skew])
    assert forced_balance_skew(moe, 8, 16384) - 1 == pytest.approx((skew - 1) / 2, rel=1e-6)  # 1/sqrt(tokens)


def test_moe_seconds_runs_the_busiest_ranks_experts_and_copies() -> None:
    moe, gpu = MoeShape(num_experts=128, top_k=8, expert_ffn_hidden=768), ACCELERATORS["h100-sxm"]
    plain = moe_seconds(moe, 2048, 4096, gpu, ep=8)
    forced = moe_seconds(moe, 2048, 4096, gpu, ep=8, force_balance=True)
    skew = forced_balance_skew(moe, 8, 4096)
    assert forced.expert_forward_s == pytest.approx(plain.expert_forward_s * skew)
    assert forced.act_forward_s == pytest.approx(plain.act_forward_s * skew)
    assert forced.dispatch_bytes == pytest.approx(plain.dispatch_bytes * skew)
