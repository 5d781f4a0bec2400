"""Convergence side by side: overlap's codecs and the peers against fp32 DDP, the package's GPT
on the stdlib text, 2 ranks.

    python benchmarks/convergence.py --steps 300 --json out/convergence.json --png docs/convergence.png
    python benchmarks/convergence.py --contenders ddp,overlap,ddp-bf16 --steps 20     # a quick look
    python benchmarks/convergence.py --from-json out/convergence.json \\
        --step-json out/step-1gbit.json --frontier-png docs/frontier-1gbit.png     # table + picture
    python benchmarks/convergence.py --seed 1 --json out/seed1.json ...            # another seed
    python benchmarks/convergence.py --from-json out/convergence.json --from-json out/seed1.json \\
        --step-json out/step-1gbit.json                                            # mean over seeds

Every contender trains `overlap demo`'s run (same GPT, data stream per rank, seed, AdamW(lr 3e-3,
betas (0.9, 0.95), weight decay 0.1), warm-up + cosine schedule, gradient clipping at 1.0,
validation batches) in a world of its own freshly spawned processes, one after the other, each
through its own API (overlap.tools.bench.peers: DeepSpeed steps through its engine). Reported per
contender: the final training loss (mean of the last 10 steps, averaged over ranks) and the
validation loss, each relative to fp32 DDP ("ddp", the reference, always run); the state bytes
per rank by accounting (params + grads + optimizer + communication state) and the peak RSS per
rank (VmHWM of its own processes). This is a numerics measurement: step times here are loopback
and sequential; take them from `overlap bench step` on the link you care about.

Contenders: `ddp`, `overlap` and one overlap contender per `--overlap-config` (default: bf16,
int8 + error feedback, int4 + error feedback, int8 weights + int8 gradients + error feedback),
then the peers (overlap/tools/bench/peers.py). Names are those of `overlap bench step`, so `--step-json`
(a `bench step --json` file, one per link) joins step time and peak memory by name: the table
then shows step time, loss gap and memory side by side, and whether each contender is on the
frontier (no other contender is faster, at least as accurate and no bigger in memory per rank);
`--frontier-png` draws step time against loss gap, marker area = memory per rank. Memory per
rank is the step benchmark's "train" figure where it has one (peak RSS less the RSS before the
contender was built, median over `--memory-repeats` fresh worlds): on this small model the
whole-process peak is ~95% interpreter and libraries, and moves by more between runs than the
contenders' state differs.

Several `--from-json` files (one run per `--seed` each) are read as seeds: a contender's gap is
the mean over seeds of its gap to that seed's fp32 DDP, shown with the seeds' range (the
picture's error bars), over the seeds a contender ran with (the table says how many). With one
seed the gaps of the lossy codecs here are within the seed-to-seed range of each other, which
one file cannot show. "At least as accurate" compares two contenders on the seeds both ran
(`paired_gaps`): a seed moves every lossy run the same way (seed 0 put all of them 0.5-2%
below fp32 DDP), so a contender run with one seed is not judged against another's mean of three.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's `overlap`

import torch

from overlap.tools.bench import peers
from overlap.tools.bench.step import process_peak_rss_bytes
from overlap.tools.demo import DemoConfig, batches, evaluate, lr_factor, mean_across_ranks
from overlap.tools.workloads import GPT, GPTConfig
from overlap.tools.workloads.data import ByteDataset
from overlap.tools.worlds.launch import current_device, default_world, run_local_world

REFERENCE = "ddp"
OVERLAP_CONFIGS = (
    "grad_compression=bf16",
    "grad_compression=int8,error_feedback=True",
    "grad_compression=int4,error_feedback=True",
    "param_compression=int8,grad_compression=int8,error_feedback=True",
)
"""Our side by default: the codecs the issue compares (pass the tuner's best with --overlap-config)."""
FINAL_WINDOW = 10
"""Steps averaged for the final training loss (one step is noisy), as `overlap demo` does."""


@dataclass(frozen=True, kw_only=True)
class ConvergenceRun:
    """One contender's run, as rank 0 reports it (losses averaged over ranks)."""

    name: str
    losses: list[float]
    final_loss: float
    val_loss: float
    median_step_ms: float
    state_bytes: int
    """Largest rank's, while the last step's gradients live."""
    peak_rss_bytes: int
    """Largest rank's VmHWM: its own processes, whole run."""
    lossy: bool
    settings: dict[str, Any]


def train_setup(cfg: DemoConfig, device: torch.device, powersgd_start_iter: int) -> peers.TrainSetup:
    return peers.TrainSetup(
        # overlap.tools.demo.build_optimizer's AdamW, over whatever parameters the contender exposes
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1),
        units_of=lambda model: list(model.blocks),
        micro_batch=cfg.batch_size,
        hidden_size=cfg.dim,
        max_grad_norm=1.0,  # overlap.tools.demo clips at 1.0
        powersgd_start_iter=powersgd_start_iter,
        device=device,
    )


