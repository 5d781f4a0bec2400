"""`overlap demo`: train a small byte-level GPT on the Python stdlib's source with `overlap.wrap`.

It shows, in about two minutes on two CPU cores, that a sharded model learns (the loss falls from
ln(256) ~ 5.5), how long a step takes, how much of it was communication the engine failed to
hide, and what each rank holds in memory. Under torchrun it trains in the launcher's world;
otherwise it spawns a local one (two gloo ranks on CPU, every GPU with NCCL).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import overlap
from overlap.data import ByteDataset, get_batch, rank_generator
from overlap.launch import (
    current_device,
    default_world,
    in_torchrun,
    init_from_env,
    run_local_world,
)
from overlap.models import GPT, GPTConfig

Engine = Literal["overlap", "ddp"]


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
    """Step 0's training loss, averaged over ranks (about ln(256) = 5.55)."""
    final_loss: float
    """Mean training loss of the last ten steps, averaged over ranks (one step is noisy)."""
    val_loss: float
    median_step_ms: float
    exposed_comm_share: float | None
    rss_mb_per_rank: list[float]
    sharded_state_mb_per_rank: list[float]
    wall_s: float
    losses: list[float] | None = None
    """Training loss of every step, averaged over ranks."""


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


def rss_bytes() -> int:
    """Resident memory of this process now (VmRSS); peak RSS where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


def lr_at(step: int, cfg: DemoConfig) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to a tenth of `lr`:
    a high peak learning rate is what lets a short run get far."""
    warmup = max(1, cfg.steps // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


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
) -> float:
    _, loss = model(*batch)
    loss.backward()
    clip_grads(model, cfg)
    opt.step()
    return loss.item()


def train_rank(rank: int, world_size: int, cfg: DemoConfig) -> DemoResult | None:
    """The demo on one rank; rank 0 prints and returns the result, the others return None."""
    t0 = time.perf_counter()
    device = current_device()
    data = ByteDataset.from_stdlib(cfg.max_bytes)
    model = build_model(cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = rank_generator(cfg.seed, rank)
    log = _StepLog([], [], [])
    say = tqdm.write if rank == 0 else (lambda _: None)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        say(
            f"overlap demo: {world_size} ranks {dist.get_backend()} on {device.type}, "
            f"{cfg.engine}, GPT {cfg.layers}x{cfg.dim} ({n / 1e6:.2f}M params), {cfg.steps} steps"
        )
    bar = tqdm(range(cfg.steps), disable=rank != 0, desc="train", dynamic_ncols=True)
    window_start, state_bytes = 0, 0
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = get_batch(data.train, cfg.batch_size, cfg.block_size, gen)
        start = time.perf_counter()
        log.losses.append(train_step(model, opt, (x.to(device), y.to(device)), cfg))
        sync(device)
        log.step_ms.append((time.perf_counter() - start) * 1e3)
        log.exposed_ms.append(exposed_comm_ms(model, cfg))
        bar.set_postfix(loss=f"{log.losses[-1]:.3f}")
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            state_bytes = sharded_state_bytes(model, opt)  # before zero_grad: gradients count
            say(log_line(step, cfg, log, window_start, state_bytes))
            window_start = step + 1
        opt.zero_grad(set_to_none=True)
    bar.close()
    return _finish(model, data, cfg, log, state_bytes, time.perf_counter() - t0)


def _finish(
    model: nn.Module,
    data: ByteDataset,
    cfg: DemoConfig,
    log: _StepLog,
    state_bytes: int,
    wall_s: float,
) -> DemoResult | None:
    """Validation loss, cross-rank numbers and the summary line (rank 0)."""
    val = evaluate(model, data.val, cfg, current_device())
    losses = mean_across_ranks(log.losses)
    ms, share = log.window(0)
    result = DemoResult(
        losses=losses,
        first_loss=losses[0],
        final_loss=statistics.fmean(losses[-min(10, len(losses)) :]),
        val_loss=val,
        median_step_ms=ms,
        exposed_comm_share=share,
        rss_mb_per_rank=[v / 2**20 for v in gather_floats(float(rss_bytes()))],
        sharded_state_mb_per_rank=[v / 2**20 for v in gather_floats(float(state_bytes))],
        wall_s=wall_s,
    )
    if dist.get_rank() != 0:
        return None
    print(
        f"demo done: train loss {result.first_loss:.3f} -> {result.final_loss:.3f} | "
        f"val loss {result.val_loss:.3f} | median step {ms:.1f} ms | "
        f"exposed comm {_fmt_share(share)} | "
        f"rss {'/'.join(f'{v:.0f}' for v in result.rss_mb_per_rank)} MB | "
        f"param+grad+optim {'/'.join(f'{v:.1f}' for v in result.sharded_state_mb_per_rank)} MB | "
        f"{wall_s:.1f} s",
        flush=True,
    )
    return result


def demo(cfg: DemoConfig) -> DemoResult | None:
    """Run the demo in torchrun's world if there is one, else in a spawned local world."""
    if in_torchrun():
        init_from_env()
        try:
            return train_rank(dist.get_rank(), dist.get_world_size(), cfg)
        finally:
            dist.destroy_process_group()
    nproc, backend = default_world()
    return run_local_world(train_rank, cfg.nproc or nproc, cfg, backend=backend)[0]


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
        "--engine",
        choices=["overlap", "ddp"],
        default=d.engine,
        help="ddp: the DistributedDataParallel baseline",
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
    if result is not None and not math.isfinite(result.final_loss):
        print("demo: the loss is not finite", file=sys.stderr)
        return 1
    return 0
