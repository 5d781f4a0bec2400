"""Does `autotune` pay? The defaults, `autotune=True` and `overlap tune`'s pick, side by side.

    # W1, 2 ranks, loopback (then --link 1gbit); the space: the knobs autotune moves
    python benchmarks/autotune_eval.py --model w1 --min-unit-numel 0 --prefetch-depth 1,2,4 --bucket-bytes 0,50438144 \
        --first-steps 100 --steady-steps 10 --rounds 3 --json out/autotune_w1.json
    # a smoke run (seconds)
    python benchmarks/autotune_eval.py --layers 2 --dim 64 --heads 4 --ff 128 --min-unit-numel 0 --prefetch-depth 1,2 \
        --bucket-bytes 0 --first-steps 30 --steady-steps 3 --rounds 1

In one world (spawned, or behind the emulated `--link`):
1. `overlap tune` (trials, cache off) over the space given (the unit size stays the default's:
   autotune cannot change it while training) -> its pick;
2. `--rounds` rounds. In each, a fresh model under the defaults and a fresh one under the defaults
   with autotune run `--first-steps` steps each (order alternating between rounds): the sum of
   their step times is "the first steps". Then each of them, and a model under the pick (built
   once), runs `--steady-steps` more steps in turn: their medians are the steady steps.
Each step is timed as `overlap tune` times it (a barrier, the step, the slowest rank's time).
Checked: autotune's steady step within 3% of the pick's, and its first steps at most 5% more
than the defaults'. Reported as medians over rounds and the min-max of the round values.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

STEADY_TOLERANCE = 0.03
FIRST_STEPS_TOLERANCE = 0.05


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    cmd: Any  # overlap.tools.tune.command.TuneCommand
    rounds: int
    first_steps: int
    steady_steps: int
    nproc: int | None = None
    link: str | None = None
    json_path: str | None = None

    @property
    def timeout_s(self) -> float:
        """The world's deadline behind an emulated link: 5 s a step (W1 steps ~1.5 s behind
        1 Gbit), for the trials and every round's steps, plus 10 minutes."""
        steps = self.rounds * (2 * self.first_steps + 3 * self.steady_steps + 20)
        return 600.0 + 5.0 * steps


@dataclass
class Rounds:
    first_s: dict[str, list[float]] = field(default_factory=lambda: {"defaults": [], "autotune": []})
    steady_ms: dict[str, list[float]] = field(default_factory=lambda: {"defaults": [], "autotune": [], "tune": []})
    decisions: list[list[str]] = field(default_factory=list)
    autotune_knobs: list[dict[str, Any]] = field(default_factory=list)


def _timed(model: Any, opt: Any, step_fn: Any, pg: dist.ProcessGroup, steps: int) -> list[float]:
    """Per step, the slowest rank's seconds (barrier-started, as overlap tune measures)."""
    from overlap.tools.tune.measure import _sync

    out = []
    for _ in range(steps):
        _sync(model)
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        step_fn(model, opt)
        _sync(model)
        out.append(time.perf_counter() - t0)
    gathered = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, out, group=pg)
    return [max(per_rank) for per_rank in zip(*gathered)]


def eval_rank(rank: int, world_size: int, cfg: EvalConfig) -> dict[str, Any] | None:
    from tqdm import tqdm

    import overlap
    from overlap.tools.tune import tune
    from overlap.tools.tune.command import resolve_space, workload_fns, workload_key
    from overlap.tools.tune.measure import process_group
    from overlap.tools.worlds.link import active_link

    pg = process_group(None)
    cmd = cfg.cmd
    model_fn, step_fn, optimizer_fn = workload_fns(cmd.workload, rank)
    space = resolve_space(cmd, model_fn())
    search = cmd.search.replace(space=space, cache="off", key_extra=workload_key(cmd.workload))
    dist.barrier()
    t0 = time.perf_counter()
    pick = tune(model_fn, step_fn, config=search, optimizer_fn=optimizer_fn, out=None).config
    tune_s = time.perf_counter() - t0
    defaults = search.base
    contenders = {"defaults": defaults, "autotune": defaults.replace(autotune=True), "tune": pick}

    def build(config: Any) -> tuple[Any, Any]:
        model = overlap.wrap(model_fn(), config=config)
        return model, optimizer_fn(model.parameters())

    built_pick = build(pick)
    _timed(*built_pick, step_fn, pg, search.warmup_steps)
    rounds = Rounds()
    bar = tqdm(total=cfg.rounds * (2 * cfg.first_steps + 3 * cfg.steady_steps), desc="steps", disable=rank != 0)
    for r in range(cfg.rounds):
        live: dict[str, tuple[Any, Any]] = {"tune": built_pick}
        names = ["defaults", "autotune"] if r % 2 == 0 else ["autotune", "defaults"]
        for name in names:  # the first steps, from wrap on
            live[name] = build(contenders[name])
            rounds.first_s[name].append(sum(_timed(*live[name], step_fn, pg, cfg.first_steps)))
            bar.update(cfg.first_steps)
        for name in names + ["tune"]:
            rounds.steady_ms[name].append(1e3 * statistics.median(_timed(*live[name], step_fn, pg, cfg.steady_steps)))
            bar.update(cfg.steady_steps)
        tuner = live["autotune"][0]._overlap_state.autotuner
        rounds.decisions.append([f"step {d.step} {d.action} {d.reason}" for d in tuner.policy.decisions])
        rounds.autotune_knobs.append(asdict(tuner.policy.best))
        del live
        gc.collect()
    bar.close()
    if rank != 0:
        return None
    report = judge(rounds)
    report.update(link=active_link() or "loopback", world_size=world_size, tune_s=tune_s, pick=str(pick_summary(pick)))
    print(format_report(report, rounds), flush=True)
    return Report({**report, "rounds": asdict(rounds)})  # run_bench writes it to --json


