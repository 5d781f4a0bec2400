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
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import overlap
from overlap import checkpoint
from overlap.tools.data import ByteDataset, get_batch, rank_generator
from overlap.tools.launch import (
    current_device,
    default_world,
    exit_now,
    in_torchrun,
    init_from_env,
    run_local_world,
)
from overlap.tools.models import GPT, GPTConfig
from overlap.observe.monitor import rss_bytes

Engine = Literal["overlap", "ddp"]
CRASH_AT_ENV = "OVERLAP_DEMO_CRASH_AT"
CRASH_RANK_ENV = "OVERLAP_DEMO_CRASH_RANK"
CRASH_MARKER = ".overlap_demo_crash_injected"
CRASH_EXIT_CODE = 13
DEFAULT_SAVE_EVERY = 50


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run. Defaults take about two minutes on two CPU cores and end near loss 2.1."""

    steps: int = 200
    nproc: int | None = None
    """Ranks of the spawned local world; None: `default_world()`. Ignored under torchrun."""
    layers: int = 4
    dim: int = 192
    heads: int = 6
    block_size: int = 128
    batch_size: int = 16
    """Sequences per rank per step."""
    lr: float = 3e-3
    seed: int = 0
    log_every: int = 50
    eval_batches: int = 8
    max_bytes: int = 8 * 1024 * 1024
    engine: Engine = "overlap"
    """"ddp" trains the same model with DistributedDataParallel: the baseline to compare with."""
    prefetch_depth: int | None = None
    """Engine knobs: None keeps `overlap.OverlapConfig`'s default."""
    bucket_bytes: int | None = None
    reshard_after_forward: bool | None = None
    param_compression: str | None = None
    grad_compression: str | None = None
    error_feedback: bool | None = None
    checkpoint_dir: str | None = None
    """Save checkpoints here and resume from the latest one found ([Note: demo resume])."""
    save_every: int | None = None
    """Steps between checkpoints (None: 50); the last step is always saved. Needs checkpoint_dir."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"overlap demo: --steps must be >= 1, got {self.steps}")
        if self.save_every is not None and self.save_every < 1:
            raise ValueError(f"overlap demo: --save-every must be >= 1, got {self.save_every}")
        if self.checkpoint_dir is not None and self.engine == "ddp":
            raise ValueError(
                "overlap demo: --checkpoint-dir saves through overlap.checkpoint, which needs the "
                "overlap engine; drop --engine ddp or --checkpoint-dir"
            )
        if self.save_every is not None and self.checkpoint_dir is None:
            warnings.warn(
                "overlap demo: --save-every is ignored without --checkpoint-dir", stacklevel=3
            )

    @property
    def save_interval(self) -> int:
        """Steps between checkpoints, the default filled in."""
        return self.save_every or DEFAULT_SAVE_EVERY

    def wrap_overrides(self) -> dict[str, Any]:
        """The engine knobs that were set, as `overlap.wrap` keyword overrides."""
        knobs = {
            "prefetch_depth": self.prefetch_depth,
            "reduce_scatter_bucket_bytes": self.bucket_bytes,
            "reshard_after_forward": self.reshard_after_forward,
            "param_compression": self.param_compression,
            "grad_compression": self.grad_compression,
            "error_feedback": self.error_feedback,
        }
        return {k: v for k, v in knobs.items() if v is not None}


@dataclass
class DemoResult:
    """What rank 0 reports; returned so tests and scripts need not parse the printout."""

    first_loss: float
    """Step 0's training loss, averaged over ranks (about ln(256) = 5.55); after a resume too."""
    final_loss: float
    """Mean training loss of the last ten steps, averaged over ranks (one step is noisy)."""
    val_loss: float
    median_step_ms: float
    exposed_comm_share: float | None
    rss_mb_per_rank: list[float]
    sharded_state_mb_per_rank: list[float]
    wall_s: float
    losses: list[float] | None = None
    """Training loss of every step, averaged over ranks (from step 0, also after a resume)."""
    peak_rss_mb_per_rank: list[float] | None = None
    """High-water resident memory of each rank's process (the OS's figure, ru_maxrss)."""
    library_peak_mb_per_rank: list[float] | None = None
    """High-water mark of overlap's own buffers in the last step, state included
    (`overlap.memory_stats`; [Note: memory accounting] in memory.py)."""
    start_step: int = 0
    """Steps already done when this run began: the checkpoint it resumed from, or 0. Step
    times, exposed comm and memory cover only the steps this run trained."""


# ---------------------------------------------------------------------------------------------
# Memory accounting


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for `t`: a DTensor shard counts only its local piece."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def sharded_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state held by this rank, by accounting (not RSS):
    with sharding it is ~1/world of the model's, which is the point of ZeRO-3."""
    total = 0
    for p in model.parameters():
        total += _local_bytes(p)
        if p.grad is not None:
            total += _local_bytes(p.grad)
    for state in opt.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def peak_rss_bytes() -> int:
    """High-water resident memory of this process (the OS's figure)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def library_peak_bytes(model: nn.Module) -> int:
    """The accounted high-water mark of overlap's buffers this step (0 for other wrappers)."""
    if getattr(model, "_overlap_state", None) is None:
        return 0
    from overlap.api import memory_stats

    return memory_stats(model).peak_total_bytes


