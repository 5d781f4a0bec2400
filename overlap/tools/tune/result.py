"""What `overlap.tune.tune` decided (`TuneResult`, with each halving round's `RoundResult`): its
JSON form (the cache entry and `--json`) and the printed table.

Split out of overlap/tools/tune/tuner.py, the orchestrator that builds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from overlap.config import OverlapConfig
from overlap.tools.tune.cache import config_fields
from overlap.tools.tune.space import TuneSpace, tuned_fields


@dataclass(frozen=True)
class RoundResult:
    """One round of successive halving, as rank 0 decided it (identical on every rank)."""

    num_steps: int
    candidates: tuple[int, ...]
    """Grid indices measured, in the order they ran."""
    step_ms: tuple[float, ...]
    """Score of each candidate (same order): median over steps of the slowest rank's step."""
    survivors: tuple[int, ...]
    """Grid indices kept, best first."""


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """What `tune` decided, and how. Identical on every rank."""

    config: OverlapConfig
    """The tuned config: the base config with the winner's tuned fields."""
    key: str
    cached: bool
    """True: returned from the cache, nothing measured in this call."""
    space: TuneSpace
    grid: tuple[str, ...]
    """Every grid candidate's label (`overlap.tools.tune.space.describe`), by grid index."""
    predicted_ms: tuple[float, ...]
    """The planner's step time per grid index."""
    candidates: tuple[int, ...]
    """Grid indices passed on to measurement, fastest predicted first."""
    rounds: tuple[RoundResult, ...]
    winner: int
    """Grid index of the chosen candidate."""
    profile_s: float
    measure_s: float
    """Wall time of all trials (building, warm-up and timed steps)."""
    elapsed_s: float
    """Wall time of the whole call."""
    measured_steps: int
    """Timed steps per rank over all rounds."""
    cache_file: str | None = None

    @property
    def step_ms(self) -> float | None:
        """The winner's score in the last round it was measured in (None: nothing measured)."""
        for rnd in reversed(self.rounds):
            if self.winner in rnd.candidates:
                return rnd.step_ms[rnd.candidates.index(self.winner)]
        return None

    @property
    def final_round_steps(self) -> int | None:
        return self.rounds[-1].num_steps if self.rounds else None

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "cached": self.cached,
            "config": config_fields(self.config),
            "tuned": tuned_fields(self.config),
            "space": self.space.to_dict(),
            "grid": list(self.grid),
            "predicted_ms": list(self.predicted_ms),
            "candidates": list(self.candidates),
            "rounds": [dataclasses.asdict(r) for r in self.rounds],
            "winner": self.winner,
            "profile_s": self.profile_s,
            "measure_s": self.measure_s,
            "elapsed_s": self.elapsed_s,
            "measured_steps": self.measured_steps,
            "cache_file": self.cache_file,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], base: OverlapConfig, **changes: Any) -> TuneResult:
        """Rebuild a result stored by `to_json`; the config is `base` with the stored tuned fields."""
        fields: dict[str, Any] = {
            "config": base.replace(**data["tuned"]),
            "key": data["key"],
            "cached": data["cached"],
            "space": TuneSpace.from_dict(data["space"]),
            "grid": tuple(data["grid"]),
            "predicted_ms": tuple(data["predicted_ms"]),
            "candidates": tuple(data["candidates"]),
            "rounds": tuple(
                RoundResult(r["num_steps"], tuple(r["candidates"]), tuple(r["step_ms"]), tuple(r["survivors"]))
                for r in data["rounds"]
            ),
            "winner": data["winner"],
            "profile_s": data["profile_s"],
            "measure_s": data["measure_s"],
            "elapsed_s": data["elapsed_s"],
            "measured_steps": data["measured_steps"],
            "cache_file": data.get("cache_file"),
        }
        fields.update(changes)
        return cls(**fields)

    def format(self) -> str:
        """Rounds as a table, then the decision."""
        if self.cached:
            head = f"overlap tune: cache hit {self.key} ({self.cache_file}); nothing measured"
        else:
            head = (
                f"overlap tune: {len(self.grid)} grid candidates, {len(self.candidates)} measured "
                f"after pruning, {len(self.rounds)} rounds, {self.measured_steps} timed steps per "
                f"rank; profile {self.profile_s:.1f} s, trials {self.measure_s:.1f} s, total "
                f"{self.elapsed_s:.1f} s"
            )
        width = max(len(label) for label in self.grid)
        lines = [head, f"{'round':>5} {'steps':>5}  {'candidate':<{width}} {'predicted ms':>12} {'step ms':>9}"]
        for r, rnd in enumerate(self.rounds):
            for idx, ms in sorted(zip(rnd.candidates, rnd.step_ms, strict=True), key=lambda x: x[1]):
                mark = " *" if idx in rnd.survivors else ""
                lines.append(
                    f"{r:>5} {rnd.num_steps:>5}  {self.grid[idx]:<{width}} "
                    f"{self.predicted_ms[idx]:>12.1f} {ms:>9.1f}{mark}"
                )
        lines.append(f"chosen: [{self.winner}] {self.grid[self.winner]}   (* = survived the round)")
        return "\n".join(lines)
