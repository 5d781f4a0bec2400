"""`overlap demo`'s config (`DemoConfig`) and what rank 0 reports (`DemoResult`).

The package's docstring (overlap/tools/demo/__init__.py) holds [Note: demo resume].
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from overlap.compression import GRAD_CODECS, PARAM_CODECS
from overlap.tools.flags import flag

Engine = Literal["overlap", "ddp"]


DEFAULT_SAVE_EVERY = 50

KNOBS = "engine knobs (overlap.wrap overrides)"
CHECKPOINTS = "checkpoints (resume after a crash)"


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run. Defaults take about two minutes on two CPU cores and end near loss 2.1."""

    steps: int = 200
    """Training steps."""
    nproc: int | None = None
    """Ranks of the spawned local world; None: `default_world()` (2 on CPU, all GPUs). Ignored
    under torchrun."""
    layers: int = 4
    """GPT blocks."""
    dim: int = 192
    """Embedding width."""
    heads: int = 6
    block_size: int = 128
    """Tokens (bytes) per sequence."""
    batch_size: int = 16
    """Sequences per rank per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (warm-up, then cosine decay)."""
    seed: int = 0
    """Model initialization and every rank's batch stream."""
    log_every: int = 50
    """Steps between progress lines."""
    eval_batches: int = 8
    """Held-out batches of the validation loss at the end."""
    max_bytes: int = 8 * 1024 * 1024
    """Bytes of stdlib source to train on."""
    engine: Engine = "overlap"
    """"ddp" trains the same model with DistributedDataParallel: the baseline to compare with."""
    prefetch_depth: int | None = field(default=None, metadata=flag(group=KNOBS))
    """Units all-gathered ahead of use. Every engine knob left unset (None) keeps
    `overlap.OverlapConfig`'s default."""
    bucket_bytes: int | None = field(default=None, metadata=flag(group=KNOBS, help="reduce_scatter_bucket_bytes"))
    reshard_after_forward: bool | None = field(
        default=None, metadata=flag(group=KNOBS, const=False, help="keep gathered weights until backward (ZeRO-2)")
    )
    param_compression: str | None = field(
        default=None, metadata=flag(group=KNOBS, choices=[n for n in PARAM_CODECS if n])
    )
    """Codec of the weight all-gather."""
    grad_compression: str | None = field(
        default=None, metadata=flag(group=KNOBS, choices=[n for n in GRAD_CODECS if n])
    )
    """Codec of the gradient reduce-scatter."""
    error_feedback: bool | None = field(
        default=None, metadata=flag(group=KNOBS, const=True, help="with --grad-compression")
    )
    checkpoint_dir: str | None = field(default=None, metadata=flag(group=CHECKPOINTS, metavar="DIR"))
    """Save sharded checkpoints here and resume from the latest one found ([Note: demo resume])."""
    save_every: int | None = field(default=None, metadata=flag(group=CHECKPOINTS, metavar="N"))
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
            warnings.warn("overlap demo: --save-every is ignored without --checkpoint-dir", stacklevel=3)

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
