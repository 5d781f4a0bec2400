"""Config search on the simulator: a small grid over the OverlapConfig fields that move step time.

Fields searched (`SearchSpace`): unit granularity (`min_unit_numel`, as whole blocks per unit),
`prefetch_depth`, `reduce_scatter_bucket_bytes` (as blocks' worth of gradients),
`reshard_after_forward`, and, only when asked for because they change numerics, the lossy codecs
`param_compression` / `grad_compression`. Everything else is kept from the base config.

Ranking: configs that fit the GPU's memory first, then the shortest predicted step, then the
least memory. `search()` simulates the whole grid; `refine()` walks from a starting config one
field at a time (coordinate descent), which is what the scaling curve uses at every size.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from overlap.config import OverlapConfig
from overlap.tools.plan.estimate import Cluster, Estimate, dtype_bytes, estimate
from overlap.tools.plan.models import ModelProfile


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Values tried per field. Granularity and buckets are in blocks (transformer layers)."""

    blocks_per_unit: tuple[int, ...] = (1, 2, 4)
    prefetch_depth: tuple[int, ...] = (1, 2)
    bucket_blocks: tuple[int, ...] = (0, 2)
    """reduce_scatter_bucket_bytes = this many blocks' gradients (0: each unit on its own)."""
    reshard_after_forward: tuple[bool, ...] = (True, False)
    param_compression: tuple[str | None, ...] = (None,)
    grad_compression: tuple[str | None, ...] = (None,)

    def __post_init__(self) -> None:
        for name in (
            "blocks_per_unit",
            "prefetch_depth",
            "bucket_blocks",
            "reshard_after_forward",
            "param_compression",
            "grad_compression",
        ):
            if not getattr(self, name):
                raise ValueError(f"SearchSpace.{name} needs at least one value")

    @classmethod
    def with_codecs(cls) -> SearchSpace:
        """The default space plus the lossy codecs (--search-codecs)."""
        return cls(param_compression=(None, "int8"), grad_compression=(None, "bf16", "int8"))

    def axes(self, profile: ModelProfile, base: OverlapConfig) -> dict[str, tuple[object, ...]]:
        """OverlapConfig field -> values, converted from blocks to elements and bytes."""
        block_numel = max(profile.block_numels)
        _, reduce_b = dtype_bytes(base)
        return {
            "min_unit_numel": tuple(0 if k <= 1 else k * block_numel for k in self.blocks_per_unit),
            "prefetch_depth": self.prefetch_depth,
            "reduce_scatter_bucket_bytes": tuple(k * block_numel * reduce_b for k in self.bucket_blocks),
            "reshard_after_forward": self.reshard_after_forward,
            "param_compression": self.param_compression,
            "grad_compression": self.grad_compression,
        }


def rank_key(e: Estimate) -> tuple[bool, float, float]:
    """Sort key: configs that fit first, fastest first, then the least memory; among configs
    that do not fit, the least memory first (the closest to a plan that runs)."""
    if e.fits:
        return (False, e.step_s, e.memory.total_bytes)
    return (True, e.memory.total_bytes, e.step_s)


@dataclass
class SearchResult:
    best: Estimate
    ranked: list[Estimate]
    """Every config simulated, best first."""
    num_simulated: int = 0
    cache: dict[OverlapConfig, Estimate] = field(default_factory=dict, repr=False)


class _Evaluator:
    """`estimate()` with a cache: coordinate descent revisits configs."""

    def __init__(self, profile: ModelProfile, cluster: Cluster) -> None:
        self.profile, self.cluster = profile, cluster
        self.cache: dict[OverlapConfig, Estimate] = {}

    def __call__(self, config: OverlapConfig) -> Estimate:
        if config not in self.cache:
            self.cache[config] = estimate(self.profile, config, self.cluster)
        return self.cache[config]

    def result(self) -> SearchResult:
        ranked = sorted(self.cache.values(), key=rank_key)
        return SearchResult(ranked[0], ranked, len(self.cache), self.cache)


def _valid(base: OverlapConfig, overrides: dict[str, object]) -> OverlapConfig | None:
    if base.error_feedback and overrides.get("grad_compression", base.grad_compression) is None:
        return None  # error feedback needs a gradient codec
    return base.replace(**overrides)


def search(
    profile: ModelProfile, base: OverlapConfig, cluster: Cluster, space: SearchSpace | None = None
) -> SearchResult:
    """Simulate every config of the grid (fields outside the space come from `base`)."""
    axes = (space or SearchSpace()).axes(profile, base)
    evaluate = _Evaluator(profile, cluster)
    evaluate(base)
    for values in itertools.product(*axes.values()):
        config = _valid(base, dict(zip(axes, values)))
        if config is not None:
            evaluate(config)
    return evaluate.result()


def refine(
    profile: ModelProfile,
    starts: list[OverlapConfig],
    cluster: Cluster,
    space: SearchSpace | None = None,
    max_rounds: int = 4,
) -> SearchResult:
    """Coordinate descent from the best of `starts`: try every value of one field at a time,
    move to the best neighbour, stop when no single-field change helps."""
    axes = (space or SearchSpace()).axes(profile, starts[0])
    evaluate = _Evaluator(profile, cluster)
    current = min((evaluate(c) for c in starts), key=rank_key)
    for _ in range(max_rounds):
        neighbours = [
            _valid(current.config, {name: value})
            for name, values in axes.items()
            for value in values
            if getattr(current.config, name) != value
        ]
        best = min((evaluate(c) for c in neighbours if c is not None), key=rank_key, default=current)
        if rank_key(best) >= rank_key(current):
            break
        current = best
    return evaluate.result()


def describe(config: OverlapConfig, profile: ModelProfile, base: OverlapConfig | None = None) -> str:
    """The searched fields of `config`, in blocks where that reads better, e.g.
    "2 blocks/unit (min_unit_numel=436207616), prefetch_depth=2, ..."."""
    block = max(profile.block_numels)
    _, reduce_b = dtype_bytes(config)
    per_unit = max(1, -(-config.min_unit_numel // block))  # group_units merges up to >= min
    bucket = config.reduce_scatter_bucket_bytes
    parts = [
        f"{per_unit} block{'s' if per_unit > 1 else ''}/unit (min_unit_numel={config.min_unit_numel})",
        f"prefetch_depth={config.prefetch_depth}",
        "reduce_scatter_bucket_bytes=0 (per unit)"
        if bucket == 0
        else f"reduce_scatter_bucket_bytes={bucket} ({bucket / (block * reduce_b):.3g} blocks)",
        f"reshard_after_forward={config.reshard_after_forward}",
    ]
    for name in ("param_compression", "grad_compression", "max_inflight_allgather_bytes"):
        value = getattr(config, name)
        if value is not None or (base is not None and getattr(base, name) is not None):
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)
