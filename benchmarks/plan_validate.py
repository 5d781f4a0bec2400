"""Does the tools' model predict W1's real step? Calibrate, measure, compare.

    python benchmarks/plan_validate.py --json out/plan_validate.json      # all four worlds
    python benchmarks/plan_validate.py --worlds loopback --rounds 1 --steps 1   # a quick look

W1 (8 x TransformerEncoderLayer(512, ff 2048), batch 4 x 128, fp32, AdamW; one gloo thread per
rank; `--seq N`: N tokens per sequence, the compute scaled and the bytes moved kept) in each
world of `--worlds`: `loopback` (2 ranks), `1gbit` (2 ranks, each in a network namespace behind
tc tbf, overlap/tools/worlds/link.py; needs root and iproute2), `loopback,4` (4 ranks) and
`hsdp2x2` (2 replicas x 2 shards on loopback). In each world, `--rounds` rounds of:

1. Calibrate: `overlap.tools.plan.calibrate.calibrate_round`, what `overlap plan --calibrate`
   measures (links, compute, optimizer, host work, contention, concurrency; its docstring
   says how), never from the steps validated below.
2. Time every config of `configs()` (all wrapped up front), in rotated order: a warm-up step and
   `--steps` timed steps each (barrier before each; the slowest rank's time), a plain W1 step
   profiled before the first timed step and after every timed step (all ranks at once, as the
   calibration profiles it).

[Note: compute beside each step] Calibrating in every round puts calibration and measurement
under the same machine load, but not close enough: this shared 2-core machine's speed drifts
within a round (one round's calibration profiled 572 ms of compute and its steps measured 778 ms
for the default config; the round before, 618 and 717 ms), and compute is most of W1's step, so
a round's prediction erred by -10% to +6% from load alone (RESULTS.md, "The model's own noise").
So each timed step is predicted from its round's calibration with the compute profiled just
before and just after it (their mean): the model, its links, contention and host terms are the
calibration's; only the machine's speed at that second comes from beside the step, never from
the validated steps. (A profile beside a whole segment of four steps, the previous design, let
a slow burst in one profile move a round's prediction by up to 15% on loopback 2 while the
segment's steps missed it.) The table gives, per config, the median over every timed step of the
measured and of the predicted step, the min-max of the round medians, and predictions of the
one model the tools use ([Note: one model] in overlap/step_model/calibration.py):
   calibrated  per timed step, its round's calibration with the compute beside the step
               (`predict_measured`); the median over steps
   one cal     the median calibration (`median_calibration`) with its own compute, for every
               config: what `overlap plan --calibrate` then `overlap plan` would predict here
               (summary only)
   defaults    the median calibration's compute with the tools' uncalibrated links and gloo
               terms (`default_world_calibration`): what `overlap tune` predicts without a file
Errors are signed (predicted / measured - 1); "exposed ms" compares the measured exposed
communication (`overlap.step_stats`, slowest rank) with the calibrated prediction's. Per world it
also prints one layer beside one collective against the model's charge ([Note: contention in
bursts]) and where the error lies: forward, backward and optimizer, predicted against measured
([Note: the error by phase]). Targets: every runnable config within
10%, mean |error| <= 5%, mean signed error within +-2% in every world.

`--json PATH` writes the calibrations (median and per round), measurements and predictions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # at run time imported in the functions, after entry.py put this checkout first
    from overlap.step_model.calibration import Calibration
    from overlap.tools.plan.calibrate import Rig, World

from plan_validate_report import (  # noqa: F401  the report's pure functions, importable from here as before
    PHASES,
    TARGET_MAX_ERROR,
    TARGET_MEAN_ABS_ERROR,
    TARGET_MEAN_SIGNED_ERROR,
    burst_charge_ms,
    burst_summary,
    format_bursts,
    format_phase_errors,
    format_table,
    phase_errors,
    round_errors,
    signed_error,
    summarize,
)

Profile = tuple[list[float], list[float]]
"""Per-layer forward and backward seconds of the plain W1 (`profile_beside`)."""

WORLDS = ("loopback", "1gbit", "loopback,4", "hsdp2x2")


def configs(layer_numel: int) -> dict[str, dict[str, Any]]:
    """The validated configs: OverlapConfig overrides by name."""
    layer_bytes = 4 * layer_numel
    return {
        "default": {},
        "prefetch_depth=0": {"prefetch_depth": 0},
        "prefetch_depth=2": {"prefetch_depth": 2},
        "bucket 2 layers": {"reduce_scatter_bucket_bytes": int(1.5 * layer_bytes)},
        "2 layers/unit": {"min_unit_numel": 2 * layer_numel},
        "no reshard (ZeRO-2)": {"reshard_after_forward": False},
        "int8 params+grads, EF": {"param_compression": "int8", "grad_compression": "int8", "error_feedback": True},
    }


def _config(overrides: dict[str, Any]) -> Any:
    from overlap.config import OverlapConfig

    return OverlapConfig(**overrides)


def predict_ms(cal: Calibration, overrides: dict[str, Any]) -> float:
    """The tools' model's steady step for W1 under `overrides`, ms."""
    from overlap.step_model.calibration import predict_measured

    return predict_measured(cal, _config(overrides)).step_s * 1e3


def with_compute(cal: Calibration, compute: Profile) -> Calibration:
    """`cal` with its per-layer forward and backward seconds replaced by `compute`."""
    from overlap.step_model.calibration import with_compute as replaced

    return replaced(cal, *compute)


def bracket(before: Profile, after: Profile) -> Profile:
    """The compute profiles taken just before and just after a step, layer by layer: their mean."""
    return tuple([(a + b) / 2 for a, b in zip(x, y, strict=True)] for x, y in zip(before, after, strict=True))  # type: ignore[return-value]


def uncalibrated(cal: Calibration, world: World) -> Calibration:
    """The tools' defaults for this world, with the measured compute (links and gloo terms are
    what is being compared)."""
    from overlap.step_model.calibration import default_world_calibration
    from overlap.tools.worlds.link import LinkSpec

    link = None if world.link == "loopback" else LinkSpec.parse(world.link)
    defaults = default_world_calibration(
        world.shard_size, "gloo", link, num_replicas=world.num_replicas, shared_memory=cal.shared_memory
    )
    return replace(defaults, compute=cal.compute)


# ---------------------------------------------------------------------------------------------
# measurements (every rank calls these in the same order)


@dataclass(frozen=True, kw_only=True)
class ValidateConfig:
    """One validation run. The defaults: 30 to 50 minutes for the four worlds on a quiet 2-core
    machine (2,841 s on an AMD EPYC with a profile beside each step; 1,778 s on an Intel machine
    with one beside each segment)."""

    worlds: tuple[str, ...] = WORLDS
    """`World.parse` texts: "loopback", "1gbit", "loopback,4", "hsdp2x2", "1gbit,200us", ..."""
    rounds: int = 5
    """With 3, a world's mean signed error moved by up to 5 points between runs (RESULTS.md)."""
    steps: int = 3
    """Timed steps per config per round (after one warm-up step)."""
    profile_steps: int = 2
    """Plain W1 forward+backward steps profiled per round (after one warm-up)."""
    configs: tuple[str, ...] = ()
    """Only these configs of `configs()` (empty: all)."""
    seq: int = 128
    """W1's tokens per sequence. Another length scales the compute and leaves the bytes moved
    as they are: the model checked at another compute-to-communication ratio (at 80, the AMD
    EPYC's compute per step is the Intel machine's at 128; RESULTS.md, "The model at the Intel
    machine's compute")."""
    json_path: str | None = None

    def __post_init__(self) -> None:
        from overlap.tools.plan.calibrate import World

        if min(self.rounds, self.steps, self.profile_steps, self.seq) < 1:
            raise ValueError("ValidateConfig: rounds, steps, profile_steps and seq must be >= 1")
        if not self.worlds:
            raise ValueError("ValidateConfig.worlds: give at least one world")
        for world in self.worlds:
            World.parse(world)  # fail here, not in the ranks
        unknown = set(self.configs) - set(configs(1))
        if unknown:
            raise ValueError(f"ValidateConfig.configs: unknown {sorted(unknown)}; known: {list(configs(1))}")


