"""Training frameworks driving a model wrapped by `overlap.wrap`, one module per framework.

    overlap.integrations.hf          OverlapTrainer: Hugging Face `Trainer` (extra `hf` + `integrations`)
    overlap.integrations.lightning   OverlapStrategy (Trainer), OverlapFabricStrategy (Fabric)
    overlap.integrations.accelerate  prepare / save_state / load_state around an `Accelerator`

Each module imports its framework at import time; this package imports none of them, so
`import overlap` works without any framework installed. What every framework gets wrong with a
sharded model out of the box is the same three things, handled in each module:
- It wraps the model in DDP (accelerate, Trainer) or expects FSDP's own classes (Lightning's
  gradient-accumulation switch): the model must be left as `overlap.wrap` returned it.
- It builds the optimizer before the model is sharded (Trainer with `optimizers=`, scripts):
  the optimizer must hold the wrapped model's shards (`check_optimizer`).
- It saves state from rank 0 only (a pickled optimizer state dict): the shards of the other
  ranks would be lost, so checkpoints go through `overlap.checkpoint` (DCP, every rank writes
  its own rows) and whole-model exports through `overlap.full_state_dict`.
"""

from __future__ import annotations

import torch
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


__all__ = ["check_optimizer", "is_wrapped"]
