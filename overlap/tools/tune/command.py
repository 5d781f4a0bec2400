"""`overlap tune`: tune W1 or the demo GPT on a spawned local world and write the config JSON.

    overlap tune --model w1 --nproc 2 --out tuned.json
    overlap tune --model gpt --layers 4 --dim 256 --heads 4 --out gpt.json --budget 40
    overlap tune --model w1 --link 1gbit --allow-compression --out w1_link.json
    overlap tune --model w1 --prefetch-depth 1,2 --bucket-bytes 0,50e6 --out small.json

The workloads are `overlap bench step`'s (overlap/tools/bench/step_workload.py): W1, a stack of
nn.TransformerEncoderLayer on a fixed random batch, or the package GPT on stdlib bytes, trained
with AdamW. Under torchrun the tuner runs in torchrun's world instead of spawning one. The JSON
at `--out` is an OverlapConfig (`OverlapConfig.load(path)`, or `overlap bench step
--overlap-config` with its fields); `--json` writes the whole TuneResult. A second run with the
same model, world, link, space and options is a cache hit (`--refresh` re-tunes, `--no-cache`
neither reads nor writes the cache).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from overlap.tools.bench.step import MODELS, ModelName, StepBenchConfig
from overlap.tools.tune.predict import OptimizerFn, StepFn
from overlap.tools.tune.space import Codec, TuneSpace, default_space
from overlap.tools.tune.tuner import TuneConfig, TuneResult, tune


@dataclass(frozen=True, kw_only=True)
class TuneCommand:
    """One `overlap tune` run: the workload, the world, the search."""

    workload: StepBenchConfig = field(default_factory=StepBenchConfig)
    """Model and batch (only its model fields, batch, seq, lr and seed are used)."""
    search: TuneConfig = field(default_factory=TuneConfig)
    space_overrides: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """TuneSpace fields replacing the model's default space (e.g. prefetch_depth=(1, 2))."""
    out: str | None = None
    """Where rank 0 writes the tuned OverlapConfig JSON."""
    nproc: int | None = None
    """Ranks to spawn (None: every GPU with NCCL, else 2 CPU ranks with gloo)."""
    link: str | None = None
    json_path: str | None = None
    """Where the TuneResult JSON goes (run_bench writes it)."""

    def __post_init__(self) -> None:
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        if self.link is not None:
            from overlap.tools.bench.link import LinkSpec

            LinkSpec.parse(self.link)
        TuneSpace(**self.space_overrides)  # name a bad value here, not in the ranks


def workload_fns(
    cfg: StepBenchConfig, rank: int
) -> tuple[Callable[[], torch.nn.Module], StepFn, OptimizerFn]:
    """model_fn, step_fn and optimizer_fn of `overlap bench step`'s workload on `rank`."""
    from overlap.tools.bench.step import build_model, make_batch, train_step

    batch = make_batch(cfg, rank)

    def step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        train_step(model, opt, batch)

    return (
        functools.partial(build_model, cfg),
        step_fn,
        functools.partial(torch.optim.AdamW, lr=cfg.lr),
    )


def workload_key(cfg: StepBenchConfig) -> dict[str, Any]:
    """What the model signature cannot see: batch shape and threads per rank."""
    return {
        "workload": cfg.model,
        "batch": cfg.batch,
        "seq": cfg.seq,
        "threads": torch.get_num_threads(),
    }


def resolve_space(cmd: TuneCommand, model: torch.nn.Module) -> TuneSpace:
    """The model's default space with the command line's fields replacing its own."""
    space = default_space(
        model, base=cmd.search.base, allow_compression=cmd.search.allow_compression
    )
    return TuneSpace(**{**space.to_dict(), **cmd.space_overrides})


def tune_rank(rank: int, world_size: int, cmd: TuneCommand) -> TuneResult | None:
    """The tuner on one rank (all ranks call it); rank 0 prints and returns the result."""
    model_fn, step_fn, optimizer_fn = workload_fns(cmd.workload, rank)
    space = resolve_space(cmd, model_fn())
    search = cmd.search.replace(
        space=space, key_extra={**cmd.search.key_extra, **workload_key(cmd.workload)}
    )
    result = tune(model_fn, step_fn, config=search, optimizer_fn=optimizer_fn, out=cmd.out)
    if rank != 0:
        return None
    print(result.format(), flush=True)
    if cmd.out is not None:
        print(f"wrote {cmd.out}", flush=True)
    return result


def run_tune(cmd: TuneCommand) -> TuneResult | None:
    """`tune_rank` on the right world (torchrun's, an emulated link, or spawned); rank 0's result."""
    from overlap.tools.bench.world import run_bench

    return run_bench(tune_rank, cmd)


# --------------------------------------------------------------------------------------------
# command line


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(float(x)) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of numbers, got {text!r}"
        ) from None


def _cap_list(text: str) -> tuple[int | None, ...]:
    return tuple(
        None if x.strip().lower() == "none" else _int_list(x)[0]
        for x in text.split(",")
        if x.strip()
    )


