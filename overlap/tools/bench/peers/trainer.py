"""What every benchmark contender trains with (`TrainSetup`) and the `Trainer` it becomes; the
per-rank state accounting; the plain trainer (autograd backward, the setup's optimizer) and the
DDP wrapper that the baselines and the DDP-hook peers build on.

The package's docstring (overlap/tools/bench/peers/__init__.py) lists the contenders and holds the
[Note: ...] blocks referenced here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from overlap.engine.lazy_torch import is_dtensor


@dataclass(frozen=True, kw_only=True)
class TrainSetup:
    """What every contender shares. The model itself is passed to `build_trainer`, fresh and
    identically initialized for each contender."""

    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    """Builds the optimizer over the parameters it is given (the same AdamW for everyone)."""
    units_of: Callable[[nn.Module], list[nn.Module]]
    """The model's blocks in forward order: FSDP2's `fully_shard` units."""
    micro_batch: int
    """Sequences per rank per step (DeepSpeed's `train_micro_batch_size_per_gpu`)."""
    hidden_size: int
    """The model's width: deepspeed-tuned's bucket sizes ([Note: DeepSpeed ZeRO-3 configs])."""
    max_grad_norm: float | None = None
    """Clip gradients by their global norm before each optimizer step (None: no clipping)."""
    num_replicas: int = 1
    """HSDP: overlap and the fsdp2 contenders shard over world / num_replicas ranks and replicate
    over num_replicas (`data_mesh`); the others ignore it. 1: shard over every rank."""
    powersgd_start_iter: int = 2
    """First iteration PowerSGD compresses ([Note: PowerSGD settings]); must be >= 2."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the model lives; "cuda" also selects DeepSpeed's CUDA accelerator."""

    def __post_init__(self) -> None:
        if min(self.micro_batch, self.hidden_size, self.num_replicas) < 1:
            raise ValueError("TrainSetup: micro_batch, hidden_size and num_replicas must be >= 1")
        if self.powersgd_start_iter < 2:
            raise ValueError(
                f"TrainSetup.powersgd_start_iter={self.powersgd_start_iter}: torch's PowerSGD "
                "needs >= 2 with error feedback and warm start"
            )


@dataclass
class Trainer:
    """A model trained the way one contender trains it. Per step: call `model` for the forward
    (it may be a wrapper: DDP, a DeepSpeed engine), then `backward(loss)`, `step()` (clips when
    the setup asks, then updates) and `zero_grad()`."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    """The torch optimizer `TrainSetup.make_optimizer` built: LR schedulers act on it (also
    under DeepSpeed, which steps it as its inner optimizer)."""
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    zero_grad: Callable[[], None]
    state_bytes: Callable[[], int]
    """Parameters + gradients + optimizer state + communication state (error feedback, PowerSGD
    memories) this rank holds, by accounting; transient buffers (DDP buckets, gathered units,
    DeepSpeed's reduce bucket) excluded."""
    lossy: bool = False
    """Its communication changes the numbers (compression, low precision): not DDP-exact."""
    settings: dict[str, Any] = field(default_factory=dict)
    """What it was configured with beyond its defaults, for the report (JSON-safe)."""


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if is_dtensor(t):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state, per rank (local shards of DTensors)."""
    total = 0
    for p in model.parameters():
        total += local_bytes(p) + local_bytes(p.grad)
    for per_param in opt.state.values():
        total += sum(local_bytes(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return total


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def plain_trainer(
    name: str,
    model: nn.Module,
    setup: TrainSetup,
    clip: Callable[[float], object] | None = None,
    extra_state_bytes: Callable[[], int] = lambda: 0,
    **kw: Any,
) -> Trainer:
    """`model` under the setup's optimizer with autograd's backward; `clip(max_norm)` clips
    (default: torch's clip_grad_norm_ over `model.parameters()`)."""
    opt = setup.make_optimizer(model.parameters())
    clip = clip or (lambda max_norm: nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def step() -> None:
        if setup.max_grad_norm is not None:
            clip(setup.max_grad_norm)
        opt.step()

    return Trainer(
        name=name,
        model=model,
        optimizer=opt,
        backward=torch.Tensor.backward,
        step=step,
        zero_grad=lambda: opt.zero_grad(set_to_none=True),
        state_bytes=lambda: state_bytes(model, opt) + extra_state_bytes(),
        **kw,
    )


def ddp(model: nn.Module, setup: TrainSetup) -> nn.parallel.DistributedDataParallel:
    ids = [setup.device.index] if setup.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)
