"""The collectives a world's timing loops issue, and how many times a timed case runs.

torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning on every
call) in favour of the *_single names; torch 2.11 has only the old ones.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def iters_for(num_bytes: int, iters: int, warmup: int, budget_bytes: int) -> tuple[int, int]:
    """(iters, warmup) for one case: big sizes run fewer, so one case moves about
    `budget_bytes` (at least 2 timed iterations and 1 warm-up)."""
    scaled = max(2, min(iters, budget_bytes // max(num_bytes, 1)))
    return scaled, max(1, min(warmup, scaled // 2))
