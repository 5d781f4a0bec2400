"""`overlap demo`: train a small byte-level GPT on the Python stdlib's source with `overlap.wrap`.

It shows, in about two minutes on two CPU cores, that a sharded model learns (the loss falls from
ln(256) ~ 5.5), how long a step takes, how much of it was communication the engine failed to
hide, and what each rank holds in memory. Under torchrun it trains in the launcher's world;
otherwise it spawns a local one (two gloo ranks on CPU, every GPU with NCCL).

With `--checkpoint-dir DIR` it saves a sharded checkpoint (`overlap.checkpoint`) every
`--save-every` steps and after the last one, and a run that finds a checkpoint in DIR resumes from
the latest: `torchrun --max-restarts=N ... -m overlap demo --checkpoint-dir DIR` survives a crash.

[Note: demo resume]
A resumed run trains exactly as the uninterrupted one would (bitwise at the same world size):
- model, AdamW moments and the LR schedule (a `LambdaLR`, so its position is its `last_epoch`)
  come back through `overlap.checkpoint.load`, which also restores each rank's random generators;
- the data position is the number of steps done (`extra["data_position"]`). Each rank's batches
  are one stream from `rank_generator(seed, rank)`; a resumed rank replays the stream up to that
  position (a few microseconds a step) instead of restoring a generator state, so a rank that
  the saving world did not have (a resume at a larger world size) lands where an uninterrupted
  run at that size would be;
- the losses of the steps before the checkpoint (averaged over ranks) travel in
  `extra["loss_history"]`, so the resumed run reports the whole run's first and final loss.

[Note: demo crash injection]
For tests of the restart path, `OVERLAP_DEMO_CRASH_AT=K` makes rank `OVERLAP_DEMO_CRASH_RANK`
(default 0) exit hard (`os._exit`, no cleanup, like a lost node) during step K (counted from 0,
after its forward, while the other ranks wait in a collective). Only the first attempt crashes:
not when `TORCHELASTIC_RESTART_COUNT` is above 0 (a torchrun restart), nor when the marker file
`DIR/.overlap_demo_crash_injected`, written just before the exit, exists (a rerun of a spawned
local world).

Layout: the config and result are in demo_config.py, the memory figures and progress lines in
demo_metrics.py, checkpoints and crash injection in demo_checkpoint.py, the training of one rank
in demo_train.py; this module launches the world and holds the command line. Every public name
those modules define is importable from here as before.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from dataclasses import asdict, fields
from pathlib import Path

import torch.distributed as dist

from overlap.tools.launch import (
    default_world,
    exit_now,
    in_torchrun,
    init_from_env,
    run_local_world,
)

# Re-exported: these lived in this module before it was split; importers keep using demo.X.
# Config and result: overlap/tools/demo_config.py
from overlap.tools.demo_config import DEFAULT_SAVE_EVERY, DemoConfig, DemoResult, Engine

# Memory figures, cross-rank gathers, progress lines: overlap/tools/demo_metrics.py
from overlap.tools.demo_metrics import (
    gather_floats,
    library_peak_bytes,
    log_line,
    mean_across_ranks,
    peak_rss_bytes,
    sharded_state_bytes,
)

# Checkpoints and crash injection: overlap/tools/demo_checkpoint.py
from overlap.tools.demo_checkpoint import (
    CRASH_AT_ENV,
    CRASH_EXIT_CODE,
    CRASH_MARKER,
    CRASH_RANK_ENV,
    crash,
    injected_crash_step,
    resume,
    save,
)

# Training on one rank: overlap/tools/demo_train.py
from overlap.tools.demo_train import (
    batches,
    build_model,
    build_optimizer,
    clip_grads,
    evaluate,
    exposed_comm_ms,
    lr_factor,
    sync,
    train_rank,
    train_step,
)

__all__ = [
    "CRASH_AT_ENV",
    "CRASH_EXIT_CODE",
    "CRASH_MARKER",
    "CRASH_RANK_ENV",
    "DEFAULT_SAVE_EVERY",
    "DemoConfig",
    "DemoResult",
    "Engine",
    "add_arguments",
    "batches",
    "build_model",
    "build_optimizer",
    "clip_grads",
    "crash",
    "demo",
    "evaluate",
    "exposed_comm_ms",
    "gather_floats",
    "injected_crash_step",
    "library_peak_bytes",
    "log_line",
    "lr_factor",
    "mean_across_ranks",
    "peak_rss_bytes",
    "resume",
    "run",
    "save",
    "sharded_state_bytes",
    "sync",
    "train_rank",
    "train_step",
]


def demo(cfg: DemoConfig, deadline_s: float | None = None) -> DemoResult | None:
    """Run the demo in torchrun's world if there is one, else in a spawned local world
    (`deadline_s` bounds that one: a rank still running then is named in a `TimeoutError`)."""
    if in_torchrun():
        init_from_env()
        try:
            result = train_rank(dist.get_rank(), dist.get_world_size(), cfg)
            gc.collect()  # [Note: rank exit] in overlap/tools/launch.py, as a spawned rank does
            return result
        finally:
            dist.destroy_process_group()
    nproc, backend = default_world()
    world = cfg.nproc or nproc
    return run_local_world(train_rank, world, cfg, backend=backend, deadline_s=deadline_s)[0]


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `overlap demo`; each maps to a `DemoConfig` field of the same name."""
    d = DemoConfig()
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument(
        "--nproc", type=int, default=d.nproc, help="ranks (default: 2 on CPU, all GPUs)"
    )
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--dim", type=int, default=d.dim)
    parser.add_argument("--heads", type=int, default=d.heads)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="per rank")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--log-every", type=int, default=d.log_every)
    parser.add_argument("--eval-batches", type=int, default=d.eval_batches)
    parser.add_argument(
        "--max-bytes", type=int, default=d.max_bytes, help="bytes of stdlib source to train on"
    )
    parser.add_argument(
        "--engine",
        choices=["overlap", "ddp"],
        default=d.engine,
        help="ddp: the DistributedDataParallel baseline",
    )
    ckpt = parser.add_argument_group("checkpoints (resume after a crash)")
    ckpt.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="save sharded checkpoints here; resume from the latest one found",
    )
    ckpt.add_argument(
        "--save-every",
        type=int,
        default=None,
        metavar="N",
        help=f"steps between checkpoints (default {DEFAULT_SAVE_EVERY}; the last step is saved)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="write the result (every step's loss, val loss, timings) as JSON",
    )
    knobs = parser.add_argument_group("engine knobs (overlap.wrap overrides)")
    knobs.add_argument("--prefetch-depth", type=int, default=None)
    knobs.add_argument("--bucket-bytes", type=int, default=None, help="reduce_scatter_bucket_bytes")
    knobs.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_const",
        const=False,
        default=None,
        help="keep gathered weights until backward (ZeRO-2)",
    )
    knobs.add_argument("--param-compression", choices=["bf16", "int8", "fp8"], default=None)
    knobs.add_argument("--grad-compression", choices=["bf16", "int8", "int4"], default=None)
    knobs.add_argument(
        "--error-feedback", action="store_const", const=True, default=None, help="with --grad-compression"
    )


def run(args: argparse.Namespace) -> int:
    names = {f.name for f in fields(DemoConfig)}
    cfg = DemoConfig(**{k: v for k, v in vars(args).items() if k in names})
    result = demo(cfg)
    if result is not None and args.json_path is not None:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(asdict(result), indent=1) + "\n")
    code = 0
    if result is not None and not math.isfinite(result.final_loss):
        print("demo: the loss is not finite", file=sys.stderr)
        code = 1
    if in_torchrun():
        # A torchrun rank is done and its process group destroyed: leave without interpreter
        # finalization ([Note: rank exit]). Under torchrun a rank that aborted there (seen once in
        # CI, after every step had finished) reads to the launcher as a failed rank.
        exit_now(code)
    return code
