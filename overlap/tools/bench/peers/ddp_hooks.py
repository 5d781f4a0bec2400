"""The DDP communication-hook peers of the benchmarks: ddp-bf16, ddp-fp16, ddp-powersgd1 and
ddp-powersgd4 (torch's bf16/fp16 compress hooks and powerSGD_hook).

The package's docstring (overlap/tools/bench/peers/__init__.py) holds [Note: PowerSGD settings].
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlap.tools.bench.peers.trainer import Trainer, TrainSetup, ddp, plain_trainer, storage_bytes

POWERSGD_RANKS = {"ddp-powersgd1": 1, "ddp-powersgd4": 4}


def bf16_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook`, registered under another name.

    [Note: bf16 hook on CPU] DDP.register_comm_hook refuses a hook *named* bf16_compress_hook
    unless torch was built with CUDA and NCCL >= 2.10 (a guard from before gloo reduced bf16);
    torch's gloo backend all-reduces bf16 now, so on CPU we run the same hook through this
    one-line wrapper. (Gloo keeps the running sum in bf16 between hops, as NCCL does.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


# DDP checks a hook's annotations as objects; this module's are strings (future annotations).
bf16_hook.__annotations__ = typing.get_type_hints(bf16_hook)


def serialized_powersgd_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `powerSGD_hook`, waited for before DDP launches the next bucket
    ([Note: PowerSGD settings]: its chained collectives race across buckets on gloo)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    future = psgd.powerSGD_hook(state, bucket)
    future.wait()
    return future


serialized_powersgd_hook.__annotations__ = typing.get_type_hints(serialized_powersgd_hook)


def ddp_hook_trainer(name: str, model: nn.Module, setup: TrainSetup) -> Trainer:
    """DDP with one of torch's communication hooks ([Note: PowerSGD settings])."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    wrapped = ddp(model, setup)
    state: psgd.PowerSGDState | None = None
    settings: dict[str, Any]
    if name == "ddp-bf16":
        wrapped.register_comm_hook(None, bf16_hook)
        settings = {"hook": "bf16_compress_hook"}
    elif name == "ddp-fp16":
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        settings = {"hook": "fp16_compress_hook"}
    else:
        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANKS[name],
            start_powerSGD_iter=setup.powersgd_start_iter,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        wrapped.register_comm_hook(state, serialized_powersgd_hook)
        settings = {
            "hook": "powerSGD_hook (each bucket waited for: [Note: PowerSGD settings])",
            "matrix_approximation_rank": state.matrix_approximation_rank,
            "start_powerSGD_iter": state.start_powerSGD_iter,
            "min_compression_rate": state.min_compression_rate,
            "use_error_feedback": True,
            "warm_start": True,
        }
    return plain_trainer(
        name,
        wrapped,
        setup,
        extra_state_bytes=lambda: 0 if state is None else storage_bytes(powersgd_memory(state)),
        lossy=True,
        settings=settings,
    )


def powersgd_memory(state: Any) -> Iterator[torch.Tensor]:
    """What a PowerSGDState keeps across steps: error feedback and the warm-start P and Q, per
    bucket (allocated at the first compressed step)."""
    for per_bucket in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
        yield from per_bucket.values()