def largest(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=current_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def converge_rank(
    rank: int, world_size: int, cfg: DemoConfig, name: str, powersgd_start_iter: int
) -> ConvergenceRun | None:
    """`overlap demo`'s training run with contender `name`, in this world."""
    device = current_device()
    data = ByteDataset.from_stdlib(cfg.max_bytes)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank, for every contender
    gpt_cfg = GPTConfig(block_size=cfg.block_size, n_layer=cfg.layers, n_head=cfg.heads, n_embd=cfg.dim)
    trainer = peers.build_trainer(name, GPT(gpt_cfg).to(device), train_setup(cfg, device, powersgd_start_iter))
    sched = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: lr_factor(s, cfg))
    losses, step_ms, state = [], [], 0
    stream = batches(data.train, cfg, rank, 0)
    for step in range(cfg.steps):
        x, y = next(stream)
        t0 = time.perf_counter()
        _, loss = trainer.model(x.to(device), y.to(device))
        trainer.backward(loss)
        trainer.step()
        losses.append(loss.item())
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if step == cfg.steps - 1:  # gradients still alive: the accounting point
            state = trainer.state_bytes()
        trainer.zero_grad()
        sched.step()
    val = evaluate(trainer.model, data.val, cfg, device)
    mean_losses = mean_across_ranks(losses)
    run = ConvergenceRun(
        name=name,
        losses=mean_losses,
        final_loss=statistics.fmean(mean_losses[-FINAL_WINDOW:]),
        val_loss=val,
        median_step_ms=statistics.median(step_ms[1:] or step_ms),
        state_bytes=largest(state),
        peak_rss_bytes=largest(process_peak_rss_bytes()),
        lossy=trainer.lossy,
        settings=trainer.settings,
    )
    return run if rank == 0 else None


def converge(names: list[str], cfg: DemoConfig, nproc: int, powersgd_start_iter: int) -> list[ConvergenceRun]:
    """Each contender in a fresh world of `nproc` ranks, in order."""
    _, backend = default_world()
    runs = []
    for name in names:
        print(f"--- {name}", flush=True)
        run = run_local_world(converge_rank, nproc, cfg, name, powersgd_start_iter, backend=backend)[0]
        assert run is not None, f"rank 0 of {name} returned no result"
        print(f"    final train {run.final_loss:.4f}, val {run.val_loss:.4f}", flush=True)
        runs.append(run)
    return runs


# ---------------------------------------------------------------------------------------------
# report: the loss table, the combined table per link and the frontier


def gap(value: float, ref: float) -> float:
    return (value - ref) / ref


