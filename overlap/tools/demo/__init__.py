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

Layout: the config and result are in config.py, the memory figures and progress lines in
metrics.py, checkpoints and crash injection in checkpoint.py, the training of one rank in
train.py; this module launches the world and holds the command line. Every public name
those modules define is importable from here.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

# Checkpoints and crash injection: overlap/tools/demo/checkpoint.py
from overlap.tools.demo.checkpoint import (
    CRASH_AT_ENV,
    CRASH_EXIT_CODE,
    CRASH_MARKER,
    CRASH_RANK_ENV,
    crash,
    injected_crash_step,
    resume,
    save,
)

# Config and result: overlap/tools/demo/config.py
from overlap.tools.demo.config import DEFAULT_SAVE_EVERY, DemoConfig, DemoResult, Engine

# Memory figures, cross-rank gathers, progress lines: overlap/tools/demo/metrics.py
from overlap.tools.demo.metrics import (
    gather_floats,
    library_peak_bytes,
    log_line,
    mean_across_ranks,
    peak_rss_bytes,
    sharded_state_bytes,
)

# Training on one rank: overlap/tools/demo/train.py
from overlap.tools.demo.train import (
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
from overlap.tools.flags import add_flags, from_flags
from overlap.tools.worlds.launch import default_world, exit_now, in_torchrun, init_from_env, run_local_world

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
            gc.collect()  # [Note: rank exit] in overlap/tools/worlds/launch.py, as a spawned rank does
            return result
        finally:
            dist.destroy_process_group()
    nproc, backend = default_world()
    world = cfg.nproc or nproc
    return run_local_world(train_rank, world, cfg, backend=backend, deadline_s=deadline_s)[0]


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `overlap demo`: `DemoConfig`'s fields, and `--json`."""
    add_flags(parser, DemoConfig)
    parser.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="write the result (every step's loss, val loss, timings) as JSON",
    )


def run(args: argparse.Namespace) -> int:
    cfg = from_flags(DemoConfig, args)
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
