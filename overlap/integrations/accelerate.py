"""Hugging Face accelerate with a model sharded by `overlap.wrap` (plain multi-CPU / multi-GPU).

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model = overlap.wrap(model)                          # before the optimizer
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer, dataloader, scheduler = overlap.integrations.accelerate.prepare(
        accelerator, model, optimizer, dataloader, scheduler)   # was: accelerator.prepare(...)
    for batch in dataloader:
        with accelerator.accumulate(model):              # unchanged: enters model.no_sync()
            accelerator.backward(model(**batch).loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    save_state(accelerator, "ckpt", model, optimizer, scheduler, step=n)   # was: accelerator.save_state
    load_state(accelerator, "ckpt", model, optimizer, scheduler)           # was: accelerator.load_state

[Note: accelerate seams]
accelerate has no backend registry: `accelerator.prepare(model)` puts any trainable model in
DDP (multi-CPU) or refuses DTensor parameters (multi-GPU). `prepare` registers the wrapped model
with `accelerator.prepare_model(model, evaluation_mode=True)` instead, which applies autocast
(`mixed_precision="bf16"`) and leaves the model as it is, then prepares the other objects as
usual. Everything else is accelerate's own: `accumulate` enters the model's `no_sync()`,
`clip_grad_norm_` takes the global norm over the DTensor gradients, the prepared optimizer skips
its step on accumulation micro-batches.

`accelerator.save_state` writes the optimizer's state dict from the main process only, which
holds rank 0's shards alone (and every rank would load rank 0's shards back); it also cannot
write the model's DTensor shards to safetensors. `prepare` therefore registers save/load
pre-hooks that refuse `accelerator.save_state` / `load_state` for a wrapped model on every rank,
naming `save_state` / `load_state` here: `overlap.checkpoint` (DCP, each rank writes its own
rows) for the model, optimizer, scheduler and each rank's random generators, plus the
accelerator's micro-batch counter and the objects registered with
`accelerator.register_for_checkpointing` (their `state_dict()` on rank 0, as accelerate saves
them; restored in place, in registration order). An fp16 GradScaler and the data loaders'
positions are not saved by it (bf16 needs no scaler; resume the data from `extra`).

Exports: `accelerator.get_state_dict(model)` returns DDP's `model.state_dict()`, DTensor shards
here. `prepare` replaces the accelerator's `get_state_dict` (an instance attribute; accelerate
has no hook for it) by one that gathers the whole model for a wrapped model ([Note: gathered
exports] in export.py), which `accelerator.save_model` calls as well, and makes the wrapped
model's `save_pretrained` gather when it is given no state dict: all three write the whole model
from rank 0, every rank taking part in the gather, so call them on every rank.

A folder that `accelerator.save_state` wrote under DDP (`model.safetensors`, `optimizer.bin`,
`scheduler.bin`, `random_states_<rank>.pkl`, `custom_checkpoint_<i>.pkl`) is read by `load_state`
here as accelerate reads it: the weights on rank 0, scattered; the full optimizer state dict into
the shards ([Note: a DDP optimizer state dict] in resume.py); the scheduler, the random
generators, `accelerator.step`, the data samplers' state and the registered objects by
accelerate's own `load_accelerator_state` / `load_custom_state`. One written under FSDP is refused.

On CPU, `Accelerator()` without `cpu=True` under torchrun runs each rank as a world of one
process: `prepare` refuses it (`check_process_count`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import accelerate
import torch
import torch.nn as nn
from accelerate.checkpointing import load_accelerator_state, load_custom_state
from torch.utils.weak import WeakIdKeyDictionary

from overlap import checkpoint
from overlap.integrations import check_optimizer, check_process_count, is_wrapped
from overlap.integrations.export import gather_on_save_pretrained, gathered_state_dict
from overlap.integrations.resume import (
    PICKLED_WEIGHTS,
    SAFE_WEIGHTS,
    load_full_optimizer_state_dict,
    load_full_weights,
    read_pickled,
)

_hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()  # accelerators whose save/load are guarded
_DDP_OPTIMIZER = "optimizer.bin"  # accelerate's names in a save_state folder
_DDP_SCHEDULER = "scheduler.bin"
_FSDP_MODEL = "pytorch_model_fsdp"


def prepare(accelerator: accelerate.Accelerator, model: nn.Module, *objects: Any) -> tuple[Any, ...]:
    """`accelerator.prepare(model, *objects)` for a model wrapped by `overlap.wrap`: the model is
    registered but not put in DDP (see [Note: accelerate seams]); optimizers, data loaders and
    schedulers are prepared by accelerate. Returns (model, *prepared objects) in the same order.
    An optimizer must hold the wrapped model's parameters (build it after the wrap)."""
    if not is_wrapped(model):
        raise ValueError(
            "overlap.integrations.accelerate.prepare: the model is not wrapped; call "
            "model = overlap.wrap(model) first (then build the optimizer from it)"
        )
    check_process_count(accelerator.num_processes, "overlap.integrations.accelerate.prepare", "Accelerator(cpu=True)")
    for obj in objects:
        if isinstance(obj, nn.Module):
            raise ValueError(
                "overlap.integrations.accelerate.prepare: pass one wrapped model; prepare other "
                "models with accelerator.prepare"
            )
        if isinstance(obj, torch.optim.Optimizer):
            check_optimizer(obj, model, "overlap.integrations.accelerate.prepare")
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    _hook(accelerator)
    gather_on_save_pretrained(model)
    if not objects:
        return (model,)
    prepared = accelerator.prepare(*objects)
    return (model, *(prepared if len(objects) > 1 else (prepared,)))


