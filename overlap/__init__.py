"""overlap: sharded data parallel (FSDP / ZeRO-3) for PyTorch that hides its communication.

    model = overlap.wrap(model)            # parameters, gradients, optimizer state sharded 1/N
    opt = torch.optim.AdamW(model.parameters())
"""

from overlap import checkpoint
from overlap import comm  # the documented `overlap.comm.CollectiveError` (transport/collectives.py)
from overlap.config import OverlapConfig
from overlap.api import (
    clip_grad_norm_,
    full_state_dict,
    load_full_state_dict,
    memory_stats,
    no_sync,
    step_stats,
    tuned_config,
)
from overlap.amp import ShardedGradScaler
from overlap.transport.fingerprint import CollectiveMismatchError
from overlap.observe.memory import MemoryStats
from overlap.observe.stats import StepStats
from overlap.engine.wrap import wrap
from overlap.engine.autotune_oom import TrialOutOfMemoryError

__all__ = [
    "OverlapConfig",
    "ShardedGradScaler",
    "checkpoint",
    "CollectiveMismatchError",
    "StepStats",
    "TrialOutOfMemoryError",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "MemoryStats",
    "memory_stats",
    "no_sync",
    "step_stats",
    "tuned_config",
    "wrap",
]
__version__ = "0.1.0"
