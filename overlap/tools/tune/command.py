"""`overlap tune`: tune W1 or the demo GPT on a spawned local world and write the config JSON.

    overlap tune --model w1 --nproc 2 --out tuned.json
    overlap tune --model gpt --layers 4 --dim 256 --heads 4 --out gpt.json --budget 40
    overlap tune --model w1 --link 1gbit --allow-compression --out w1_link.json
    overlap tune --model w1 --prefetch-depth 1,2 --bucket-bytes 0,50e6 --out small.json

The workloads are `overlap bench step`'s (overlap/tools/workloads/step.py): W1, a stack of
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

from overlap.tools.flags import JSON_FLAG, LINK_FLAG, add_flags, config_or_exit, flag, from_flags, given_flags
from overlap.tools.tune.predict import OptimizerFn, StepFn
from overlap.tools.tune.space import Codec, TuneSpace, default_space
from overlap.tools.tune.tuner import TuneConfig, TuneResult, tune
from overlap.tools.workloads.step import Workload, build_model, make_batch, train_step
from overlap.tools.worlds.link import LinkError, LinkSpec
from overlap.tools.worlds.runner import run_bench

SEARCH_FLAGS = (
    "allow_compression", "keep_fraction", "max_candidates", "calibration", "first_round_steps",
    "total_steps", "warmup_steps", "cache_dir",
)  # fmt: skip
"""The TuneConfig fields `overlap tune` takes as flags (the cache policy is --refresh/--no-cache)."""


@dataclass(frozen=True, kw_only=True)
class TuneCommand:
    """One `overlap tune` run: the workload, the world, the search."""

    workload: Workload = field(default_factory=Workload, metadata=flag(cli=False))
    """Model and batch (a `StepBenchConfig` is one too)."""
    search: TuneConfig = field(default_factory=TuneConfig, metadata=flag(cli=False))
    space_overrides: dict[str, tuple[Any, ...]] = field(default_factory=dict, metadata=flag(cli=False))
    """TuneSpace fields replacing the model's default space (e.g. prefetch_depth=(1, 2))."""
    out: str | None = None
    """Where rank 0 writes the tuned OverlapConfig JSON."""
    nproc: int | None = None
    """Ranks to spawn (None: every GPU with NCCL, else 2 CPU ranks with gloo)."""
    link: str | None = field(default=None, metadata=LINK_FLAG)
    json_path: str | None = field(default=None, metadata=JSON_FLAG)
    """The whole TuneResult (rounds, predictions) as JSON (run_bench writes it)."""

    def __post_init__(self) -> None:
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        if self.link is not None:
            LinkSpec.parse(self.link)
        TuneSpace(**self.space_overrides)  # name a bad value here, not in the ranks


def workload_fns(cfg: Workload, rank: int) -> tuple[Callable[[], torch.nn.Module], StepFn, OptimizerFn]:
    """model_fn, step_fn and optimizer_fn of `overlap bench step`'s workload on `rank`."""
    batch = make_batch(cfg, rank)

    def step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        train_step(model, opt, batch)

    return (functools.partial(build_model, cfg), step_fn, functools.partial(torch.optim.AdamW, lr=cfg.lr))


def workload_key(cfg: Workload) -> dict[str, Any]:
    """What the model signature cannot see: batch shape and threads per rank."""
    return {"workload": cfg.model, "batch": cfg.batch, "seq": cfg.seq, "threads": torch.get_num_threads()}


def resolve_space(cmd: TuneCommand, model: torch.nn.Module) -> TuneSpace:
    """The model's default space with the command line's fields replacing its own."""
    space = default_space(model, base=cmd.search.base, allow_compression=cmd.search.allow_compression)
    return TuneSpace(**{**space.to_dict(), **cmd.space_overrides})


def tune_rank(rank: int, world_size: int, cmd: TuneCommand) -> TuneResult | None:
    """The tuner on one rank (all ranks call it); rank 0 prints and returns the result."""
    model_fn, step_fn, optimizer_fn = workload_fns(cmd.workload, rank)
    space = resolve_space(cmd, model_fn())
    search = cmd.search.replace(space=space, key_extra={**cmd.search.key_extra, **workload_key(cmd.workload)})
    result = tune(model_fn, step_fn, config=search, optimizer_fn=optimizer_fn, out=cmd.out)
    if rank != 0:
        return None
    print(result.format(), flush=True)
    if cmd.out is not None:
        print(f"wrote {cmd.out}", flush=True)
    return result


def run_tune(cmd: TuneCommand) -> TuneResult | None:
    """`tune_rank` on the right world (torchrun's, an emulated link, or spawned); rank 0's result."""
    return run_bench(tune_rank, cmd)


# --------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The world and output (TuneCommand), the search (TuneConfig), the space (TuneSpace: each
    flag given replaces the model's default values) and the workload (Workload)."""
    add_flags(parser, TuneCommand, defaults={"out": "tuned.json"})
    add_flags(parser, TuneConfig, only=SEARCH_FLAGS)
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--refresh", dest="cache", action="store_const", const="refresh",
                       help="re-tune and overwrite the cache entry")  # fmt: skip
    cache.add_argument("--no-cache", dest="cache", action="store_const", const="off",
                       help="neither read nor write the cache")  # fmt: skip
    parser.set_defaults(cache="use")
    add_flags(parser, TuneSpace, required_none=True)
    add_flags(parser.add_argument_group("workload (as overlap bench step)"), Workload)


def command_from_args(args: argparse.Namespace) -> TuneCommand:
    overrides = given_flags(TuneSpace, args)
    if any(not Codec(*c).lossless for c in overrides.get("codecs", ())) and not args.allow_compression:
        raise ValueError("--codecs with a lossy codec needs --allow-compression")
    return from_flags(
        TuneCommand,
        args,
        workload=from_flags(Workload, args),
        search=from_flags(TuneConfig, args),
        space_overrides=overrides,
        out=str(Path(args.out).resolve()) if args.out else None,
    )


def run(args: argparse.Namespace) -> int:
    cmd = config_or_exit("overlap tune", lambda: command_from_args(args))
    try:
        run_tune(cmd)
    except LinkError as e:
        raise SystemExit(f"overlap tune: {e}") from None
    return 0