def save_state(
    accelerator: accelerate.Accelerator,
    output_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any | None = None,
    scheduler: Any | None = None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save a checkpoint as `output_dir/step_<step>` through `overlap.checkpoint.save` (every
    rank calls it): the wrapped model, the optimizer and scheduler (prepared or not), every
    rank's random generators, `accelerator.step`, the objects registered with
    `accelerator.register_for_checkpointing` and `extra`. Returns the checkpoint folder."""
    registered = [obj.state_dict() for obj in accelerator._custom_objects]  # accelerate's own list
    return checkpoint.save(
        output_dir,
        model,
        _inner(optimizer, "optimizer"),
        step=step,
        scheduler=_inner(scheduler, "scheduler"),
        extra={"accelerate_step": accelerator.step, "registered": registered, "user": extra},
    )


def load_state(
    accelerator: accelerate.Accelerator,
    input_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any | None = None,
    scheduler: Any | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by `save_state` (`input_dir` is a checkpoint folder or the root
    holding it: the latest is taken) into the wrapped model, optimizer and scheduler, in place,
    at any world size. Restores `accelerator.step` and, in place, the objects registered with
    `accelerator.register_for_checkpointing` (as many as were saved, in the same order). Returns
    `overlap.checkpoint.load`'s dict, with `extra` the `extra` given to `save_state`.

    `input_dir` may also be a folder that `accelerator.save_state` wrote under DDP (see the module
    note); then `step`, `extra`, `world_size` and `rank_extra` are None."""
    folder = Path(input_dir)
    if any(folder.glob(f"{_FSDP_MODEL}*")):  # every rank sees the same folder: every rank raises
        raise ValueError(
            f"overlap.integrations.accelerate.load_state: {folder} was saved under FSDP, which this "
            f"integration does not read; merge its weights (accelerate merge-weights {folder}/"
            f"{_FSDP_MODEL}_0 <dir>) and load them with overlap.load_full_state_dict, with a new optimizer"
        )
    if (folder / SAFE_WEIGHTS).is_file() or (folder / PICKLED_WEIGHTS).is_file():
        return _load_ddp_state(accelerator, folder, model, optimizer, scheduler)
    info = checkpoint.load(input_dir, model, _inner(optimizer, "optimizer"), scheduler=_inner(scheduler, "scheduler"))
    saved = info["extra"]
    registered = saved.get("registered", [])  # a checkpoint of an earlier release has none
    objects = accelerator._custom_objects
    if len(registered) != len(objects):  # the same on every rank: every rank raises
        raise ValueError(
            f"overlap.integrations.accelerate.load_state: the checkpoint holds {len(registered)} object(s) "
            f"registered with accelerator.register_for_checkpointing, this accelerator has {len(objects)}; "
            "register the same objects, in the same order, before load_state"
        )
    for obj, state in zip(objects, registered):
        obj.load_state_dict(state)
    accelerator.step = saved["accelerate_step"]
    return {**info, "extra": saved["user"]}


def _load_ddp_state(
    accelerator: accelerate.Accelerator, folder: Path, model: nn.Module, optimizer: Any | None, scheduler: Any | None
) -> dict[str, Any]:
    """`accelerator.load_state(folder)` of a DDP save, into the wrapped model (see the module note)."""
    where = f"overlap.integrations.accelerate.load_state({folder})"
    load_full_weights(model, folder, where)
    if optimizer is not None:
        load_full_optimizer_state_dict(model, _inner(optimizer, "optimizer"), folder / _DDP_OPTIMIZER, where)
    if scheduler is not None:
        _inner(scheduler, "scheduler").load_state_dict(read_pickled(folder / _DDP_SCHEDULER))
    override = load_accelerator_state(str(folder), [], [], [], accelerator._dataloaders, accelerator.process_index)
    registered = sorted(folder.glob("custom_checkpoint_*.pkl"))
    if len(registered) != len(accelerator._custom_objects):  # the same on every rank
        raise ValueError(
            f"{where}: the folder holds {len(registered)} object(s) registered with "
            f"accelerator.register_for_checkpointing, this accelerator has {len(accelerator._custom_objects)}"
        )
    for index, obj in enumerate(accelerator._custom_objects):
        load_custom_state(obj, str(folder), index)
    accelerator.step = override.get("step", accelerator.step)
    restored = (folder / f"random_states_{accelerator.process_index}.pkl").is_file()
    return {"step": None, "extra": None, "world_size": None, "rank_extra": None, "rank_restored": restored}


def _inner(obj: Any | None, attr: str) -> Any | None:
    """The optimizer / scheduler inside accelerate's AcceleratedOptimizer / AcceleratedScheduler."""
    return getattr(obj, attr, obj) if obj is not None else None


def _hook(accelerator: accelerate.Accelerator) -> None:
    """Refuse accelerate's save_state / load_state and gather in get_state_dict (module note)."""
    if accelerator in _hooked:
        return
    accelerator.register_save_state_pre_hook(_refuse_save)
    accelerator.register_load_state_pre_hook(_refuse_load)
    original = accelerator.get_state_dict

    def get_state_dict(model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        inner = accelerator.unwrap_model(model) if unwrap else model
        if not is_wrapped(inner):
            return original(model, unwrap=unwrap)
        return gathered_state_dict(inner, every_rank=accelerator.project_configuration.save_on_each_node)

    accelerator.get_state_dict = get_state_dict  # type: ignore[method-assign]
    _hooked[accelerator] = True


def _refuse(models: list[nn.Module], verb: str) -> None:
    if any(is_wrapped(m) for m in models):
        raise ValueError(
            f"accelerator.{verb}_state cannot {verb} a model wrapped by overlap.wrap: it keeps the "
            "optimizer state of rank 0 only. Use overlap.integrations.accelerate."
            f"{verb}_state(accelerator, dir, model, optimizer, scheduler{', step=...' if verb == 'save' else ''})"
        )


def _refuse_save(models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
    _refuse(models, "save")


def _refuse_load(models: list[nn.Module], input_dir: str) -> None:
    _refuse(models, "load")


__all__ = ["load_state", "prepare", "save_state"]
