"""overlap: sharded data parallel (FSDP / ZeRO-3) for PyTorch that hides its communication.

model = overlap.wrap(model)            # parameters, gradients, optimizer state sharded 1/N
opt = torch.optim.AdamW(model.parameters())
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from overlap import comm as comm  # the documented `overlap.comm.CollectiveError` (transport/collectives.py)
from overlap.amp import ShardedGradScaler
from overlap.api import (
    clip_grad_norm_,
    full_state_dict,
    load_full_state_dict,
    memory_stats,
    no_sync,
    step_stats,
    tuned_config,
)
from overlap.config import OverlapConfig
from overlap.engine.autotune_oom import TrialOutOfMemoryError
from overlap.engine.wrap import wrap
from overlap.observe.memory import MemoryStats
from overlap.observe.stats import StepStats
from overlap.transport.fingerprint import CollectiveMismatchError

if TYPE_CHECKING:
    from overlap import checkpoint

__all__ = [
    "CollectiveMismatchError",
    "MemoryStats",
    "OverlapConfig",
    "ShardedGradScaler",
    "StepStats",
    "TrialOutOfMemoryError",
    "checkpoint",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "memory_stats",
    "no_sync",
    "step_stats",
    "tuned_config",
    "wrap",
]
__version__ = "0.1.0"

_LAZY_SUBMODULES = ("checkpoint",)
"""Imported on first access ([Note: import cost] in overlap/engine/lazy_torch.py):
`overlap.checkpoint` loads torch.distributed.checkpoint."""


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"overlap.{name}")  # the import also binds it here
    raise AttributeError(f"module 'overlap' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES})