def format_losses(runs: list[ConvergenceRun]) -> str:
    ref = next(r for r in runs if r.name == REFERENCE)
    mib = 2**20
    w = max(len("contender"), *(len(r.name) for r in runs))
    header = (
        f"{'contender':<{w}} {'final train':>11} {'vs ddp':>8} {'val':>8} {'vs ddp':>8} "
        f"{'state MiB':>10} {'peak RSS MiB':>13}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        lines.append(
            f"{r.name:<{w}} {r.final_loss:>11.4f} {gap(r.final_loss, ref.final_loss):>+8.2%} "
            f"{r.val_loss:>8.4f} {gap(r.val_loss, ref.val_loss):>+8.2%} "
            f"{r.state_bytes / mib:>10.2f} {r.peak_rss_bytes / mib:>13.1f}"
        )
    lines.append(
        f"final train = mean of the last {FINAL_WINDOW} steps; vs ddp = relative to fp32 DDP; "
        "state = params+grads+optimizer+communication state per rank; peak RSS = VmHWM, largest rank"
    )
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class FrontierPoint:
    name: str
    step_ms: float
    spread_ms: tuple[float, float]
    loss_gap: float
    """Relative final training loss vs fp32 DDP (the mean over seeds)."""
    gap_range: tuple[float, float]
    """The smallest and largest of the seeds' training loss gaps."""
    val_gap: float
    memory_bytes: int
    """Memory per rank, from the step benchmark's fresh worlds: its "train" figure (peak RSS less
    the RSS before the contender was built) where it has one, else its peak RSS, else this
    script's peak RSS (`memory_kind` says which)."""
    state_bytes: int
    num_seeds: int = 1
    """How many seeds' runs the gaps average."""
    seed_gaps: dict[int, float] = field(default_factory=dict)
    """Training loss gap per seed (by the position of its --from-json file)."""
    memory_kind: str = "peak RSS"
    memory_range: tuple[int, int] | None = None
    """Smallest and largest of the step benchmark's worlds for the train figure, where measured."""


def join(step_report: dict[str, Any], seeds: list[list[ConvergenceRun]]) -> list[FrontierPoint]:
    """The contenders present in the step report and in the seeds' runs, with step time and
    memory from the step benchmark and loss gaps averaged over the seeds each ran with."""
    refs = [next(r for r in runs if r.name == REFERENCE) for runs in seeds]
    by_name = [{r.name: r for r in runs} for runs in seeds]
    points = []
    for s in step_report["runs"]:
        pairs = [(names[s["name"]], ref) for names, ref in zip(by_name, refs) if s["name"] in names]
        if not pairs:
            continue
        mine = [r for r, _ in pairs]
        train = [gap(r.final_loss, ref.final_loss) for r, ref in pairs]
        val = [gap(r.val_loss, ref.val_loss) for r, ref in pairs]
        ran = [i for i, names in enumerate(by_name) if s["name"] in names]
        if s.get("train_mem_bytes"):
            memory, kind = s["train_mem_bytes"], "train RSS"
        elif s.get("peak_mem_bytes"):
            memory, kind = s["peak_mem_bytes"], "peak RSS"
        else:
            memory, kind = max(r.peak_rss_bytes for r in mine), "peak RSS (convergence runs)"
        points.append(
            FrontierPoint(
                name=s["name"],
                step_ms=s["median_step_ms"],
                spread_ms=tuple(s["spread_ms"]),
                loss_gap=statistics.fmean(train),
                gap_range=(min(train), max(train)),
                val_gap=statistics.fmean(val),
                memory_bytes=memory,
                state_bytes=s["state_bytes"],
                num_seeds=len(pairs),
                seed_gaps=dict(zip(ran, train)),
                memory_kind=kind,
                memory_range=tuple(s["train_mem_range_bytes"]) if s.get("train_mem_range_bytes") else None,
            )
        )
    return points


def shared_seeds(p: FrontierPoint, q: FrontierPoint) -> list[int]:
    return sorted(p.seed_gaps.keys() & q.seed_gaps.keys())


def paired_gaps(p: FrontierPoint, q: FrontierPoint) -> tuple[float, float]:
    """p's and q's mean training loss gaps over the seeds both ran with (each contender's own
    mean where they share none): a contender that ran only a lucky seed is not compared with
    another's mean over three."""
    common = shared_seeds(p, q)
    if not common:
        return p.loss_gap, q.loss_gap
    return (statistics.fmean(p.seed_gaps[i] for i in common), statistics.fmean(q.seed_gaps[i] for i in common))


def dominators(p: FrontierPoint, points: list[FrontierPoint]) -> list[FrontierPoint]:
    """The other contenders faster than p, at least as accurate (on the seeds both ran) and no
    bigger in memory."""
    found = []
    for q in points:
        if q is p or not (q.step_ms < p.step_ms and q.memory_bytes <= p.memory_bytes):
            continue
        mine, theirs = paired_gaps(p, q)
        if theirs <= mine:
            found.append(q)
    return found


