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

`TuneConfig` lives in options.py and `TuneResult`, `RoundResult` in result.py; both are
importable from here.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from overlap.config import OverlapConfig
from overlap.step_model.calibration import Calibration
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

# How tune searches (importable from here too): overlap/tools/tune/options.py
from overlap.tools.tune.options import CachePolicy, TuneConfig
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

# What it decided: overlap/tools/tune/result.py
from overlap.tools.tune.result import RoundResult, TuneResult
from overlap.tools.tune.space import Codec, TuneSpace, default_space, describe, tuned_fields
from overlap.tools.worlds.link import active_link
from overlap.transport.backend import semantics
from overlap.transport.shm import usable_here

__all__ = ["CachePolicy", "RoundResult", "TuneConfig", "TuneResult", "default_optimizer", "tune"]


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW(lr=1e-4): what a trial trains with unless the caller passes `optimizer_fn`."""
    return torch.optim.AdamW(params, lr=1e-4)


def _make_key(model: nn.Module, pg: dist.ProcessGroup, space: TuneSpace, cfg: TuneConfig) -> TuneKey:
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
    backend = semantics(pg, torch.device(profile.device_type)).backend
    given = cfg.calibration
    assert given is None or isinstance(given, Calibration), f"rank {pg.rank()}: {given!r} not loaded"
    link = active_link()  # a local world: one host, shared memory unless behind an emulated link
    shm = link is None and usable_here(torch.device(profile.device_type), cfg.base.shared_memory, pg.size())
    calibration, topo = calibration_for(pg.size(), backend, link, given, shm)
    planned = plan_grid(profile, grid, pg.size(), calibration, cfg.topology or topo)
    predicted_ms = [0.0] * len(grid)
    for c in planned:
        predicted_ms[c.index] = c.step_s * 1e3
    chosen = prune(
        planned,
        num_to_keep(len(grid), cfg.keep_fraction, cfg.max_candidates),
        stratum=lambda i: Codec(grid[i].param_compression, grid[i].grad_compression, grid[i].error_feedback),
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
                        f"overlap.tune: the trial returned {len(times)} step times for {rnd.num_steps} steps"
                    )
                local.append(times)
                bar.update()
            gathered = gather_to_rank0(local, pg)
            decision: RoundResult | None = None
            if gathered is not None:  # rank 0 decides
                scores = [score([per_rank[k] for per_rank in gathered]) for k in range(len(alive))]
                keep = survivors(scores, rnd.num_survivors)
                decision = RoundResult(
                    rnd.num_steps, tuple(alive), tuple(s * 1e3 for s in scores), tuple(alive[k] for k in keep)
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
        raise TypeError(f"overlap.tune: model_fn() must return an nn.Module, got {type(model).__name__}")
    space = cfg.space or default_space(model, base=cfg.base, allow_compression=cfg.allow_compression)
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
        keep = cfg.survivor_models == "keep" or (cfg.survivor_models == "auto" and profile.device_type == "cpu")
        trial = MeasuredTrial(model_fn, step_fn, optimizer_fn, pg, group, cfg.warmup_steps, keep)
    t_measure = time.perf_counter()
    rounds = _run_rounds(schedule, chosen, grid, labels, trial, pg, show_progress=cfg.progress and rank == 0)
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
        warnings.warn(f"overlap.tune: could not write the cache entry in {cache_dir}: {e}", stacklevel=3)
        return None


def _save(result: TuneResult, out: str | Path | None, rank: int) -> None:
    if out is not None and rank == 0:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        result.config.save(path)