def build_contenders(table: dict[str, dict[str, Any]], rig: Rig) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """One wrapped W1 and AdamW per config, two steps taken (order check, allocator warm)."""
    import overlap
    from overlap.tools.bench import step as bench_step

    bench = rig.bench
    out: list[tuple[nn.Module, torch.optim.Optimizer]] = []
    for overrides in table.values():
        model = overlap.wrap(bench_step.build_model(bench), group=rig.group, **overrides)
        opt = torch.optim.AdamW(model.parameters(), lr=bench.lr)
        for _ in range(2):
            bench_step.train_step(model, opt, rig.batch)
        out.append((model, opt))
    return out


Phases = tuple[float, float, float]
"""A step's forward, backward and optimizer, ms ([Note: the error by phase])."""


def time_segment(
    model: nn.Module, opt: torch.optim.Optimizer, rig: Rig, steps: int
) -> list[tuple[float, float, Profile, Phases]]:
    """One config's turn in a round: a warm-up step, then `steps` timed steps, each between two
    plain profiles ([Note: compute beside each step]; barrier before each step; a step is the
    slowest rank's). Per timed step: (step ms, exposed communication ms: the slowest rank's
    all-gather and reduction waits, `overlap.step_stats`, the compute beside it, the phases of
    the rank whose step was slowest)."""
    import overlap
    from overlap.tools.bench import step as bench_step
    from overlap.tools.plan.calibrate import max_over_ranks

    bench_step.train_step(model, opt, rig.batch)
    before = profile_beside(rig)
    out = []
    for _ in range(steps):
        dist.barrier()
        marks = [time.perf_counter()]
        bench_step.train_step(model, opt, rig.batch, marks=marks)
        step_ms = (marks[-1] - marks[0]) * 1e3
        stats = overlap.step_stats(model)
        phases = slowest_rank_phases(step_ms, [(b - a) * 1e3 for a, b in zip(marks, marks[1:])])
        step_ms, exposed_ms = max_over_ranks([step_ms, stats.allgather_wait_ms + stats.reduce_wait_ms])
        after = profile_beside(rig)
        out.append((step_ms, exposed_ms, bracket(before, after), phases))
        before = after
    return out


