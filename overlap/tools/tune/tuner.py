"""`overlap.tune.tune`: measured tuning of an `OverlapConfig` on the world it will train in.

The orchestrator. One call, on every rank of the group:

    key      model signature, world, backend, space, options   (same on every rank, or it raises)
    cache    rank 0 looks the key up; a hit returns at once     (see [Note: tune cache key])
    profile  the plain model's step, timed per unit, on every rank at once
    prune    rank 0 simulates every grid candidate on the planner and keeps the most promising
    measure  successive halving over the kept candidates        (see [Note: successive halving])
    decide   rank 0 scores each round and broadcasts survivors  (see [Note: rank 0 decides])
    store    rank 0 writes the cache entry and, if asked, the OverlapConfig JSON

A trial rebuilds the model with `model_fn()`, wraps it under the candidate config, builds the
optimizer with `optimizer_fn`, runs `warmup_steps` untimed and then the round's timed steps of
`step_fn(model, optimizer)`. `step_fn` must also run the plain, unwrapped model (the profile uses
it): forward, backward, optimizer step, zero_grad.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from overlap.transport.backend import semantics
from overlap.config import OverlapConfig
from overlap.tools.plan.calibration import Calibration
from overlap.tools.plan.cost import Topology
from overlap.tools.tune.cache import (
    TuneKey,
    cache_path,
    config_fields,
    default_cache_dir,
    model_signature,
    read_entry,
    write_entry,
)
from overlap.tools.tune.halving import (
    HalvingRound,
    first_round_steps_for,
    halving_schedule,
    schedule_steps,
    score,
    survivors,
)
from overlap.tools.tune.measure import (
    MeasuredTrial,
    TrialFn,
    broadcast_from_rank0,
    check_same_on_all_ranks,
    gather_to_rank0,
    process_group,
)
from overlap.tools.tune.predict import (
    ModelProfile,
    OptimizerFn,
    StepFn,
    calibration_for,
    num_to_keep,
    plan_grid,
    profile_model,
    prune,
)
from overlap.tools.tune.space import Codec, TuneSpace, default_space, describe, tuned_fields

CachePolicy = Literal["use", "refresh", "off"]


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW(lr=1e-4): what a trial trains with unless the caller passes `optimizer_fn`."""
    return torch.optim.AdamW(params, lr=1e-4)


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """How `overlap.tune.tune` searches. Keyword overrides of `tune(...)` replace fields."""

    space: TuneSpace | None = None
    """The grid. None: `default_space(model, base=base, allow_compression=...)`."""

    base: OverlapConfig = field(default_factory=OverlapConfig)
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

    total_steps: int | None = None
    """Budget: timed steps per rank over all rounds. When set, the first round gets as many steps
    as fit (at least one) and `first_round_steps` is ignored."""

    warmup_steps: int = 1
    """Untimed steps per trial after building the model (the first step records the unit order)."""

    profile_steps: int = 1
    """Timed local steps of the plain model (after one untimed) for the planner's compute costs."""

    max_unsharded_bytes: int | None = None
    """Drop candidates whose predicted peak of unsharded parameters exceeds this (a memory cap)."""

    cache: CachePolicy = "use"
    """"use": return a cached config for the same key, else tune and store; "refresh": tune and
    overwrite; "off": neither read nor write."""

    cache_dir: str | None = None
    """Where entries live (None: `overlap.tools.tune.cache.default_cache_dir()`)."""

    key_extra: Mapping[str, Any] = field(default_factory=dict)
    """More of the cache key: what the model signature cannot see (batch size, sequence length)."""

    calibration: Calibration | str | Path | None = None
    """The planner's costs: a `Calibration` or its JSON file (`overlap plan --calibrate FILE`);
    None: the defaults for this world (`default_world_calibration`). See [Note: one model] in
    overlap/tools/plan/calibration.py."""

    topology: Topology | None = None
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
            raise ValueError(
                f"TuneConfig.keep_fraction must be in (0, 1], got {self.keep_fraction}"
            )
        for name in ("first_round_steps", "profile_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TuneConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(
                f"TuneConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}"
            )
        for name in ("max_candidates", "total_steps", "max_unsharded_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"TuneConfig.{name} must be None or an int >= 1, got {value!r}")
        if self.cache not in ("use", "refresh", "off"):
            raise ValueError(
                f"TuneConfig.cache must be 'use', 'refresh' or 'off', got {self.cache!r}"
            )
        if self.space is not None and not self.space.lossless and not self.allow_compression:
            raise ValueError(
                f"TuneConfig: the space holds lossy codecs {[str(c) for c in self.space.codecs]}, "
                "which change the numerics; pass allow_compression=True to search them"
            )
        if self.survivor_models not in ("auto", "keep", "rebuild"):
            raise ValueError(
                "TuneConfig.survivor_models must be 'auto', 'keep' or 'rebuild', "
                f"got {self.survivor_models!r}"
            )
        if isinstance(self.calibration, (str, Path)):  # read once, here: a bad file fails early
            object.__setattr__(self, "calibration", Calibration.load(self.calibration))

    def replace(self, **overrides: Any) -> TuneConfig:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown TuneConfig field(s) {unknown}; fields are {sorted(names)}")
        return dataclasses.replace(self, **overrides)


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
                RoundResult(
                    r["num_steps"],
                    tuple(r["candidates"]),
                    tuple(r["step_ms"]),
                    tuple(r["survivors"]),
                )
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
        lines = [
            head,
            f"{'round':>5} {'steps':>5}  {'candidate':<{width}} {'predicted ms':>12} {'step ms':>9}",
        ]
        for r, rnd in enumerate(self.rounds):
            for idx, ms in sorted(
                zip(rnd.candidates, rnd.step_ms, strict=True), key=lambda x: x[1]
            ):
                mark = " *" if idx in rnd.survivors else ""
                lines.append(
                    f"{r:>5} {rnd.num_steps:>5}  {self.grid[idx]:<{width}} "
                    f"{self.predicted_ms[idx]:>12.1f} {ms:>9.1f}{mark}"
                )
        lines.append(f"chosen: [{self.winner}] {self.grid[self.winner]}   (* = survived the round)")
        return "\n".join(lines)


def _make_key(
    model: nn.Module, pg: dist.ProcessGroup, space: TuneSpace, cfg: TuneConfig
) -> TuneKey:
    from overlap.tools.bench.link import active_link

    device = next(model.parameters()).device
    backend = semantics(pg, device).backend  # [Note: NCCL is not gloo] in backend.py
    device_kind = "cpu"
    if device.type == "cuda":
        device_kind = torch.cuda.get_device_name(torch.cuda.current_device())
    elif device.type != "cpu":
        device_kind = device.type
    return TuneKey(
        model=model_signature(model),
        world_size=pg.size(),
        backend=backend,
        device=device_kind,
        dtypes=tuple(sorted({str(p.dtype) for p in model.parameters()})),
        link=active_link(),
        space=space.to_dict(),
        base=config_fields(cfg.base),
        extra=dict(cfg.key_extra),
    )


def _plan(
    profile: ModelProfile, grid: Sequence[OverlapConfig], cfg: TuneConfig, pg: dist.ProcessGroup
) -> tuple[list[int], list[float]]:
    """Rank 0: the planner's step time for every grid candidate (ms, by grid index) and the grid
    indices worth measuring (see [Note: pruning])."""
    from overlap.tools.bench.link import active_link

    backend = semantics(pg, torch.device(profile.device_type)).backend
    given = cfg.calibration
    assert given is None or isinstance(given, Calibration), f"rank {pg.rank()}: {given!r} not loaded"
    calibration, topo = calibration_for(pg.size(), backend, active_link(), given)
    planned = plan_grid(profile, grid, pg.size(), calibration, cfg.topology or topo)
    predicted_ms = [0.0] * len(grid)
    for c in planned:
        predicted_ms[c.index] = c.step_s * 1e3
    chosen = prune(
        planned,
        num_to_keep(len(grid), cfg.keep_fraction, cfg.max_candidates),
        stratum=lambda i: Codec(
            grid[i].param_compression, grid[i].grad_compression, grid[i].error_feedback
        ),
        features=lambda i: tuple(tuned_fields(grid[i]).values()),
        must_keep=next((i for i, c in enumerate(grid) if c == cfg.base), None),
        max_unsharded_bytes=cfg.max_unsharded_bytes,
    )
    return chosen, predicted_ms


def _run_rounds(
    schedule: Sequence[HalvingRound],
    chosen: Sequence[int],
    grid: Sequence[OverlapConfig],
    labels: Sequence[str],
    trial: TrialFn,
    pg: dist.ProcessGroup,
    show_progress: bool,
) -> list[RoundResult]:
    """Successive halving; every rank runs the same trials in the same order because it only ever
    acts on rank 0's broadcast decisions (see [Note: rank 0 decides])."""
    from tqdm import tqdm

    bar = tqdm(
        total=sum(r.num_candidates for r in schedule),
        desc="overlap tune",
        unit="trial",
        disable=not show_progress,
        leave=False,
    )
    alive = list(chosen)
    rounds: list[RoundResult] = []
    try:
        for r, rnd in enumerate(schedule):
            assert len(alive) == rnd.num_candidates, (
                f"rank {pg.rank()}: round {r} has {len(alive)} candidates, expected {rnd.num_candidates}"
            )
            local: list[list[float]] = []
            for idx in alive:
                bar.set_postfix_str(f"round {r + 1}/{len(schedule)} x{rnd.num_steps} {labels[idx]}")
                times = [float(t) for t in trial(grid[idx], rnd.num_steps)]
                if len(times) != rnd.num_steps:
                    raise ValueError(
                        f"overlap.tune: the trial returned {len(times)} step times for "
                        f"{rnd.num_steps} steps"
                    )
                local.append(times)
                bar.update()
            gathered = gather_to_rank0(local, pg)
            decision: RoundResult | None = None
            if gathered is not None:  # rank 0 decides
                scores = [score([per_rank[k] for per_rank in gathered]) for k in range(len(alive))]
                keep = survivors(scores, rnd.num_survivors)
                decision = RoundResult(
                    rnd.num_steps,
                    tuple(alive),
                    tuple(s * 1e3 for s in scores),
                    tuple(alive[k] for k in keep),
                )
            decision = broadcast_from_rank0(decision, pg)
            rounds.append(decision)
            alive = list(decision.survivors)
            if isinstance(trial, MeasuredTrial):
                trial.retain([grid[i] for i in alive] if r + 1 < len(schedule) else [])
    finally:
        bar.close()
        if isinstance(trial, MeasuredTrial):
            trial.close()
    return rounds


def tune(
    model_fn: Callable[[], nn.Module],
    step_fn: StepFn,
    *,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    config: TuneConfig | None = None,
    optimizer_fn: OptimizerFn | None = None,
    trial: TrialFn | None = None,
    out: str | Path | None = None,
    **overrides: Any,
) -> TuneResult:
    """Find the fastest `OverlapConfig` in a search space by measuring on this world.

    Collective: every rank of `group` calls it with the same arguments. `model_fn()` builds a
    fresh, identically initialized model (called once per trial, and once for the key and the
    profile); `step_fn(model, optimizer)` runs one training step; `optimizer_fn(params)` builds
    the optimizer (default AdamW). `config` (or keyword overrides of its fields, e.g.
    `allow_compression=True`, `cache="off"`) says how to search. `trial` replaces the measured
    trial (tests inject fake timings through it). `out`: rank 0 saves the tuned config there as
    JSON, readable by `OverlapConfig.load`.
    """
    t_start = time.perf_counter()
    cfg = (config or TuneConfig()).replace(**overrides)
    if out is not None and cfg.base.unit_policy != "auto":
        raise ValueError(
            "overlap.tune: out= saves JSON, which holds only unit_policy='auto'; tune with the "
            "'auto' policy or save the returned config's fields yourself"
        )
    pg = process_group(group)
    rank = pg.rank()
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"overlap.tune: model_fn() must return an nn.Module, got {type(model).__name__}"
        )
    space = cfg.space or default_space(
        model, base=cfg.base, allow_compression=cfg.allow_compression
    )
    grid = space.candidates(cfg.base)
    labels = tuple(describe(c) for c in grid)
    key = _make_key(model, pg, space, cfg)
    check_same_on_all_ranks(key.digest, "tuning key (model signature, space, options)", pg)
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir is not None else default_cache_dir()

    if cfg.cache == "use":
        entry = broadcast_from_rank0(read_entry(cache_dir, key) if rank == 0 else None, pg)
        if entry is not None:
            result = TuneResult.from_json(
                entry["result"],
                cfg.base,
                cached=True,
                profile_s=0.0,
                measure_s=0.0,
                measured_steps=0,
                elapsed_s=time.perf_counter() - t_start,
                cache_file=str(cache_path(cache_dir, key)),
            )
            _save(result, out, rank)
            return result

    t_profile = time.perf_counter()
    optimizer_fn = optimizer_fn or default_optimizer
    profile = profile_model(model, step_fn, optimizer_fn, cfg.base.unit_policy, cfg.profile_steps)
    del model
    plan: tuple[list[int], list[float]] | ValueError | None = None
    if rank == 0:  # the plan depends on rank 0's profile: it decides for all
        try:
            plan = _plan(profile, grid, cfg, pg)
        except ValueError as e:  # sent to every rank, which all raise: no rank left waiting
            plan = e
    decided = cast("tuple[list[int], list[float]] | ValueError", broadcast_from_rank0(plan, pg))
    if isinstance(decided, ValueError):
        raise decided
    chosen, predicted = decided
    profile_s = time.perf_counter() - t_profile

    first = cfg.first_round_steps
    if cfg.total_steps is not None:
        first = first_round_steps_for(len(chosen), cfg.total_steps)
    schedule = halving_schedule(len(chosen), first)
    if trial is None:
        keep = cfg.survivor_models == "keep" or (
            cfg.survivor_models == "auto" and profile.device_type == "cpu"
        )
        trial = MeasuredTrial(model_fn, step_fn, optimizer_fn, pg, group, cfg.warmup_steps, keep)
    t_measure = time.perf_counter()
    rounds = _run_rounds(
        schedule, chosen, grid, labels, trial, pg, show_progress=cfg.progress and rank == 0
    )
    measure_s = time.perf_counter() - t_measure
    winner = rounds[-1].survivors[0] if rounds else chosen[0]
    result = TuneResult(
        config=grid[winner],
        key=key.digest,
        cached=False,
        space=space,
        grid=labels,
        predicted_ms=tuple(predicted),
        candidates=tuple(chosen),
        rounds=tuple(rounds),
        winner=winner,
        profile_s=profile_s,
        measure_s=measure_s,
        elapsed_s=time.perf_counter() - t_start,
        measured_steps=schedule_steps(schedule),
        cache_file=None,
    )
    if cfg.cache != "off":
        stored = _store(cache_dir, key, result) if rank == 0 else None
        result = dataclasses.replace(result, cache_file=broadcast_from_rank0(stored, pg))
    _save(result, out, rank)
    return result


def _store(cache_dir: Path, key: TuneKey, result: TuneResult) -> str | None:
    """Rank 0 writes the cache entry; a failure is a warning (the result stands), not an error
    that would leave the other ranks waiting for the broadcast."""
    try:
        return str(write_entry(cache_dir, key, {"result": result.to_json()}))
    except OSError as e:
        warnings.warn(
            f"overlap.tune: could not write the cache entry in {cache_dir}: {e}", stacklevel=3
        )
        return None


def _save(result: TuneResult, out: str | Path | None, rank: int) -> None:
    if out is not None and rank == 0:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        result.config.save(path)