def gather_floats(value: float) -> list[float]:
    """`value` from every rank, in rank order (a tiny all-gather, on the rank's device)."""
    t = torch.tensor([value], dtype=torch.float64, device=current_device())
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [x.item() for x in out]


def mean_across_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=current_device())
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# ---------------------------------------------------------------------------------------------
# Training


def build_model(cfg: DemoConfig, device: torch.device) -> nn.Module:
    """The same initial weights on every rank (seeded), then sharded (or DDP-replicated)."""
    torch.manual_seed(cfg.seed)
    gpt_cfg = GPTConfig(
        block_size=cfg.block_size, n_layer=cfg.layers, n_head=cfg.heads, n_embd=cfg.dim
    )
    model = GPT(gpt_cfg).to(device)
    if cfg.engine == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    return overlap.wrap(model, **cfg.wrap_overrides())


def lr_factor(step: int, cfg: DemoConfig) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to a tenth of `lr`:
    a high peak learning rate is what lets a short run get far. A factor of `cfg.lr`."""
    warmup = max(1, cfg.steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: nn.Module, cfg: DemoConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and its schedule; the scheduler's state is the schedule position a checkpoint keeps."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))
    return opt, sched


def batches(
    data: torch.Tensor, cfg: DemoConfig, rank: int, start: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batch of every step from `start` on. The stream is replayed up to `start`
    rather than restored, so it depends only on (seed, rank, step) ([Note: demo resume])."""
    gen = rank_generator(cfg.seed, rank)
    for _ in range(start):
        get_batch(data, cfg.batch_size, cfg.block_size, gen)
    while True:
        yield get_batch(data, cfg.batch_size, cfg.block_size, gen)


def clip_grads(model: nn.Module, cfg: DemoConfig) -> torch.Tensor:
    if cfg.engine == "ddp":
        return nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return overlap.clip_grad_norm_(model, 1.0)


def exposed_comm_ms(model: nn.Module, cfg: DemoConfig) -> float | None:
    """The last step's communication wait the engine could not hide (None for DDP)."""
    stats = None if cfg.engine == "ddp" else overlap.step_stats(model)
    return None if stats is None else stats.exposed_comm_ms


