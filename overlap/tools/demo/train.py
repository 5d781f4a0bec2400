"""`overlap demo`'s training on one rank: the model, optimizer and schedule, the data stream,
the step, evaluation, and the summary rank 0 prints.

Split out of overlap/tools/demo.py, whose docstring holds [Note: demo resume].
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

import overlap
from overlap.observe.monitor import rss_bytes
from overlap.tools.demo import metrics
from overlap.tools.demo.checkpoint import crash, injected_crash_step, resume, save
from overlap.tools.demo.config import DemoConfig, DemoResult
from overlap.tools.workloads import GPT, GPTConfig
from overlap.tools.workloads.data import ByteDataset, get_batch, rank_generator
from overlap.tools.worlds.launch import current_device


def build_model(cfg: DemoConfig, device: torch.device) -> nn.Module:
    """The same initial weights on every rank (seeded), then sharded (or DDP-replicated)."""
    torch.manual_seed(cfg.seed)
    gpt_cfg = GPTConfig(block_size=cfg.block_size, n_layer=cfg.layers, n_head=cfg.heads, n_embd=cfg.dim)
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


def batches(data: torch.Tensor, cfg: DemoConfig, rank: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
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
    return metrics.mean_across_ranks([statistics.fmean(losses)])[0]


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


def train_rank(rank: int, world_size: int, cfg: DemoConfig) -> DemoResult | None:
    """The demo on one rank; rank 0 prints and returns the result, the others return None."""
    t0 = time.perf_counter()
    device = current_device()
    data = ByteDataset.from_stdlib(cfg.max_bytes)
    model = build_model(cfg, device)
    opt, sched = build_optimizer(model, cfg)
    log = metrics._StepLog([], [], [])
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
        range(first, cfg.steps), initial=first, total=cfg.steps, disable=rank != 0, desc="train", dynamic_ncols=True
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
            state_bytes = metrics.sharded_state_bytes(model, opt)  # before zero_grad: gradients count
            say(metrics.log_line(step, cfg, log, window_start, state_bytes))
            window_start = len(log.losses)
        opt.zero_grad(set_to_none=True)
        sched.step()
        done = step + 1
        if cfg.checkpoint_dir is not None and (done % cfg.save_interval == 0 or done == cfg.steps):
            save(cfg, model, opt, sched, done, history + metrics.mean_across_ranks(log.losses))
    bar.close()
    if first >= cfg.steps:
        say(f"the checkpoint is at step {first}: nothing left to train (--steps {cfg.steps})")
    elapsed = time.perf_counter() - t0
    return _finish(model, data, cfg, log, history, first, state_bytes, elapsed)


def _finish(
    model: nn.Module,
    data: ByteDataset,
    cfg: DemoConfig,
    log: metrics._StepLog,
    history: list[float],
    first: int,
    state_bytes: int,
    wall_s: float,
) -> DemoResult | None:
    """Validation loss, cross-rank numbers and the summary line (rank 0). `history`: the
    rank-averaged losses of the `first` steps done before this run resumed."""
    lib_peak = metrics.library_peak_bytes(model)  # the last training step's, before eval resets it
    val = evaluate(model, data.val, cfg, current_device())
    losses = history + (metrics.mean_across_ranks(log.losses) if log.losses else [])
    ms, share = log.window(0)
    result = DemoResult(
        losses=losses,
        first_loss=losses[0] if losses else math.nan,
        final_loss=statistics.fmean(losses[-min(10, len(losses)) :]) if losses else math.nan,
        val_loss=val,
        median_step_ms=ms,
        exposed_comm_share=share,
        rss_mb_per_rank=[v / 2**20 for v in metrics.gather_floats(float(rss_bytes()))],
        sharded_state_mb_per_rank=[v / 2**20 for v in metrics.gather_floats(float(state_bytes))],
        peak_rss_mb_per_rank=[v / 2**20 for v in metrics.gather_floats(float(metrics.peak_rss_bytes()))],
        library_peak_mb_per_rank=[v / 2**20 for v in metrics.gather_floats(float(lib_peak))],
        wall_s=wall_s,
        start_step=first,
    )
    if dist.get_rank() != 0:
        return None
    print(
        f"demo done: train loss {result.first_loss:.3f} -> {result.final_loss:.3f} | "
        f"val loss {result.val_loss:.3f} | median step {ms:.1f} ms | "
        f"exposed comm {metrics._fmt_share(share)} | "
        f"rss {'/'.join(f'{v:.0f}' for v in result.rss_mb_per_rank)} MB | "
        f"param+grad+optim {'/'.join(f'{v:.1f}' for v in result.sharded_state_mb_per_rank)} MB | "
        f"peak rss (OS) {'/'.join(f'{v:.0f}' for v in result.peak_rss_mb_per_rank or [])} MB, "
        f"overlap buffers peak {'/'.join(f'{v:.1f}' for v in result.library_peak_mb_per_rank or [])} MB | "
        f"{wall_s:.1f} s",
        flush=True,
    )
    return result
