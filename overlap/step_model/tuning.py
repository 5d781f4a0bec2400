"""What autotune and the step model say to each other: the knobs a step runs (and is simulated)
under, what a window of steps measured, what the model proposes, and what the model knows of a
wrapped model. Pure data; the policy (overlap/engine/autotune_policy.py) and the online fit
(online.py) both speak it, so it sits below both.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PREFETCH_DEPTH = 4
"""The deepest prefetch the tuner tries and the model's grid covers ([Note: autotune] in
overlap/engine/autotune_policy.py)."""
MAX_REDUCE_INPUTS = 3
"""The most reduce-scatter inputs alive at once that the tuner tries and the model's grid covers."""


@dataclass(frozen=True)
class Knobs:
    """The schedule settings the tuner moves, each named as its OverlapConfig field (and the
    engine's ScheduleConfig): one name per knob from the config down to the tuner's log."""

    prefetch_depth: int
    max_inflight_allgather_bytes: int | None
    reduce_scatter_bucket_bytes: int
    keep_for_backward_bytes: int
    max_reduce_inputs: int


@dataclass(frozen=True)
class Measurement:
    """One trial step as every rank saw it: the slowest rank's step time, the most exposed
    all-gather and reduce-scatter wait of any rank, the highest library memory peak (its own
    account, that step) and the highest measured peak of any rank (the allocator's or the
    process's high-water mark so far: [Note: autotune memory] in
    overlap/engine/autotune_memory.py)."""

    step_ms: float
    gather_wait_ms: float
    reduce_wait_ms: float
    memory_peak_bytes: int
    device_peak_bytes: int = 0


@dataclass(frozen=True)
class Proposal:
    """A setting the model predicts faster than the baseline's: what it costs in memory above
    the baseline's and why (logged with the trial)."""

    knobs: Knobs
    predicted_ms: float
    baseline_predicted_ms: float
    extra_bytes: int
    reason: str = ""


@dataclass(frozen=True)
class TunerView:
    """What the step model knows of a wrapped model and its world: the same on every rank."""

    unit_bytes: tuple[int, ...]
    """Unsharded bytes of each unit in the gather dtype, by unit index."""
    grad_bytes: tuple[int, ...]
    forward_order: tuple[int, ...]
    """The units in the order the first step's forward ran them."""
    root: int | None
    reshard_after_forward: bool
    backend: str  # "nccl" or "gloo"
    num_ranks: int  # of the shard group
    num_replicas: int  # HSDP replicas (1: none)
    tune_buckets: bool  # whether the tuner may move the bucket size
    calibration: str | None = None
    """The file the model starts from (`OverlapConfig.autotune_calibration`); None: defaults."""
    folder: str | None = None
    """Where the fitted model is written (`calibration.json`); None: nowhere (ranks but 0)."""
    shared_memory: bool = False
    """The shard group exchanges through shared memory (`Strategy.through_shared_memory`)."""
