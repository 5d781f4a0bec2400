"""Training frameworks driving a model wrapped by `overlap.wrap`, one module per framework.

    overlap.integrations.hf          OverlapTrainer: Hugging Face `Trainer` (extra `hf` + `integrations`)
    overlap.integrations.lightning   OverlapStrategy (Trainer), OverlapFabricStrategy (Fabric)
    overlap.integrations.accelerate  prepare / save_state / load_state around an `Accelerator`
    overlap.integrations.pipelining PipelineStage: torch.distributed.pipelining, reducing once per step
    overlap.integrations.torchtitan  use_overlap: torchtitan's Trainer with overlap as its data-parallel
                                     step (extra `torchtitan`; torchtitan imported when called)

and two modules shared by them, which import no framework:

    overlap.integrations.export      whole-model exports through the frameworks' own save calls
    overlap.integrations.resume      a DDP run's weights file and optimizer state dict into the shards

Each framework module imports its framework at import time; this package imports none of them, so
`import overlap` works without any framework installed. What every framework gets wrong with a
sharded model out of the box is the same three things, handled in each module:
- It wraps the model in DDP (accelerate, Trainer) or expects FSDP's own classes (Lightning's
  gradient-accumulation switch): the model must be left as `overlap.wrap` returned it.
- It builds the optimizer before the model is sharded (Trainer with `optimizers=`, scripts):
  the optimizer must hold the wrapped model's shards (`check_optimizer`).
- It saves state from rank 0 only (a pickled optimizer state dict): the shards of the other
  ranks would be lost, so checkpoints go through `overlap.checkpoint` (DCP, every rank writes
  its own rows) and whole-model exports through `overlap.full_state_dict` (export.py).
And one thing the user can get wrong: on CPU, launched by torchrun without the framework's CPU
switch, each framework sees a world of one process (no data sharding, no averaging of its own)
while `overlap.wrap` shards over the whole process group. `check_process_count` refuses that.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn


def is_wrapped(module: nn.Module) -> bool:
    """Whether `module` itself was returned by `overlap.wrap` (for an idempotent setup hook, such
    as Lightning's `configure_model`, which runs again for every fit / validate / test)."""
    return getattr(module, "_overlap_state", None) is not None


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, where: str) -> None:
    """Raise (on every rank: each checks its own optimizer, no collective) when `optimizer` holds a
    parameter that `model`, wrapped by `overlap.wrap`, does not have: an optimizer built before
    the wrap holds the replaced full parameters and would never train them. The step pre-hook in
    overlap/engine/guard.py raises at the first `step()` too; this names the framework call instead."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's / Lightning's wrappers
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
    if foreign:
        raise ValueError(
            f"{where}: the optimizer holds {foreign} parameter(s) that are not the wrapped model's "
            "(it was built before overlap.wrap, from the unsharded model, and would never train "
            "them); build it after the wrap: opt = torch.optim.AdamW(model.parameters(), ...)"
        )


def check_process_count(num_processes: int, where: str, switch: str) -> None:
    """Raise (on every rank: each compares two numbers every rank sees alike, no collective) when
    the framework runs `num_processes` processes and the default process group (or, before there
    is one, the launcher's WORLD_SIZE) holds another number: the framework would neither shard
    the data nor reduce anything over the ranks that `overlap.wrap` shards the model over.
    `switch` names the framework's setting that fixes it."""
    # before the group exists: the launcher's count (torchrun's WORLD_SIZE), which the group will have
    launched = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", num_processes))
    if launched == num_processes:
        return
    raise ValueError(
        f"{where}: the framework runs {num_processes} process(es), the launched world "
        f"{launched}: each rank would train on its own data as a world of {num_processes} while "
        f"overlap.wrap shards over all {launched}. On CPU, set {switch}; elsewhere, launch every "
        "rank through the framework (torchrun, as for DDP)"
    )


__all__ = ["check_optimizer", "check_process_count", "is_wrapped"]
