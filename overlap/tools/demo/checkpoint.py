"""`overlap demo`'s checkpoints (resume from the latest, save every N steps) and its crash
injection for tests of the restart path.

The package's docstring (overlap/tools/demo/__init__.py) holds [Note: demo resume] and
[Note: demo crash injection].
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import overlap
from overlap.tools.demo.config import DemoConfig

CRASH_AT_ENV = "OVERLAP_DEMO_CRASH_AT"
CRASH_RANK_ENV = "OVERLAP_DEMO_CRASH_RANK"
CRASH_MARKER = ".overlap_demo_crash_injected"
CRASH_EXIT_CODE = 13


def injected_crash_step(rank: int, cfg: DemoConfig) -> int | None:
    """The step during which this rank is to crash, or None (see [Note: demo crash injection])."""
    raw_step = os.environ.get(CRASH_AT_ENV)
    if raw_step is None:
        return None
    raw_rank = os.environ.get(CRASH_RANK_ENV, "0")
    try:
        step, crash_rank = int(raw_step), int(raw_rank)
    except ValueError:
        raise ValueError(
            f"overlap demo: {CRASH_AT_ENV}={raw_step!r} and {CRASH_RANK_ENV}={raw_rank!r} must "
            "be integers (a step counted from 0, a rank)"
        ) from None
    if crash_rank != rank or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    if cfg.checkpoint_dir is not None and (Path(cfg.checkpoint_dir) / CRASH_MARKER).exists():
        return None
    return step


def crash(rank: int, cfg: DemoConfig) -> None:
    """Leave the marker that keeps the next attempt alive, then die without any cleanup."""
    if cfg.checkpoint_dir is not None:
        Path(cfg.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.checkpoint_dir) / CRASH_MARKER).write_text(f"rank {rank}\n")
    print(
        f"overlap demo: injected crash on rank {rank} ({CRASH_AT_ENV}={os.environ[CRASH_AT_ENV]})",
        file=sys.stderr,
        flush=True,
    )
    os._exit(CRASH_EXIT_CODE)


def resume(
    cfg: DemoConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    say: Callable[[str], None],
) -> tuple[int, list[float]]:
    """Load the latest checkpoint under `checkpoint_dir`, if there is one. Collective. Returns
    the steps already done and their losses (averaged over ranks)."""
    found = None if cfg.checkpoint_dir is None else overlap.checkpoint.latest(cfg.checkpoint_dir)
    if found is None:
        return 0, []
    info = overlap.checkpoint.load(found, model, opt, scheduler=sched)
    extra = info["extra"]
    if not isinstance(extra, dict) or not {"data_position", "loss_history"} <= extra.keys():
        raise ValueError(
            f"overlap demo: {found} was not written by `overlap demo` (its extra is {extra!r}); "
            "pass an empty or demo-only --checkpoint-dir"
        )
    done = int(extra["data_position"])
    say(f"resumed from step {done} ({found}, saved by {info['world_size']} ranks)")
    return done, list(extra["loss_history"])


def save(
    cfg: DemoConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    done: int,
    history: list[float],
) -> None:
    """Checkpoint after `done` steps; `history`: every step's rank-averaged loss. Collective."""
    assert cfg.checkpoint_dir is not None
    assert len(history) == done, f"rank {dist.get_rank()}: {len(history)} losses for {done} steps"
    extra = {"data_position": done, "loss_history": history}
    overlap.checkpoint.save(cfg.checkpoint_dir, model, opt, step=done, scheduler=sched, extra=extra)