def _codec_list(text: str) -> tuple[Codec, ...]:
    try:
        return tuple(Codec.parse(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w, t = StepBenchConfig(), TuneConfig()
    parser.add_argument("--model", default=w.model, choices=MODELS)
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, else 2)")
    parser.add_argument("--link", default=None, metavar="RATE[,DELAY]", help="e.g. 1gbit")
    parser.add_argument("--out", default="tuned.json", help="the tuned OverlapConfig JSON")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                        help="the whole TuneResult (rounds, predictions) as JSON")  # fmt: skip
    parser.add_argument("--budget", type=int, default=None, metavar="STEPS",
                        help="timed steps per rank over all rounds (default: 1 step per "
                             "candidate in the first round)")  # fmt: skip
    parser.add_argument("--allow-compression", action="store_true",
                        help="also search lossy codecs (they change the numerics)")  # fmt: skip
    parser.add_argument("--keep-fraction", type=float, default=t.keep_fraction,
                        help="share of the grid the planner passes on to measurement")  # fmt: skip
    parser.add_argument("--max-candidates", type=int, default=t.max_candidates)
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="the planner's costs, from `overlap plan --calibrate FILE` (default: this world's defaults)")  # fmt: skip
    parser.add_argument(
        "--first-round-steps",
        type=int,
        default=t.first_round_steps,
        help="timed steps per candidate in the first round (doubled each round; --budget wins)",
    )
    parser.add_argument("--warmup-steps", type=int, default=t.warmup_steps)
    parser.add_argument("--cache-dir", default=None, help="default: ~/.cache/overlap/tune")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--refresh", dest="cache", action="store_const", const="refresh",
                       help="re-tune and overwrite the cache entry")  # fmt: skip
    cache.add_argument("--no-cache", dest="cache", action="store_const", const="off")
    parser.set_defaults(cache="use")
    space = parser.add_argument_group("search space (default: sized to the model's units)")
    space.add_argument("--min-unit-numel", type=_int_list, default=None, metavar="N,N,...")
    space.add_argument("--prefetch-depth", type=_int_list, default=None, metavar="D,D,...")
    space.add_argument("--max-inflight-bytes", type=_cap_list, default=None, metavar="none,B,...")
    space.add_argument("--bucket-bytes", type=_int_list, default=None, metavar="B,B,...",
                       help="reduce_scatter_bucket_bytes values")  # fmt: skip
    space.add_argument("--max-reduce-inputs", type=_int_list, default=None, metavar="K,K,...",
                       help="max_reduce_inputs values")  # fmt: skip
    space.add_argument("--codecs", type=_codec_list, default=None, metavar="C,C,...",
                       help="e.g. none,bf16,int8+ef,fp8/int4+ef (needs --allow-compression)")  # fmt: skip
    model = parser.add_argument_group("workload (as overlap bench step)")
    model.add_argument("--layers", type=int, default=w.layers)
    model.add_argument("--dim", type=int, default=w.dim)
    model.add_argument("--heads", type=int, default=w.heads)
    model.add_argument("--ff", type=int, default=w.ff, help="W1's feed-forward width")
    model.add_argument("--batch", type=int, default=w.batch, help="sequences per rank")
    model.add_argument("--seq", type=int, default=w.seq)
    model.add_argument("--lr", type=float, default=w.lr)
    model.add_argument("--seed", type=int, default=w.seed)


def command_from_args(args: argparse.Namespace) -> TuneCommand:
    model: ModelName = args.model
    workload = StepBenchConfig(
        model=model, layers=args.layers, dim=args.dim, heads=args.heads, ff=args.ff,
        batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed,
    )  # fmt: skip
    search = TuneConfig(
        allow_compression=args.allow_compression,
        keep_fraction=args.keep_fraction,
        max_candidates=args.max_candidates,
        first_round_steps=args.first_round_steps,
        total_steps=args.budget,
        warmup_steps=args.warmup_steps,
        cache=args.cache,
        cache_dir=args.cache_dir,
        calibration=args.calibration,
    )
    overrides: dict[str, tuple[Any, ...]] = {}
    for flag, name in (
        ("min_unit_numel", "min_unit_numel"),
        ("prefetch_depth", "prefetch_depth"),
        ("max_inflight_bytes", "max_inflight_allgather_bytes"),
        ("bucket_bytes", "reduce_scatter_bucket_bytes"),
        ("max_reduce_inputs", "max_reduce_inputs"),
        ("codecs", "codecs"),
    ):
        if getattr(args, flag) is not None:
            overrides[name] = getattr(args, flag)
    codecs = overrides.get("codecs", ())
    if any(not Codec(*c).lossless for c in codecs) and not args.allow_compression:
        raise ValueError("--codecs with a lossy codec needs --allow-compression")
    return TuneCommand(
        workload=workload,
        search=search,
        space_overrides=overrides,
        out=str(Path(args.out).resolve()) if args.out else None,
        nproc=args.nproc,
        link=args.link,
        json_path=args.json_path,
    )


def run(args: argparse.Namespace) -> int:
    from overlap.tools.bench.link import LinkError

    try:
        cmd = command_from_args(args)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"overlap tune: {e}") from None
    try:
        run_tune(cmd)
    except LinkError as e:
        raise SystemExit(f"overlap tune: {e}") from None
    return 0