def dominated(p: FrontierPoint, points: list[FrontierPoint]) -> bool:
    return bool(dominators(p, points))


class Resolution(NamedTuple):
    """Whether each of a domination's three differences stands out of its own noise
    ([Note: dominated within noise])."""

    faster: bool
    """q's slowest round is faster than p's median step."""
    more_accurate: bool
    """q's paired gap is lower than p's by more than twice the standard error of the per-seed
    differences (needs two shared seeds)."""
    leaner: bool
    """q's largest train memory over the step benchmark's worlds is below p's smallest."""
    gap_difference: float
    """Mean over the shared seeds of q's gap less p's."""
    gap_error: float
    """Its standard error (nan with fewer than two shared seeds)."""


# [Note: dominated within noise]
# Dominance on the means says which contender wins every axis, not whether any of those wins is
# real: among configurations whose losses differ by less than the seeds can tell, the means order
# them differently with every added seed (the frontier of our own codecs moved from six seeds to
# twelve). So each domination is reported with its resolution: faster beyond the step spread,
# more accurate beyond two standard errors of the paired per-seed differences, leaner beyond the
# memory range. A peer beaten on all three is beaten; a domination resolved on none is a tie
# within noise and says so.
def resolution(p: FrontierPoint, q: FrontierPoint) -> Resolution:
    diffs = [q.seed_gaps[i] - p.seed_gaps[i] for i in shared_seeds(p, q)]
    mine, theirs = paired_gaps(p, q)
    err = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) >= 2 else math.nan
    p_lo = p.memory_range[0] if p.memory_range else p.memory_bytes
    q_hi = q.memory_range[1] if q.memory_range else q.memory_bytes
    return Resolution(
        faster=q.spread_ms[1] < p.step_ms,
        more_accurate=not math.isnan(err) and theirs - mine + 2 * err < 0,
        leaner=q_hi < p_lo,
        gap_difference=theirs - mine,
        gap_error=err,
    )


def format_dominations(points: list[FrontierPoint]) -> list[str]:
    """A line per dominated contender: who dominates it and which differences are resolved."""
    lines = []
    for p in sorted(points, key=lambda p: p.step_ms):
        for q in dominators(p, points):
            r = resolution(p, q)
            resolved = [a for a, ok in zip(("step", "loss", "memory"), r[:3]) if ok]
            verdict = f"resolved on {', '.join(resolved)}" if resolved else "every difference within noise"
            err = "" if math.isnan(r.gap_error) else f" ± {r.gap_error:.2%}"
            lines.append(
                f"  {short_name(p.name)} dominated by {short_name(q.name)}: "
                f"{q.step_ms - p.step_ms:+.1f} ms, gap {r.gap_difference:+.2%}{err}, "
                f"memory {(q.memory_bytes - p.memory_bytes) / 2**20:+.1f} MiB ({verdict})"
            )
    return lines


def format_frontier(link: str, points: list[FrontierPoint]) -> str:
    mib = 2**20
    w = max(len("contender"), *(len(p.name) for p in points))
    header = (
        f"{'contender':<{w}} {'step ms':>9} {'spread ms':>15} {'train gap':>10} {'seeds: range':>20} "
        f"{'val gap':>8} {'state MiB':>10} {'memory MiB':>11} {'its range':>13} {'frontier':>9}"
    )
    lines = [f"\n{link}: step time (bench step) and loss gap vs fp32 DDP (this script)", header]
    lines.append("-" * len(header))
    for p in sorted(points, key=lambda p: p.step_ms):
        lo, hi = p.spread_ms
        g0, g1 = p.gap_range
        spread = "" if p.memory_range is None else "-".join(f"{m / mib:.1f}" for m in p.memory_range)
        lines.append(
            f"{p.name:<{w}} {p.step_ms:>9.1f} {f'{lo:.1f}-{hi:.1f}':>15} {p.loss_gap:>+10.2%} "
            f"{f'{p.num_seeds}: {g0:+.2%}..{g1:+.2%}':>20} "
            f"{p.val_gap:>+8.2%} {p.state_bytes / mib:>10.2f} {p.memory_bytes / mib:>11.1f} {spread:>13} "
            f"{'yes' if not dominated(p, points) else '':>9}"
        )
    kinds = sorted({p.memory_kind for p in points})
    lines.append(
        f"memory = {' / '.join(kinds)} per rank (train RSS: peak RSS less the RSS before the "
        "contender was built, median of the step benchmark's worlds); frontier: no other "
        "contender faster, at least as accurate on the seeds both ran, and no bigger in memory"
    )
    dominations = format_dominations(points)
    if dominations:
        lines.append("dominated ([Note: dominated within noise]; ± = standard error of the paired seeds):")
        lines += dominations
    return "\n".join(lines)


