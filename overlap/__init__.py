"""overlap: sharded data parallel (FSDP / ZeRO-3) for PyTorch that hides its communication.

model = overlap.wrap(model)            # parameters, gradients, optimizer state sharded 1/N
opt = torch.optim.AdamW(model.parameters())
"""

from overlap import checkpoint
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
