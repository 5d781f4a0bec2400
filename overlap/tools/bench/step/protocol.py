"""`overlap bench step`'s protocol, run on every rank: warm-up, parity check, state accounting,
the timed rounds, and the memory pass's per-rank peak.

The package's docstring (overlap/tools/bench/step/__init__.py) describes the protocol.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from overlap.engine.autotune_memory import process_peak_rss_bytes
from overlap.observe.monitor import rss_bytes
from overlap.tools.bench import peers
from overlap.tools.bench.peers import state_bytes
from overlap.tools.bench.step.config import StepBenchConfig
from overlap.tools.bench.step.contenders import Contender, build_contender, build_contenders, train_setup
from overlap.tools.bench.step.report import StepReport, summarize
from overlap.tools.workloads.step import make_batch

WARMUP_STEPS = 2
"""Untimed steps per contender per round (and once up front, where step 1 is the parity check)."""
PARITY_RTOL = 1e-5


def check_parity(contenders: list[Contender], losses: dict[str, list[float]]) -> None:
    """Loss at step 1 (after one optimizer step) vs DDP, on every rank; rank 0 warns."""
    ref = losses.get("ddp")
    for c in contenders:
        if c.name == "ddp" or not c.trains_like_ddp:
            continue
        rel = float("nan") if ref is None else abs(losses[c.name][1] - ref[1]) / max(abs(ref[1]), 1e-30)
        rel_t = torch.tensor([rel], dtype=torch.float64)  # parity report, once per contender (CPU)
        dist.all_reduce(rel_t, op=dist.ReduceOp.MAX)
        worst = rel_t.item()  # the one read of it: a CPU tensor, outside the timed steps
        c.parity_rel = None if ref is None else worst
        if dist.get_rank() != 0:
            continue
        if ref is None:
            print(f"note: ddp not selected, no parity check for {c.name}")
        elif c.lossy:
            print(f"parity (lossy): {c.name} loss at step 1 differs from ddp by {worst:.1e}")
        elif not worst <= PARITY_RTOL:
            print(f"WARNING: {c.name} loss at step 1 differs from ddp by {worst:.2e} relative (> {PARITY_RTOL:g})")
        else:
            print(f"parity ok: {c.name} loss at step 1 within {worst:.1e} of ddp")


def warm_up_and_account(contenders: list[Contender]) -> None:
    """Steps 0 to 2 of every contender: the parity check on step 1's loss, state bytes taken
    while step 2's gradients live (PowerSGD allocates its error feedback at its first
    compressed step, 2)."""
    losses: dict[str, list[float]] = {}
    for c in contenders:
        # warm-up, once per contender, outside the timed steps: the loss read syncs on purpose
        losses[c.name] = [c.step().item(), c.step().item()]

        def account(c: Contender = c) -> None:
            c.state_bytes = c.state_fn() if c.state_fn else state_bytes(c.model, c.opt)

        c.step(account)
    state = torch.tensor([c.state_bytes for c in contenders], dtype=torch.int64)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    for c, b in zip(contenders, state.tolist(), strict=True):
        c.state_bytes = b
    check_parity(contenders, losses)


def run_segment(c: Contender, num_steps: int) -> None:
    """One contender's turn in a round: warm-up, then timed steps."""
    for _ in range(WARMUP_STEPS):
        c.step()
    times, exposed = [], []
    for _ in range(num_steps):
        dist.barrier()
        t0 = time.perf_counter()
        c.step()
        times.append((time.perf_counter() - t0) * 1e3)
        if c.exposed_comm_ms is not None:
            exposed.append(c.exposed_comm_ms())
    times_t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(times_t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
    c.step_ms.append(times_t.tolist())
    if exposed:
        exposed_t = torch.tensor(exposed, dtype=torch.float64)
        dist.all_reduce(exposed_t)
        c.exposed_ms.extend((exposed_t / dist.get_world_size()).tolist())
    if c.overlap_efficiency is not None:
        eff = torch.tensor([c.overlap_efficiency()], dtype=torch.float64)
        dist.all_reduce(eff)  # NaN on any rank stays NaN: then nothing is recorded
        if not torch.isnan(eff).item():
            c.efficiency.append(float(eff) / dist.get_world_size())


def set_up_rank(cfg: StepBenchConfig) -> None:
    torch.set_num_threads(cfg.threads)
    # [Note: one allocator setting for all] overlap.wrap on CPU raises glibc's mmap/trim
    # thresholds (OverlapConfig.cpu_keep_freed_memory), which is process-wide; every contender
    # lives in this process, so apply it up front to all of them (order-independent and fair),
    # or to none with --no-keep-freed-memory.
    if cfg.keep_freed_memory:
        from overlap.transport.host import keep_freed_cpu_memory

        keep_freed_cpu_memory()


def step_rank(rank: int, world_size: int, cfg: StepBenchConfig) -> StepReport | None:
    """The comparison on one rank (all ranks call it); rank 0 returns the report."""
    from tqdm import tqdm

    set_up_rank(cfg)
    contenders = build_contenders(cfg, make_batch(cfg, rank))
    warm_up_and_account(contenders)
    bar = tqdm(
        total=cfg.rounds * len(contenders),
        desc=f"bench step {cfg.model} n={world_size}",
        unit="segment",
        disable=rank != 0,
        leave=False,
    )
    for r in range(cfg.rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            bar.set_postfix_str(f"round {r} {c.name}")
            run_segment(c, cfg.steps)
            bar.update()
    bar.close()
    if rank != 0:
        return None
    return summarize(cfg, world_size, contenders)


def peak_rank(rank: int, world_size: int, cfg: StepBenchConfig, name: str) -> tuple[int, int]:
    """Contender `name` alone in this fresh process: warm-up steps plus one. Returns the largest
    rank's lifetime peak RSS and the largest rank's peak above the RSS it had just before the
    contender was built (its packages already imported): what training adds."""
    set_up_rank(cfg)
    peers.import_requirements(name, train_setup(cfg).device)
    base = rss_bytes()
    c = build_contender(cfg, make_batch(cfg, rank), name)
    for _ in range(WARMUP_STEPS + 1):
        c.step()
    peak = process_peak_rss_bytes()
    both = torch.tensor([peak, peak - base], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return int(both[0]), int(both[1])
