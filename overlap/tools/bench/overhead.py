"""`overlap bench overhead`: what each wrapper costs per unit when there is almost no compute.

    overlap bench overhead                                  # U=64 blocks, world sizes 1 and 2
    overlap bench overhead --units 16 --rounds 3 --steps 10 --json out/overhead.json
    overlap bench overhead --nproc 1 --profile out/overhead.prof   # + cProfile of overlap, W=1

Model: `--units` (U) blocks of Linear(`--dim`, `--dim`) + GELU in an nn.Sequential, batch
(`--batch`, `--dim`), loss mean(out^2), SGD. The matmuls are tiny, so a step is almost all the
per-unit bookkeeping of the wrapper: hooks, schedule, collectives' fixed costs, copies.

Contenders (every one a fresh, identically initialized model in the same processes)
  plain    the model itself: no wrapper, no communication
  ddp      DistributedDataParallel
  fsdp2    fully_shard per block, then the root; defaults
  overlap  overlap.wrap with one unit per block (unit_policy={TinyBlock}, min_unit_numel=0)

Each world size of `--nproc` is its own spawned gloo world (1 thread per rank). Rounds interleave
the contenders (order rotated each round) with the protocol of `overlap bench step`: 2 warm-up
steps, then `--steps` timed steps each after a barrier, taken as the slowest rank. Reported per
contender: the median over rounds of the round medians and the min-max of those (the spread),
and the overhead per unit over plain, (step - plain step) / U in µs; then overlap's per-unit
overhead over FSDP2's.

`--profile PATH` then runs overlap alone in a world of size 1 under cProfile (`--profile-steps`
steps after warm-up), writes the pstats file to PATH and prints the functions ranked by their own
(self) time per unit per step, with file:line. cProfile inflates Python-heavy code against C++;
the ranking is what it is for, and the inflation (profiled step / unprofiled step) is printed.

JSON (`--json PATH`): `{"config", "worlds": [{"world_size", "runs": [{"name", "median_step_ms",
"spread_ms", "overhead_per_unit_us"}], "overlap_over_fsdp2_per_unit"}], "profile": {...} | null}`.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlap.tools.bench.step import Contender, run_segment
from overlap.tools.flags import JSON_FLAG, WORLD_SIZES_FLAG, command, flag, write_json
from overlap.tools.workloads.step import train_step
from overlap.tools.workloads.toy import TinyBlock, tiny_blocks
from overlap.tools.worlds.launch import run_local_world

CONTENDERS = ("plain", "ddp", "fsdp2", "overlap")
PROFILE_TOP = 25
"""Functions listed in the printed profile ranking (the JSON keeps PROFILE_TOP * 2)."""


@dataclass(frozen=True, kw_only=True)
class OverheadBenchConfig:
    """One per-unit overhead measurement. Defaults take about two minutes on 2 CPU cores."""

    units: int = 64
    """Blocks in the model (U): the divisor of the overhead."""
    dim: int = 64
    """Width of each Linear(dim, dim)."""
    batch: int = 8
    """Rows of the input per rank."""
    rounds: int = 5
    """Rounds interleaving the contenders (order rotated each round)."""
    steps: int = 20
    """Timed steps per contender per round."""
    contenders: tuple[str, ...] = field(default=CONTENDERS, metadata=flag(help=f"comma list from {CONTENDERS}"))
    nproc: tuple[int, ...] = field(default=(1, 2), metadata=WORLD_SIZES_FLAG)
    """World sizes."""
    lr: float = 0.01
    """SGD's learning rate."""
    seed: int = 0
    timeout_s: float = 300.0
    """Deadline of each world: a rank still running then is named in the error."""
    json_path: str | None = field(default=None, metadata=JSON_FLAG)
    profile_path: str | None = field(default=None, metadata=flag(name="--profile", metavar="PATH"))
    """Also cProfile overlap at world size 1 and write the pstats file here (None: no profile)."""
    profile_steps: int = 20

    def __post_init__(self) -> None:
        if min(self.units, self.dim, self.batch, self.rounds, self.steps, self.profile_steps) < 1:
            raise ValueError("OverheadBenchConfig: sizes, rounds and steps must be >= 1")
        unknown = sorted(set(self.contenders) - set(CONTENDERS))
        if unknown or "plain" not in self.contenders:
            raise ValueError(
                f"OverheadBenchConfig.contenders: {list(self.contenders)} must include 'plain' "
                f"(the reference) and only names from {CONTENDERS}"
            )
        if not self.nproc or min(self.nproc) < 1 or len(set(self.nproc)) != len(self.nproc):
            raise ValueError(f"OverheadBenchConfig.nproc: need distinct world sizes >= 1, got {self.nproc}")