def sync(device: torch.device) -> None:
    """Make wall-clock step times honest on GPU, where kernels run asynchronously."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, cfg: DemoConfig, device: torch.device) -> float:
    """Mean validation loss over `eval_batches` batches per rank, averaged across ranks."""
    model.eval()
    gen = rank_generator(cfg.seed + 1, dist.get_rank())
    losses = []
    for _ in range(cfg.eval_batches):
        x, y = get_batch(data, cfg.batch_size, cfg.block_size, gen)
        losses.append(model(x.to(device), y.to(device))[1].item())
    model.train()
    return mean_across_ranks([statistics.fmean(losses)])[0]


@dataclass
class _StepLog:
    """Per-step numbers of this rank, kept for the periodic lines and the final summary."""

    losses: list[float]
    step_ms: list[float]
    exposed_ms: list[float | None]

    def window(self, start: int) -> tuple[float, float | None]:
        """Median step time and exposed-comm share over steps `start:`, skipping step 0,
        which records the unit order and is not representative."""
        if start >= len(self.step_ms):  # nothing trained (a resume of a finished run)
            return math.nan, None
        lo = max(start, 1) if len(self.step_ms) > 1 else 0
        ms = statistics.median(self.step_ms[lo:])
        shares = [
            e / s
            for e, s in zip(self.exposed_ms[lo:], self.step_ms[lo:], strict=True)
            if e is not None
        ]
        return ms, (statistics.median(shares) if shares else None)


def _fmt_share(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}%"


def _fmt_mb(values: list[float]) -> str:
    return "/".join(f"{v / 2**20:.1f}" for v in values) + " MB"


def log_line(step: int, cfg: DemoConfig, log: _StepLog, start: int, state_bytes: int) -> str:
    """One progress line; every rank must call it (it gathers memory and losses)."""
    loss = statistics.fmean(mean_across_ranks(log.losses[start:]))
    ms, share = log.window(start)
    rss = gather_floats(float(rss_bytes()))
    state = gather_floats(float(state_bytes))
    return (
        f"step {step + 1:>5}/{cfg.steps} | loss {loss:.3f} | {ms:.1f} ms/step | "
        f"exposed comm {_fmt_share(share)} | rss {_fmt_mb(rss)} | "
        f"param+grad+optim {_fmt_mb(state)}"
    )


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    cfg: DemoConfig,
    crash_here: bool = False,
) -> float:
    _, loss = model(*batch)
    if crash_here:  # after the forward: the other ranks are left waiting in a collective
        crash(dist.get_rank(), cfg)
    loss.backward()
    clip_grads(model, cfg)
    opt.step()
    return loss.item()


# ---------------------------------------------------------------------------------------------
# Checkpoints and crash injection ([Note: demo resume], [Note: demo crash injection])


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
    found = None if cfg.checkpoint_dir is None else checkpoint.latest(cfg.checkpoint_dir)
    if found is None:
        return 0, []
    info = checkpoint.load(found, model, opt, scheduler=sched)
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
    checkpoint.save(cfg.checkpoint_dir, model, opt, step=done, scheduler=sched, extra=extra)


def train_rank(rank: int, world_size: int, cfg: DemoConfig) -> DemoResult | None:
    """The demo on one rank; rank 0 prints and returns the result, the others return None."""
    t0 = time.perf_counter()
    device = current_device()
    data = ByteDataset.from_stdlib(cfg.max_bytes)
    model = build_model(cfg, device)
    opt, sched = build_optimizer(model, cfg)
    log = _StepLog([], [], [])
    say = tqdm.write if rank == 0 else (lambda _: None)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        say(
            f"overlap demo: {world_size} ranks {dist.get_backend()} on {device.type}, "
            f"{cfg.engine}, GPT {cfg.layers}x{cfg.dim} ({n / 1e6:.2f}M params), {cfg.steps} steps"
        )
    first, history = resume(cfg, model, opt, sched, say)
    crash_at = injected_crash_step(rank, cfg)
    stream = batches(data.train, cfg, rank, first)
    bar = tqdm(
        range(first, cfg.steps),
        initial=first,
        total=cfg.steps,
        disable=rank != 0,
        desc="train",
        dynamic_ncols=True,
    )
    window_start, state_bytes = 0, 0
    for step in bar:
        x, y = next(stream)
        start = time.perf_counter()
        batch = (x.to(device), y.to(device))
        log.losses.append(train_step(model, opt, batch, cfg, crash_here=step == crash_at))
        sync(device)
        log.step_ms.append((time.perf_counter() - start) * 1e3)
        log.exposed_ms.append(exposed_comm_ms(model, cfg))
        bar.set_postfix(loss=f"{log.losses[-1]:.3f}")
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            state_bytes = sharded_state_bytes(model, opt)  # before zero_grad: gradients count
            say(log_line(step, cfg, log, window_start, state_bytes))
            window_start = len(log.losses)
        opt.zero_grad(set_to_none=True)
        sched.step()
        done = step + 1
        if cfg.checkpoint_dir is not None and (
            done % cfg.save_interval == 0 or done == cfg.steps
        ):
            save(cfg, model, opt, sched, done, history + mean_across_ranks(log.losses))
    bar.close()
    if first >= cfg.steps:
        say(f"the checkpoint is at step {first}: nothing left to train (--steps {cfg.steps})")
    elapsed = time.perf_counter() - t0
    return _finish(model, data, cfg, log, history, first, state_bytes, elapsed)


def _finish(
    model: nn.Module,
    data: ByteDataset,
    cfg: DemoConfig,
    log: _StepLog,
    history: list[float],
    first: int,
    state_bytes: int,
    wall_s: float,
) -> DemoResult | None:
    """Validation loss, cross-rank numbers and the summary line (rank 0). `history`: the
    rank-averaged losses of the `first` steps done before this run resumed."""
    lib_peak = library_peak_bytes(model)  # the last training step's, before eval resets it
    val = evaluate(model, data.val, cfg, current_device())
    losses = history + (mean_across_ranks(log.losses) if log.losses else [])
    ms, share = log.window(0)
    result = DemoResult(
        losses=losses,
        first_loss=losses[0] if losses else math.nan,
        final_loss=statistics.fmean(losses[-min(10, len(losses)) :]) if losses else math.nan,
        val_loss=val,
        median_step_ms=ms,
        exposed_comm_share=share,
        rss_mb_per_rank=[v / 2**20 for v in gather_floats(float(rss_bytes()))],
        sharded_state_mb_per_rank=[v / 2**20 for v in gather_floats(float(state_bytes))],
        peak_rss_mb_per_rank=[v / 2**20 for v in gather_floats(float(peak_rss_bytes()))],
        library_peak_mb_per_rank=[v / 2**20 for v in gather_floats(float(lib_peak))],
        wall_s=wall_s,
        start_step=first,
    )
    if dist.get_rank() != 0:
        return None
    print(
        f"demo done: train loss {result.first_loss:.3f} -> {result.final_loss:.3f} | "
        f"val loss {result.val_loss:.3f} | median step {ms:.1f} ms | "
        f"exposed comm {_fmt_share(share)} | "
        f"rss {'/'.join(f'{v:.0f}' for v in result.rss_mb_per_rank)} MB | "
        f"param+grad+optim {'/'.join(f'{v:.1f}' for v in result.sharded_state_mb_per_rank)} MB | "
        f"peak rss (OS) {'/'.join(f'{v:.0f}' for v in result.peak_rss_mb_per_rank or [])} MB, "
        f"overlap buffers peak {'/'.join(f'{v:.1f}' for v in result.library_peak_mb_per_rank or [])} MB | "
        f"{wall_s:.1f} s",
        flush=True,
    )
    return result


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
