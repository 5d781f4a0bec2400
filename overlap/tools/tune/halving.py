"""Successive halving, as pure arithmetic: rounds, survivors, scores. No clocks, no ranks.

[Note: successive halving]
Round r measures n_r candidates for s_r = s_0 * 2**r timed steps each; the best ceil(n_r / 2)
survive to round r + 1, until one is left. Every round costs about the same number of steps
(n_r * s_r ~ n_0 * s_0), the survivors are measured ever longer, and a candidate that is clearly
worse is dropped after a few cheap steps. Since ceil(3 / 2) = 2, the last round always
decides between two candidates, with the most steps of all.
A candidate's score is the median over its timed steps of the slowest rank's time: a step ends
when its slowest rank ends, and the median ignores one step disturbed by the machine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HalvingRound:
    """One round: how many candidates are measured, for how many timed steps each, and how many
    of them survive into the next round."""

    num_candidates: int
    num_steps: int
    num_survivors: int

    @property
    def num_measured_steps(self) -> int:
        return self.num_candidates * self.num_steps


def halving_schedule(num_candidates: int, first_round_steps: int) -> tuple[HalvingRound, ...]:
    """The rounds that take `num_candidates` down to one (see [Note: successive halving]).

    One candidate needs no measuring: no rounds.
    """
    if num_candidates < 1:
        raise ValueError(f"halving_schedule: num_candidates must be >= 1, got {num_candidates}")
    if first_round_steps < 1:
        raise ValueError(f"halving_schedule: first_round_steps must be >= 1, got {first_round_steps}")
    rounds = []
    n, steps = num_candidates, first_round_steps
    while n > 1:
        keep = math.ceil(n / 2)
        rounds.append(HalvingRound(n, steps, keep))
        n, steps = keep, steps * 2
    return tuple(rounds)


def schedule_steps(rounds: Sequence[HalvingRound]) -> int:
    """Timed steps (per rank) the whole schedule measures."""
    return sum(r.num_measured_steps for r in rounds)


def first_round_steps_for(num_candidates: int, total_steps: int) -> int:
    """The largest first-round step count whose schedule measures at most `total_steps` timed
    steps (at least 1, even when the budget is smaller than one step per candidate)."""
    if total_steps < 1:
        raise ValueError(f"first_round_steps_for: total_steps must be >= 1, got {total_steps}")
    per_unit = schedule_steps(halving_schedule(num_candidates, 1))  # linear in s_0
    return max(1, total_steps // per_unit) if per_unit else 1


def score(step_s_by_rank: Sequence[Sequence[float]]) -> float:
    """Median over steps of the slowest rank's step time (see [Note: successive halving])."""
    if not step_s_by_rank or not step_s_by_rank[0]:
        raise ValueError("score: need at least one rank and one step")
    num_steps = len(step_s_by_rank[0])
    if any(len(times) != num_steps for times in step_s_by_rank):
        raise ValueError("score: every rank must report the same number of steps")
    return statistics.median(max(step) for step in zip(*step_s_by_rank, strict=True))


def survivors(scores: Sequence[float], num_keep: int) -> list[int]:
    """Positions of the `num_keep` lowest scores, best first; ties go to the earlier position
    (deterministic, so a decision never depends on dict or set order)."""
    if not 1 <= num_keep <= len(scores):
        raise ValueError(f"survivors: num_keep must be in 1..{len(scores)}, got {num_keep}")
    return sorted(range(len(scores)), key=lambda i: (scores[i], i))[:num_keep]