def slowest_rank_phases(step_ms: float, phases: list[float]) -> Phases:
    """The phases of the rank whose step took longest (every rank calls this)."""
    every = torch.zeros(dist.get_world_size(), 1 + len(phases), dtype=torch.float64)
    dist.all_gather(list(every.unbind(0)), torch.tensor([step_ms, *phases], dtype=torch.float64))
    f, b, o = every[int(every[:, 0].argmax())][1:].tolist()
    return f, b, o


def profile_beside(rig: Rig) -> Profile:
    """The plain W1's per-layer compute now: one step, all ranks at once, the slowest rank's
    (as the calibration takes it), for [Note: compute beside each step]. No warm-up step: right
    after a wrapped step the plain step measured 0.2% slower than the one after it (median of 8
    pairs, loopback 2 ranks), and a warm-up would double the profiles' cost."""
    from overlap.tools.plan.measure import profile_slowest

    return profile_slowest(rig.plain, rig.batch, 1, warmup=0)


# [Note: contention in bursts]
# The calibration measures contention beside a loop of collectives that saturates both cores for
# seconds (`measure_contention`); a step has one collective beside a layer, a few ms of it. On
# the AMD EPYC the two agreed: one loopback exchange beside one layer added 2.2 ms to its forward
# and 2.2-3.9 ms to its backward, where the loop's terms charge 3.4 ms. On the Intel machine the
# wrapped backward's layers took 58-64 ms against 50-52 ms plain, more than the loop's terms
# charge, and the model was 1-5% fast there (RESULTS.md). So every round here also times one
# layer beside one collective and prints it next to the charge: a run on another machine then
# says whether contention in bursts is its bias. Measured beside, never used by the model.
BURST_REPS = 8
"""Alternations of `measure_bursts` per round."""
BURST_KEYS = ("forward", "forward_beside_gather", "backward", "backward_beside_reduce", "gather", "reduce")