def build_model(cfg: OverheadBenchConfig) -> nn.Sequential:
    return tiny_blocks(cfg.units, cfg.dim, cfg.seed)


def make_contender(cfg: OverheadBenchConfig, name: str, batch: tuple[torch.Tensor]) -> Contender:
    model: nn.Module = build_model(cfg)
    if name == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name == "overlap":
        import overlap

        model = overlap.wrap(model, unit_policy={TinyBlock}, min_unit_numel=0)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)

    def step(on_stepped: Any = None) -> torch.Tensor:
        return train_step(model, opt, batch, on_stepped)

    return Contender(name, model, opt, step)


def make_batch(cfg: OverheadBenchConfig, rank: int) -> tuple[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(cfg.batch, cfg.dim, generator=gen),)


# ---------------------------------------------------------------------------------------------
# protocol (every rank)


def overhead_rank(rank: int, world_size: int, cfg: OverheadBenchConfig) -> list[list[list[float]]]:
    """Every contender's timed steps on this rank: [contender][round][step] in ms (slowest
    rank's, so every rank returns the same)."""
    from overlap.transport.host import keep_freed_cpu_memory

    # overlap.wrap raises glibc's malloc thresholds process-wide on CPU; every contender lives in
    # this process, so it applies to all of them (see [Note: one allocator setting for all]).
    keep_freed_cpu_memory()
    batch = make_batch(cfg, rank)
    contenders = [make_contender(cfg, name, batch) for name in cfg.contenders]
    for r in range(cfg.rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            run_segment(c, cfg.steps)
    return [c.step_ms for c in contenders]


def profile_rank(rank: int, world_size: int, cfg: OverheadBenchConfig) -> dict[str, Any]:
    """overlap alone at world size 1: unprofiled steps, then the same number under cProfile."""
    assert world_size == 1, f"rank {rank}: the profile runs at world size 1, got {world_size}"
    from overlap.transport.host import keep_freed_cpu_memory

    keep_freed_cpu_memory()
    c = make_contender(cfg, "overlap", make_batch(cfg, rank))
    for _ in range(3):
        c.step()

    def timed_steps() -> float:
        t0 = time.perf_counter()
        for _ in range(cfg.profile_steps):
            c.step()
        return (time.perf_counter() - t0) * 1e3 / cfg.profile_steps

    plain_ms = timed_steps()
    profiler = cProfile.Profile()
    profiler.enable()
    profiled_ms = timed_steps()
    profiler.disable()
    assert cfg.profile_path is not None
    path = Path(cfg.profile_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(str(path))
    return {
        "path": str(path),
        "steps": cfg.profile_steps,
        "step_ms": plain_ms,
        "profiled_step_ms": profiled_ms,
        **rank_functions(pstats.Stats(str(path)), cfg.profile_steps * cfg.units),
    }


def is_engine_file(file: str, package: Path) -> bool:
    path = Path(file)
    return path.is_relative_to(package) and not path.is_relative_to(package / "tools")


def rank_functions(stats: pstats.Stats, per: int) -> dict[str, list[dict[str, Any]]]:
    """Every function as µs and calls per unit-step (`per` = steps x units): "functions" by
    self time, and "overlap_functions" (the engine's own, outside overlap/tools) by cumulative
    time, i.e. each verb with everything it calls."""
    rows = []
    for (file, line, func), (_cc, num_calls, self_s, cum_s, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": func,
                "where": f"{file}:{line}",
                "self_us_per_unit": self_s * 1e6 / per,
                "cum_us_per_unit": cum_s * 1e6 / per,
                "calls_per_unit": num_calls / per,
            }
        )
    package = Path(__file__).resolve().parents[2]  # overlap/
    ours = [r for r in rows if is_engine_file(r["where"].rpartition(":")[0], package)]
    ours.sort(key=lambda r: r["cum_us_per_unit"], reverse=True)
    rows.sort(key=lambda r: r["self_us_per_unit"], reverse=True)
    return {"functions": rows[: PROFILE_TOP * 2], "overlap_functions": ours[: PROFILE_TOP * 2]}


# ---------------------------------------------------------------------------------------------
# report


@dataclass(frozen=True, kw_only=True)
class OverheadRun:
    name: str
    median_step_ms: float
    spread_ms: tuple[float, float]
    """Min and max of the per-round medians."""
    overhead_per_unit_us: float | None
    """(median step - plain's median step) / units; None for plain itself."""


@dataclass(frozen=True, kw_only=True)
class OverheadWorld:
    world_size: int
    runs: list[OverheadRun]
    overlap_over_fsdp2_per_unit: float | None

    def run(self, name: str) -> OverheadRun | None:
        return next((r for r in self.runs if r.name == name), None)


def summarize(cfg: OverheadBenchConfig, world_size: int, step_ms: list[list[list[float]]]) -> OverheadWorld:
    medians = {
        name: [statistics.median(r) for r in rounds] for name, rounds in zip(cfg.contenders, step_ms, strict=True)
    }
    plain_ms = statistics.median(medians["plain"])
    runs = []
    for name, per_round in medians.items():
        med = statistics.median(per_round)
        runs.append(
            OverheadRun(
                name=name,
                median_step_ms=med,
                spread_ms=(min(per_round), max(per_round)),
                overhead_per_unit_us=None if name == "plain" else (med - plain_ms) * 1e3 / cfg.units,
            )
        )
    world = OverheadWorld(world_size=world_size, runs=runs, overlap_over_fsdp2_per_unit=None)
    ours, fsdp2 = world.run("overlap"), world.run("fsdp2")
    if ours is not None and fsdp2 is not None:
        assert ours.overhead_per_unit_us is not None and fsdp2.overhead_per_unit_us is not None
        if fsdp2.overhead_per_unit_us > 0:
            ratio = ours.overhead_per_unit_us / fsdp2.overhead_per_unit_us
            world = replace(world, overlap_over_fsdp2_per_unit=ratio)
    return world


def format_world(cfg: OverheadBenchConfig, world: OverheadWorld) -> str:
    lines = [
        f"\noverhead: {cfg.units} x Block(Linear({cfg.dim}, {cfg.dim}) + GELU), batch "
        f"({cfg.batch}, {cfg.dim}), SGD; world={world.world_size} gloo, 1 thread per rank; "
        f"{cfg.rounds} rounds x {cfg.steps} steps"
    ]
    header = f"{'contender':<10} {'step ms':>9} {'spread ms':>15} {'µs/unit over plain':>19}"
    lines += [header, "-" * len(header)]
    for run in world.runs:
        lo, hi = run.spread_ms
        per_unit = "-" if run.overhead_per_unit_us is None else f"{run.overhead_per_unit_us:.0f}"
        lines.append(f"{run.name:<10} {run.median_step_ms:>9.2f} {f'{lo:.2f}-{hi:.2f}':>15} {per_unit:>19}")
    if world.overlap_over_fsdp2_per_unit is not None:
        lines.append(f"overlap/fsdp2 per unit = {world.overlap_over_fsdp2_per_unit:.2f}")
    return "\n".join(lines)


def format_profile(profile: dict[str, Any]) -> str:
    lines = [
        f"\ncProfile of overlap at world size 1 ({profile['steps']} steps; step "
        f"{profile['step_ms']:.1f} ms unprofiled, {profile['profiled_step_ms']:.1f} ms profiled): "
        f"functions by self time, µs per unit per step; written to {profile['path']}",
        f"{'self µs':>8} {'cum µs':>8} {'calls':>6}  function  (file:line)",
    ]

    def add(rows: list[dict[str, Any]]) -> None:
        for row in rows[:PROFILE_TOP]:
            lines.append(
                f"{row['self_us_per_unit']:>8.1f} {row['cum_us_per_unit']:>8.1f} "
                f"{row['calls_per_unit']:>6.1f}  {row['function']}  ({row['where']})"
            )

    add(profile["functions"])
    lines.append("\noverlap's own functions by cumulative time (µs per unit per step):")
    add(profile["overlap_functions"])
    return "\n".join(lines)


def bench_overhead(cfg: OverheadBenchConfig) -> dict[str, Any]:
    """Every world size of `cfg.nproc` in its own spawned gloo world, then the profile if asked;
    prints the tables and returns (and writes, with `cfg.json_path`) the JSON payload."""
    worlds = []
    for n in cfg.nproc:
        step_ms = run_local_world(overhead_rank, n, cfg, timeout_s=cfg.timeout_s, threads_per_rank=1)[0]
        world = summarize(cfg, n, step_ms)
        print(format_world(cfg, world), flush=True)
        worlds.append(world)
    profile = None
    if cfg.profile_path is not None:
        profile = run_local_world(profile_rank, 1, cfg, timeout_s=cfg.timeout_s, threads_per_rank=1)[0]
        print(format_profile(profile), flush=True)
    payload = {"config": asdict(cfg), "worlds": [asdict(w) for w in worlds], "profile": profile}
    if cfg.json_path:
        write_json(cfg.json_path, payload)
    return payload


# ---------------------------------------------------------------------------------------------
# command line


add_arguments, run = command(OverheadBenchConfig, bench_overhead, "overlap bench overhead")
