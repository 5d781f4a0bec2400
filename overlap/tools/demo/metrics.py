"""`overlap demo`'s numbers: per-rank memory by accounting and by the OS, the small cross-rank
gathers, the per-step log and its progress line.

Part of `overlap demo` (overlap/tools/demo/__init__.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.engine.lazy_torch import is_dtensor
from overlap.observe.monitor import rss_bytes
from overlap.tools.demo.config import DemoConfig
from overlap.tools.worlds.launch import current_device


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for `t`: a DTensor shard counts only its local piece."""
    local = t.to_local() if is_dtensor(t) else t
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
        shares = [e / s for e, s in zip(self.exposed_ms[lo:], self.step_ms[lo:], strict=True) if e is not None]
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