def measure_bursts(rig: Rig, reps: int = BURST_REPS) -> dict[str, float]:
    """[Note: contention in bursts] One W1 layer's forward and backward, alone and with one
    collective of that layer's bytes issued just before (an all-gather, through the op the runtime
    gathers it with, beside the forward; the runtime's reduction exchange beside the backward),
    and each collective alone; ms, medians over `reps` alternations, means over ranks."""
    from overlap.tools.plan.calibrate import mean_over_ranks
    from overlap.tools.plan.measure import launcher, layer_gather_op

    layer, x = next(rig.plain.children()), rig.batch[0]
    nbytes = 4 * rig.layer_numel
    gather = launcher(layer_gather_op(rig.world, nbytes), nbytes, rig.shard)
    reduce = launcher("all_to_all", nbytes, rig.shard)

    def forward_backward(beside_forward: Any = None, beside_backward: Any = None) -> tuple[float, float]:
        dist.barrier()
        work = beside_forward(True) if beside_forward else None
        t0 = time.perf_counter()
        y = layer(x)
        t1 = time.perf_counter()
        if work is not None:
            work.wait()
        dist.barrier()
        work = beside_backward(True) if beside_backward else None
        t2 = time.perf_counter()
        y.pow(2).mean().backward()
        t3 = time.perf_counter()
        if work is not None:
            work.wait()
        layer.zero_grad(set_to_none=True)
        return t1 - t0, t3 - t2

    def alone(launch: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        launch(False)
        return time.perf_counter() - t0

    forward_backward(gather, reduce)  # warm-up
    samples: dict[str, list[float]] = {k: [] for k in BURST_KEYS}
    for _ in range(reps):
        f, b = forward_backward()
        fg, br = forward_backward(gather, reduce)
        for key, value in zip(BURST_KEYS, (f, fg, b, br, alone(gather), alone(reduce)), strict=True):
            samples[key].append(value * 1e3)
    return dict(zip(BURST_KEYS, mean_over_ranks([statistics.median(samples[k]) for k in BURST_KEYS]), strict=True))


def validate_rank(rank: int, world_size: int, cfg: ValidateConfig, world: World) -> dict[str, Any] | None:
    """One world: rounds of (calibration, every config's segment in rotated order), then the
    predictions from the median calibration; rank 0 returns everything."""
    from overlap.step_model.calibration import codec_path, median_calibration, predict_measured
    from overlap.tools.plan.calibrate import Rig, calibrate_round, format_calibration, profile_alone, set_up_rank, w1

    set_up_rank()
    t0 = time.perf_counter()
    rig = Rig.build(world, bench=w1(seq=cfg.seq))
    table = configs(rig.layer_numel)
    if cfg.configs:
        table = {name: table[name] for name in cfg.configs}
    names = list(table)
    contenders = build_contenders(table, rig)
    alone = profile_alone(rig, cfg.profile_steps)
    cals: list[Calibration] = []
    # per config, per round, per timed step: (step ms, exposed ms, the compute beside the step, phases)
    timed: dict[str, list[list[tuple[float, float, Profile, Phases]]]] = {name: [] for name in names}
    bursts: list[dict[str, float]] = []
    for r in range(cfg.rounds):
        cals.append(calibrate_round(rig, cfg.profile_steps))
        bursts.append(measure_bursts(rig))
        k = r % len(names)
        for i in list(range(k, len(names))) + list(range(k)):
            timed[names[i]].append(time_segment(*contenders[i], rig, cfg.steps))
        if rank == 0:
            print(f"  round {r + 1}/{cfg.rounds} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    if rank != 0:
        return None
    cal = median_calibration(cals)
    defaults = uncalibrated(cal, world)
    per_layer = [statistics.fmean(x) * 1e3 for x in alone]
    print(format_calibration(cal, cals), flush=True)
    print(f"  compute per layer, each rank alone (once): forward {per_layer[0]:.1f} ms, backward {per_layer[1]:.1f} ms")
    print(format_bursts(burst_summary(bursts, cals)))
    rows = []
    for name, overrides in table.items():
        # each timed step predicted from its round's calibration and the compute beside it
        predicted = [[predict_measured(with_compute(c, beside), _config(overrides)) for _, _, beside, _ in segment]
                     for c, segment in zip(cals, timed[name], strict=True)]  # fmt: skip
        steps_ms = [[ms for ms, *_ in segment] for segment in timed[name]]
        step_pred_ms = [[p.step_s * 1e3 for p in segment] for segment in predicted]
        round_ms = [statistics.median(x) for x in steps_ms]
        rows.append({
            "config": name,
            "overrides": overrides,
            "codec": codec_path(overrides.get("param_compression"), overrides.get("grad_compression")),
            "measured_ms": statistics.median(ms for x in steps_ms for ms in x),
            "spread_ms": [min(round_ms), max(round_ms)],
            "round_ms": round_ms,
            "predicted_ms": statistics.median(ms for x in step_pred_ms for ms in x),
            "exposed_ms": statistics.median(e for segment in timed[name] for _, e, *_ in segment),
            "predicted_exposed_ms": statistics.median(p.exposed_s * 1e3 for segment in predicted for p in segment),
            "predicted_per_round_ms": [statistics.median(x) for x in step_pred_ms],
            "step_ms": steps_ms,
            "step_predicted_ms": step_pred_ms,
            "compute_beside_ms": [[(sum(f) + sum(b)) * 1e3 for _, _, (f, b), _ in segment] for segment in timed[name]],
            "phase_ms": [[list(ph) for *_, ph in segment] for segment in timed[name]],
            "phase_predicted_ms": [[[p.forward_s * 1e3, p.backward_s * 1e3, (p.step_s - p.forward_s - p.backward_s) * 1e3]
                                    for p in segment] for segment in predicted],
            "one_calibration_ms": predict_ms(cal, overrides),
            "defaults_ms": predict_ms(defaults, overrides),
        })  # fmt: skip
    print(f"  {format_phase_errors(phase_errors(rows))}", flush=True)  # type: ignore[arg-type]
    return {
        "world": str(world),
        "calibration": cal.to_dict(),
        "calibration_rounds": [c.to_dict() for c in cals],
        "profile_alone_s": {"forward": alone[0], "backward": alone[1]},
        "bursts_ms": bursts,
        "seconds": time.perf_counter() - t0,
        "rows": rows,
    }


def host_cpu() -> str:
    """This machine's CPU model and widest vector extension (from /proc/cpuinfo; "" elsewhere):
    the validation's numbers belong to one machine, and these machines differ."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model}, {vector}, {os.cpu_count()} cores"


def runnable(world: World) -> str | None:
    """Why this world cannot run here (None: it can)."""
    if world.link == "loopback":
        return None
    from overlap.tools.worlds.link import LinkError, check_prerequisites

    try:
        check_prerequisites()
    except LinkError as e:
        return str(e)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = ValidateConfig()
    parser.add_argument("--worlds", default=";".join(d.worlds),
                        help="';'-separated worlds: loopback;1gbit;loopback,4;hsdp2x2 (World.parse)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=d.rounds)
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps per config per round")
    parser.add_argument("--profile-steps", type=int, default=d.profile_steps)
    parser.add_argument("--configs", default="", help="';'-separated config names (default: all)")
    parser.add_argument(
        "--seq", type=int, default=d.seq, help="W1's tokens per sequence (the compute scales, the bytes do not)"
    )
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    args = parser.parse_args()
    try:
        cfg = ValidateConfig(
            worlds=tuple(x.strip() for x in args.worlds.split(";") if x.strip()),
            rounds=args.rounds, steps=args.steps, profile_steps=args.profile_steps,
            configs=tuple(x.strip() for x in args.configs.split(";") if x.strip()), seq=args.seq, json_path=args.json_path,
        )  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"plan_validate: {e}") from None
    from overlap.tools.plan.calibrate import World

    t0 = time.perf_counter()
    load = os.getloadavg()
    cpu = host_cpu()
    print(
        f"plan_validate on {cpu}" + (f"; W1 at {cfg.seq} tokens per sequence" if cfg.seq != d.seq else ""), flush=True
    )
    results, skipped = [], {}
    for text in cfg.worlds:
        world = World.parse(text)
        why = runnable(world)
        if why is not None:
            print(f"\n== {world}: skipped ({why}) ==", flush=True)
            skipped[str(world)] = why
            continue
        print(f"\n== {world} ==", flush=True)
        results.append(world.run(validate_rank, cfg, world)[0])
    if not results:
        raise SystemExit("plan_validate: no world could run")
    print(
        f"\nW1 step: measured vs the tools' model ({cfg.rounds} rounds x {cfg.steps} steps; error = predicted / measured - 1)"
    )
    print(format_table(results))
    total_s = time.perf_counter() - t0
    print(
        f"plan_validate: {total_s:.0f} s in all; load average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f}"
    )
    if cfg.json_path:
        path = Path(cfg.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        out = {"config": asdict(cfg), "cpu": cpu, "load_average": [load[0], os.getloadavg()[0]], "total_s": total_s,
               "skipped": skipped, "summary": summarize(results), "results": results}  # fmt: skip
        path.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from entry import run_as_module  # ranks import this script by module name

    sys.exit(run_as_module(__file__))
