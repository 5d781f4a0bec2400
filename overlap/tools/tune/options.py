"""`TuneConfig`: how `overlap.tune.tune` searches (space, pruning, rounds, cache, planner costs).

Split out of overlap/tools/tune/tuner.py, the orchestrator that reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from overlap.config import OverlapConfig
from overlap.step_model.calibration import Calibration
from overlap.step_model.cost import Topology
from overlap.tools.flags import flag
from overlap.tools.tune.space import TuneSpace

CachePolicy = Literal["use", "refresh", "off"]


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """How `overlap.tune.tune` searches. Keyword overrides of `tune(...)` replace fields."""

    space: TuneSpace | None = field(default=None, metadata=flag(cli=False))
    """The grid. None: `default_space(model, base=base, allow_compression=...)`."""

    base: OverlapConfig = field(default_factory=OverlapConfig, metadata=flag(cli=False))
    """Every field the space does not set (unit policy, mixed precision, ...) comes from here.
    The base config itself is always measured when it lies in the grid."""

    allow_compression: bool = False
    """Lossy codecs change the numerics; a space holding one raises unless this is True."""

    keep_fraction: float = 0.25
    """Share of the (distinct) grid the planner passes on to measurement."""

    max_candidates: int | None = 8
    """At most this many measured candidates, whatever the fraction (None: no limit)."""

    first_round_steps: int = 1
    """Timed steps per candidate in the first round; each later round doubles them."""

    total_steps: int | None = field(
        default=None,
        metadata=flag(name="--budget", metavar="STEPS", help="timed steps per rank over all rounds "
                      "(default: 1 step per candidate in the first round)"),
    )  # fmt: skip
    """Budget: timed steps per rank over all rounds. When set, the first round gets as many steps
    as fit (at least one) and `first_round_steps` is ignored."""

    warmup_steps: int = 1
    """Untimed steps per trial after building the model (the first step records the unit order)."""

    profile_steps: int = 1
    """Timed local steps of the plain model (after one untimed) for the planner's compute costs."""

    max_unsharded_bytes: int | None = None
    """Drop candidates whose predicted peak of unsharded parameters exceeds this (a memory cap)."""

    cache: CachePolicy = field(default="use", metadata=flag(cli=False))  # --refresh / --no-cache
    """"use": return a cached config for the same key, else tune and store; "refresh": tune and
    overwrite; "off": neither read nor write."""

    cache_dir: str | None = None
    """Where entries live (None: `overlap.tools.tune.cache.default_cache_dir()`)."""

    key_extra: Mapping[str, Any] = field(default_factory=dict, metadata=flag(cli=False))
    """More of the cache key: what the model signature cannot see (batch size, sequence length)."""

    calibration: Calibration | str | Path | None = field(default=None, metadata=flag(parse=str, metavar="FILE"))
    """The planner's costs: a `Calibration` or its JSON file (`overlap plan --calibrate FILE`);
    None: the defaults for this world (`default_world_calibration`). See [Note: one model] in
    overlap/step_model/calibration.py."""

    topology: Topology | None = field(default=None, metadata=flag(cli=False))
    """The planner's links, over the calibration's (None: the calibration's, on this world's
    ranks; without a calibration on NCCL, NVLink within a node and NDR across nodes)."""

    survivor_models: Literal["auto", "keep", "rebuild"] = "auto"
    """"keep": a candidate's wrapped model lives on while it survives, so later rounds skip
    building and warming up (memory: one sharded model per first-round candidate);
    "rebuild": every trial builds its model afresh (one model in memory at a time);
    "auto": keep on CPU, rebuild on GPUs (where several copies of a large model do not fit)."""

    progress: bool = True
    """A tqdm bar on rank 0."""

    def __post_init__(self) -> None:
        if not 0.0 < self.keep_fraction <= 1.0:
            raise ValueError(f"TuneConfig.keep_fraction must be in (0, 1], got {self.keep_fraction}")
        for name in ("first_round_steps", "profile_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TuneConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"TuneConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        for name in ("max_candidates", "total_steps", "max_unsharded_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"TuneConfig.{name} must be None or an int >= 1, got {value!r}")
        if self.cache not in ("use", "refresh", "off"):
            raise ValueError(f"TuneConfig.cache must be 'use', 'refresh' or 'off', got {self.cache!r}")
        if self.space is not None and not self.space.lossless and not self.allow_compression:
            raise ValueError(
                f"TuneConfig: the space holds lossy codecs {[str(c) for c in self.space.codecs]}, "
                "which change the numerics; pass allow_compression=True to search them"
            )
        if self.survivor_models not in ("auto", "keep", "rebuild"):
            raise ValueError(
                f"TuneConfig.survivor_models must be 'auto', 'keep' or 'rebuild', got {self.survivor_models!r}"
            )
        if isinstance(self.calibration, (str, Path)):  # read once, here: a bad file fails early
            object.__setattr__(self, "calibration", Calibration.load(self.calibration))

    def replace(self, **overrides: Any) -> TuneConfig:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown TuneConfig field(s) {unknown}; fields are {sorted(names)}")
        return dataclasses.replace(self, **overrides)
