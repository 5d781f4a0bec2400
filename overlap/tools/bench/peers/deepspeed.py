"""The DeepSpeed ZeRO-3 peers of the benchmarks: deepspeed and deepspeed-tuned.

The package's docstring (overlap/tools/bench/peers/__init__.py) holds [Note: DeepSpeed ZeRO-3 configs].
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlap.tools.bench.peers.trainer import Trainer, TrainSetup, storage_bytes

DEEPSPEED_QUIET_STEPS = 10**9
"""`steps_per_print`: DeepSpeed's periodic log line, never in a benchmark."""


def deepspeed_config(name: str, setup: TrainSetup) -> dict[str, Any]:
    """The DeepSpeed config of contender `name` ([Note: DeepSpeed ZeRO-3 configs])."""
    zero: dict[str, Any] = {"stage": 3}
    if name == "deepspeed-tuned":
        h = setup.hidden_size
        zero |= {
            "overlap_comm": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
        }
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": setup.micro_batch,
        "zero_optimization": zero,
        "steps_per_print": DEEPSPEED_QUIET_STEPS,
    }
    if setup.max_grad_norm is not None:
        config["gradient_clipping"] = setup.max_grad_norm
    return config


def import_deepspeed(device: torch.device) -> Any:
    """deepspeed, imported for `device` and joined to the default process group."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    # A spawned local world has no LOCAL_RANK (torchrun and the link launcher set it); every
    # rank of such a world is on this machine, so its local rank is its rank.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    # DeepSpeed calls torch's deprecated collective names (all_gather_into_tensor,
    # reduce_scatter_tensor) on every step, and the FutureWarning would repeat each time.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    backend = dist.get_backend()
    deepspeed.init_distributed(dist_backend=backend)  # reuses the initialized default group
    return deepspeed


def deepspeed_trainer(name: str, model: nn.Module, setup: TrainSetup) -> Trainer:
    """DeepSpeed ZeRO-3 around `model`; its engine runs backward, clipping, step and zeroing."""
    deepspeed = import_deepspeed(setup.device)
    opt = setup.make_optimizer(model.parameters())
    config = deepspeed_config(name, setup)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    zero_opt = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3 around `opt`

    def state() -> int:
        """Partitions (persisted small parameters are whole), the flat fp32 partitions the
        optimizer updates (the same storage as the partitions in fp32), the gradient partitions
        and AdamW's moments."""
        params = list(engine.module.parameters())
        tensors: list[torch.Tensor | None] = [p.ds_tensor for p in params] + [p.data for p in params]
        tensors += zero_opt.fp32_partitioned_groups_flat
        tensors.append(zero_opt.grad_partitions_flat_buffer)
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return storage_bytes(tensors)

    return Trainer(
        name=name,
        model=engine,
        optimizer=opt,
        backward=engine.backward,
        step=engine.step,  # clips (config "gradient_clipping"), steps, zeroes the gradients
        zero_grad=lambda: None,
        state_bytes=state,
        settings={"deepspeed": deepspeed.__version__, **config["zero_optimization"]},
    )