def short_name(name: str) -> str:
    """A contender's name for a plot label: overlap's config overrides abbreviated."""
    for long, short in (
        ("overlap[", "overlap "), ("]", ""), ("param_compression=", "w="), ("grad_compression=", "g="),
        (",error_feedback=True", "+EF"), (",error_feedback_dtype=int8", " (int8 res.)"),
        (",error_feedback_dtype=float32", ""), ("min_unit_numel=0,", ""), ("reduce_scatter_bucket_bytes=0,", ""),
        ("prefetch_depth=", "depth "),
    ):  # fmt: skip
        name = name.replace(long, short)
    return name


def plot_frontier(link: str, points: list[FrontierPoint], path: Path) -> None:
    """Step time against loss gap, marker area = memory per rank; the contenders are numbered
    on the plot and named in a key beside it (their labels would pile up where several
    contenders run within a few ms of each other)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, key) = plt.subplots(
        1, 2, figsize=(12.5, 5.5), gridspec_kw={"width_ratios": [1.9, 1]}
    )  # fmt: skip
    biggest = max(p.memory_bytes for p in points)
    ordered = sorted(points, key=lambda p: p.step_ms)
    lines = [f"{'#':>2} {'contender':<36} {'ms':>6} {'gap':>7} {'seeds':>5} {'MiB':>6}"]
    for i, p in enumerate(ordered, 1):
        on = not dominated(p, points)
        ax.scatter(
            p.step_ms, 100 * p.loss_gap, s=600 * p.memory_bytes / biggest,
            alpha=0.8 if on else 0.35, edgecolors="black" if on else "none",
            color="tab:blue" if p.name.startswith("overlap") else "tab:orange",
        )  # fmt: skip
        lo, hi = p.gap_range
        if hi > lo:  # several seeds: their range
            ax.errorbar(p.step_ms, 100 * p.loss_gap, yerr=[[100 * (p.loss_gap - lo)], [100 * (hi - p.loss_gap)]],
                        fmt="none", ecolor="gray", elinewidth=0.8, alpha=0.6)  # fmt: skip
        ax.annotate(str(i), (p.step_ms, 100 * p.loss_gap), fontsize=7, xytext=(5, 5 if i % 2 else -11),
                    textcoords="offset points")  # fmt: skip
        lines.append(
            f"{i:>2} {short_name(p.name)[:36]:<36} {p.step_ms:>6.1f} {p.loss_gap:>+7.2%} "
            f"{p.num_seeds:>5} {p.memory_bytes / 2**20:>6.1f}{'  *' if on else ''}"
        )
    lines += ["", "* on the frontier: no other contender faster,", "  at least as accurate on the seeds both ran,",
              "  and no bigger in memory per rank"]  # fmt: skip
    key.axis("off")
    key.text(-0.05, 1.0, "\n".join(lines), family="monospace", fontsize=7, va="top")
    ax.set_yscale("symlog", linthresh=1.0)  # gaps of a few % beside PowerSGD's tens of %
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_xlabel("median step time, ms (overlap bench step)")
    ax.set_ylabel("final training loss vs fp32 DDP, % (mean over seeds; bars: their range)")
    ax.set_title(
        f"{link}: blue = overlap, orange = peers; outlined = on the frontier; "
        f"area = {' / '.join(sorted({p.memory_kind for p in points}))} per rank", fontsize=9,
    )  # fmt: skip
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot_losses(runs: list[ConvergenceRun], steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in runs:
        smooth = [statistics.fmean(r.losses[max(0, i - FINAL_WINDOW + 1) : i + 1]) for i in range(len(r.losses))]
        ax.plot(smooth, label=f"{r.name} (final {r.final_loss:.3f})", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({FINAL_WINDOW}-step mean)")
    ax.set_title(f"byte-level GPT on the Python stdlib, 2 ranks, {steps} steps")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------
# command line


def contender_list(args: argparse.Namespace) -> list[str]:
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    specs = args.overlap_config if args.overlap_config else list(OVERLAP_CONFIGS)
    if "overlap" in names:
        at = names.index("overlap") + 1
        names[at:at] = [f"overlap[{spec}]" for spec in specs]
    unknown = [n for n in names if not peers.is_known(n)]
    if unknown:
        raise SystemExit(f"convergence.py: unknown contenders {unknown}")
    for spec in specs:
        peers.parse_overrides(spec)
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    return list(peers.available(names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--contenders",
        default=",".join(("ddp", "overlap", *peers.PEERS)),
        help=f"comma list from {peers.BASELINES + peers.PEERS}; ddp (the reference) always runs",
    )
    parser.add_argument(
        "--overlap-config", action="append", default=[], metavar="KEY=VALUE,...",
        help=f"overlap contenders (repeatable; default: {', '.join(OVERLAP_CONFIGS)})",
    )  # fmt: skip
    parser.add_argument("--nproc", type=int, default=2)
    d = DemoConfig()
    for flag in ("layers", "dim", "heads", "batch_size", "block_size", "eval_batches", "seed"):
        parser.add_argument(
            f"--{flag.replace('_', '-')}", dest=flag, type=int, default=getattr(d, flag),
            help="as `overlap demo`'s",
        )  # fmt: skip
    parser.add_argument("--powersgd-start-iter", type=int, default=2, help="first step PowerSGD compresses")
    parser.add_argument("--json", type=Path, default=None, help="write the runs here")
    parser.add_argument("--png", type=Path, default=None, help="loss curves")
    parser.add_argument(
        "--from-json", type=Path, action="append", default=[],
        help="report on runs saved by --json; train nothing (repeat: one file per seed)",
    )  # fmt: skip
    parser.add_argument(
        "--step-json", type=Path, action="append", default=[],
        help="an `overlap bench step --json` file (one per link): combined table and frontier",
    )  # fmt: skip
    parser.add_argument(
        "--frontier-png", type=Path, action="append", default=[],
        help="frontier picture, one per --step-json, in the same order",
    )  # fmt: skip
    args = parser.parse_args()
    if args.frontier_png and len(args.frontier_png) != len(args.step_json):
        raise SystemExit("convergence.py: give one --frontier-png per --step-json")
    cfg = replace(
        DemoConfig(), steps=args.steps, log_every=10**9, layers=args.layers, dim=args.dim,
        heads=args.heads, batch_size=args.batch_size, block_size=args.block_size,
        eval_batches=args.eval_batches, seed=args.seed,
    )  # fmt: skip
    if args.from_json:
        saved = [json.loads(path.read_text()) for path in args.from_json]
        seeds = [[ConvergenceRun(**r) for r in one["runs"]] for one in saved]
        steps = saved[0]["steps"]
        if any(one["steps"] != steps for one in saved):
            raise SystemExit("convergence.py: the --from-json files ran different numbers of steps")
    else:
        seeds = [converge(contender_list(args), cfg, args.nproc, args.powersgd_start_iter)]
        steps = args.steps
    runs = seeds[0]
    print(f"\nconvergence: GPT {cfg.layers}x{cfg.dim}, {steps} steps, {args.nproc} ranks")
    for one in seeds:
        print(format_losses(one))
    if args.json and not args.from_json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"steps": steps, "demo": asdict(cfg), "runs": [asdict(r) for r in runs]}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        plot_losses(runs, steps, args.png)
    for i, step_json in enumerate(args.step_json):
        report = json.loads(step_json.read_text())
        points = join(report, seeds)
        print(format_frontier(report["link"], points))
        if args.frontier_png:
            plot_frontier(report["link"], points, args.frontier_png[i])


if __name__ == "__main__":
    main()
