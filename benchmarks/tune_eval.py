"""Is `overlap tune` worth it? The tuner against the exhaustive grid and the default config.

    # the measurement (W1, 2 ranks behind the emulated 1 Gbit/s link, 24 configs; ~10-12 min):
    python benchmarks/tune_eval.py --link 1gbit --allow-compression \
        --min-unit-numel 0,6304768 --prefetch-depth 1,2,4 --bucket-bytes 0,50438144 \
        --codecs none,int8+ef --max-candidates 4 --first-round-steps 2 --rounds 6 --steps 4 \
        --json out/tune_eval_w1_link.json
    # a seconds-long smoke run:
    python benchmarks/tune_eval.py --layers 2 --dim 64 --heads 4 --ff 128 --prefetch-depth 1,2 \
        --bucket-bytes 0 --rounds 2 --steps 2

(6304768 elements = two W1 layers per unit; 50438144 bytes = four W1 layers' fp32 gradients.)
In one world (spawned, or behind the emulated `--link`), on W1 (or `--model gpt`):
1. the tuner, cache off, over the space (the model's default, or the space flags of `overlap tune`);
2. the exhaustive grid over the same space: every candidate built, warmed up like a trial and
   measured for as many timed steps as the tuner's final round, scored the same way (median over
   steps of the slowest rank);
3. the default config against the tuned one, `--rounds` interleaved rounds of `--steps` timed
   steps each (order alternating), as the median over rounds and the min-max of round medians.
Checked: the tuner's pick is within 5% of the grid's best (both as the grid measured them), the
tuner took at most 30% of the grid's wall time, and tuned beats default by at least 5% and by
more than the spread between rounds (the larger of the two contenders' min-max).
A table on stdout; `--json PATH` writes everything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch.distributed as dist

PICK_TOLERANCE = 0.05
TIME_SHARE = 0.30
MIN_SPEEDUP = 0.05


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    cmd: Any  # overlap.tune.command.TuneCommand
    rounds: int = 5
    steps: int = 4
    nproc: int | None = None
    link: str | None = None
    json_path: str | None = None


@dataclass(frozen=True, kw_only=True)
class EvalReport:
    link: str
    world_size: int
    tune: dict[str, Any]
    grid_ms: list[float]
    grid_steps: int
    tuner_steps: int
    """Timed steps per rank the tuner measured (the grid: len(grid_ms) x grid_steps)."""
    tuner_builds: int
    tuner_s: float
    grid_s: float
    default_round_ms: list[float]
    tuned_round_ms: list[float]
    tuned_is_default: bool
    checks: dict[str, bool] = field(default_factory=dict)
    summary: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _score_on_rank0(times: list[float], pg: dist.ProcessGroup) -> float | None:
    from overlap.tools.tune.halving import score
    from overlap.tools.tune.measure import gather_to_rank0

    gathered = gather_to_rank0(times, pg)
    return None if gathered is None else score(gathered) * 1e3


def _load_kernels() -> None:
    try:
        from overlap.kernels.cpu import load_extension

        load_extension()
    except Exception as e:
        print(f"note: C++ kernels not loaded ({e}); codecs use the torch reference")


def eval_rank(rank: int, world_size: int, cfg: EvalConfig) -> EvalReport | None:
    from tqdm import tqdm

    from overlap.tools.tune import tune
    from overlap.tools.tune.command import resolve_space, workload_fns, workload_key
    from overlap.tools.tune.measure import MeasuredTrial, process_group
    from overlap.tools.worlds.link import active_link

    pg = process_group(None)
    cmd = cfg.cmd
    model_fn, step_fn, optimizer_fn = workload_fns(cmd.workload, rank)
    space = resolve_space(cmd, model_fn())
    search = cmd.search.replace(space=space, cache="off", key_extra=workload_key(cmd.workload))
    if not space.lossless:
        _load_kernels()  # a JIT build inside the first timed procedure would bias the comparison

    dist.barrier()
    t0 = time.perf_counter()
    result = tune(model_fn, step_fn, config=search, optimizer_fn=optimizer_fn, out=cmd.out)
    tuner_s = time.perf_counter() - t0
    if rank == 0:
        print(result.format(), flush=True)

    trial = MeasuredTrial(model_fn, step_fn, optimizer_fn, pg, None, search.warmup_steps)
    grid = space.candidates(search.base)
    grid_steps = result.final_round_steps or search.first_round_steps
    bar = tqdm(total=len(grid), desc="grid", unit="config", disable=rank != 0, leave=False)
    dist.barrier()
    t0 = time.perf_counter()
    grid_ms = []
    for config in grid:
        grid_ms.append(_score_on_rank0(trial(config, grid_steps), pg))
        bar.update()
    grid_s = time.perf_counter() - t0
    bar.close()

    default, tuned = search.base, result.config
    # both models built once and kept: every round runs the same two models, in turn
    trial = MeasuredTrial(model_fn, step_fn, optimizer_fn, pg, None, search.warmup_steps, keep_models=True)
    rounds: dict[str, list[float | None]] = {"default": [], "tuned": []}
    bar = tqdm(total=2 * cfg.rounds, desc="default vs tuned", unit="segment", disable=rank != 0, leave=False)
    for r in range(cfg.rounds):
        order = [("default", default), ("tuned", tuned)]
        for name, config in order if r % 2 == 0 else order[::-1]:
            rounds[name].append(_score_on_rank0(trial(config, cfg.steps), pg))
            bar.update()
    bar.close()
    trial.close()
    if rank != 0:
        return None
    report = EvalReport(
        link=active_link() or "loopback",
        world_size=world_size,
        tune=result.to_json(),
        grid_ms=[float(x) for x in grid_ms if x is not None],
        grid_steps=grid_steps,
        tuner_steps=result.measured_steps,
        tuner_builds=len(result.candidates),
        tuner_s=tuner_s,
        grid_s=grid_s,
        default_round_ms=[float(x) for x in rounds["default"] if x is not None],
        tuned_round_ms=[float(x) for x in rounds["tuned"] if x is not None],
        tuned_is_default=tuned == default,
    )
    report = judge(report, result.winner)
    print(format_report(report, result), flush=True)
    return report


def judge(r: EvalReport, winner: int) -> EvalReport:
    best = min(r.grid_ms)
    pick_gap = r.grid_ms[winner] / best - 1
    share = r.tuner_s / r.grid_s
    d_med, t_med = statistics.median(r.default_round_ms), statistics.median(r.tuned_round_ms)
    spread = max(max(v) - min(v) for v in (r.default_round_ms, r.tuned_round_ms))
    speedup = 1 - t_med / d_med
    summary = {
        "grid_best_ms": best,
        "pick_ms": r.grid_ms[winner],
        "pick_gap": pick_gap,
        "time_share": share,
        "step_share": r.tuner_steps / (len(r.grid_ms) * r.grid_steps),
        "default_ms": d_med,
        "tuned_ms": t_med,
        "speedup": speedup,
        "margin_ms": d_med - t_med,
        "spread_ms": spread,
    }
    checks = {
        "pick within 5% of grid best": pick_gap <= PICK_TOLERANCE,
        "tuner time <= 30% of grid": share <= TIME_SHARE,
        "tuned beats default by >= 5%": speedup >= MIN_SPEEDUP,
        "tuned beats default by more than the spread": d_med - t_med > spread,
    }
    return replace(r, summary=summary, checks=checks)


def format_report(r: EvalReport, result: Any) -> str:
    s = r.summary
    width = max(len(label) for label in result.grid)
    lines = [
        (
            f"\ngrid: {len(r.grid_ms)} configs x (build, warm-up, {r.grid_steps} timed steps), "
            f"world {r.world_size}, {r.link}"
        ),
        f"{'#':>3} {'config':<{width}} {'grid ms':>9} {'predicted':>9}  tuner",
    ]
    for i in sorted(range(len(r.grid_ms)), key=lambda i: r.grid_ms[i]):
        mark = "picked" if i == result.winner else ("measured" if i in result.candidates else "")
        lines.append(f"{i:>3} {result.grid[i]:<{width}} {r.grid_ms[i]:>9.1f} {result.predicted_ms[i]:>9.1f}  {mark}")

    def fmt(values: list[float]) -> str:
        return " ".join(f"{x:.0f}" for x in values)

    lines += [
        "",
        (f"tuner pick {s['pick_ms']:.1f} ms vs grid best {s['grid_best_ms']:.1f} ms: {s['pick_gap']:+.1%}"),
        (
            f"time: tuner {r.tuner_s:.1f} s vs grid {r.grid_s:.1f} s: {s['time_share']:.1%} "
            f"(timed steps {r.tuner_steps} vs {len(r.grid_ms) * r.grid_steps}: "
            f"{s['step_share']:.1%}; models built {r.tuner_builds} vs {len(r.grid_ms)})"
        ),
        (
            f"default {s['default_ms']:.1f} ms (rounds {fmt(r.default_round_ms)}) vs tuned "
            f"{s['tuned_ms']:.1f} ms (rounds {fmt(r.tuned_round_ms)}): {s['speedup']:+.1%}, "
            f"margin {s['margin_ms']:.1f} ms vs spread {s['spread_ms']:.1f} ms"
        ),
    ]
    if r.tuned_is_default:
        lines.append("  note: the tuner chose the default config; default vs tuned compares it with itself")
    lines += [f"  [{'PASS' if ok else 'FAIL'}] {name}" for name, ok in r.checks.items()]
    return "\n".join(lines)


def main() -> int:
    from entry import run_timed

    from overlap.tools.tune import command

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    command.add_arguments(parser)
    parser.set_defaults(out=None)
    parser.add_argument("--rounds", type=int, default=5, help="default vs tuned rounds")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per segment")
    args = parser.parse_args()
    if min(args.rounds, args.steps) < 1:
        raise SystemExit("tune_eval: --rounds and --steps must be >= 1")
    try:
        cmd = command.command_from_args(args)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"tune_eval: {e}") from None
    cfg = EvalConfig(
        cmd=cmd, rounds=args.rounds, steps=args.steps, nproc=cmd.nproc, link=cmd.link,
        json_path=args.json_path,
    )  # fmt: skip
    return run_timed("tune_eval", eval_rank, cfg)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from entry import run_as_module  # ranks import this script by module name

    sys.exit(run_as_module(__file__))