class Report(dict):
    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.items()}


def pick_summary(config: Any) -> dict[str, Any]:
    return {
        "prefetch_depth": config.prefetch_depth,
        "bucket_bytes": config.reduce_scatter_bucket_bytes,
        "max_inflight": config.max_inflight_allgather_bytes,
        "max_reduce_inputs": config.max_reduce_inputs,
    }


def judge(r: Rounds) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in r.steady_ms.items()}
    first = {k: statistics.median(v) for k, v in r.first_s.items()}
    steady_gap = med["autotune"] / med["tune"] - 1
    first_ratio = first["autotune"] / first["defaults"]
    return {
        "steady_ms": med,
        "steady_spread_ms": {k: (min(v), max(v)) for k, v in r.steady_ms.items()},
        "first_s": first,
        "first_spread_s": {k: (min(v), max(v)) for k, v in r.first_s.items()},
        "steady_gap_vs_tune": steady_gap,
        "first_steps_ratio": first_ratio,
        "checks": {
            f"autotune steady within {STEADY_TOLERANCE:.0%} of overlap tune's pick": steady_gap <= STEADY_TOLERANCE,
            f"autotune's first steps within +{FIRST_STEPS_TOLERANCE:.0%} of the defaults'": first_ratio
            <= 1 + FIRST_STEPS_TOLERANCE,
        },
    }


def format_report(report: dict[str, Any], r: Rounds) -> str:
    lines = [
        f"\n{report['link']}, world {report['world_size']}; overlap tune took {report['tune_s']:.0f} s, picked {report['pick']}"
    ]
    lines.append(f"{'contender':<10} {'steady ms (min-max)':>24} {'first steps s (min-max)':>26}")
    for name in ("defaults", "autotune", "tune"):
        lo, hi = report["steady_spread_ms"][name]
        row = f"{name:<10} {report['steady_ms'][name]:>9.1f} ({lo:.1f}-{hi:.1f})"
        if name in report["first_s"]:
            flo, fhi = report["first_spread_s"][name]
            row += f" {report['first_s'][name]:>12.1f} ({flo:.1f}-{fhi:.1f})"
        lines.append(row)
    lines.append(
        f"autotune steady vs tune's pick {report['steady_gap_vs_tune']:+.1%}; first steps vs defaults x{report['first_steps_ratio']:.3f}"
    )
    lines.append(f"autotune settled on (last round): {r.autotune_knobs[-1]}")
    lines += [f"  [{'PASS' if ok else 'FAIL'}] {name}" for name, ok in report["checks"].items()]
    return "\n".join(lines)


def main() -> int:
    from entry import run_timed

    from overlap.tools.tune import command

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    command.add_arguments(parser)
    parser.set_defaults(out=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-steps", type=int, default=100)
    parser.add_argument("--steady-steps", type=int, default=10)
    args = parser.parse_args()
    cmd = command.command_from_args(args)
    cfg = EvalConfig(
        cmd=cmd, rounds=args.rounds, first_steps=args.first_steps, steady_steps=args.steady_steps,
        nproc=cmd.nproc, link=cmd.link, json_path=args.json_path,
    )  # fmt: skip
    return run_timed("autotune_eval", eval_rank, cfg)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from entry import run_as_module  # ranks import this script by module name

    sys.exit(run_as_module(__file__))
