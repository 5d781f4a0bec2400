"""Resuming a sharded model from a checkpoint that a framework wrote under DDP: its whole weights
(`load_full_weights`) and its optimizer (`load_full_optimizer_state_dict`).

[Note: a DDP optimizer state dict]
Under DDP a framework saves `optimizer.state_dict()` of an optimizer over whole parameters (the
HF Trainer's `optimizer.pt`, accelerate's `optimizer.bin`; Lightning re-keys its own
`optimizer_states` by name): full tensors, each parameter's state keyed by its position in the
param groups. `Optimizer.load_state_dict` maps those positions onto
the resumed optimizer's, which therefore must be built the same way (same groups, same order):
DDP's own assumption, and the Trainer's. `load_full_optimizer_state_dict` makes the same mapping
for the sharded optimizer: position i becomes the name of the resumed optimizer's parameter at
position i, every state tensor is checked against that parameter's full shape, and
`set_optimizer_state_dict(full_state_dict=True)` keeps each rank's rows of every tensor (and the
hyperparameters of each group, the learning rate the scheduler set included); a parameter
without saved state is left without state, as `Optimizer.load_state_dict` leaves it. Every rank reads
the file, as under DDP (memory-mapped); the ranks agree that every one of them read and matched it
before any rank loads, so a missing file or a mismatch raises on every rank, naming the rank.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

import overlap

SAFE_WEIGHTS = "model.safetensors"  # what save_pretrained / accelerate's save_state write
SAFE_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = "pytorch_model.bin"  # either with safe_serialization=False


def load_full_weights(model: nn.Module, folder: Path, where: str) -> None:
    """The weights file(s) of `folder` (`read_full_weights`), read on rank 0 and scattered into the
    wrapped `model` by `overlap.load_full_state_dict`; a key the file lacks is kept, with a
    warning (a tied weight is saved once: the HF Trainer loads with strict=False too). A file
    that rank 0 cannot read raises on every rank. Collective."""
    full, error = None, [None]
    if dist.get_rank() == 0:
        try:
            full = read_full_weights(folder)
        except Exception as e:  # every rank must hear of it, or they would wait
            error[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ValueError(f"{where}: cannot load the weights (on rank 0: {error[0]})")
    if full is not None:
        missing = sorted(set(model.state_dict()) - set(full))
        if missing:
            warnings.warn(f"{where}: no weights for {missing}", stacklevel=2)
    overlap.load_full_state_dict(model, full, strict=False)


def read_full_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The whole state dict in `folder`: `model.safetensors`, its sharded index, or `pytorch_model.bin`."""
    from safetensors.torch import load_file

    if (folder / SAFE_WEIGHTS).is_file():
        return load_file(folder / SAFE_WEIGHTS)
    if (folder / SAFE_INDEX).is_file():
        files = sorted(set(json.loads((folder / SAFE_INDEX).read_text())["weight_map"].values()))
        full: dict[str, torch.Tensor] = {}
        for name in files:
            full.update(load_file(folder / name))
        return full
    if (folder / PICKLED_WEIGHTS).is_file():
        return torch.load(folder / PICKLED_WEIGHTS, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{folder} holds none of {SAFE_WEIGHTS}, {SAFE_INDEX}, {PICKLED_WEIGHTS}")


def read_pickled(path: Path) -> Any:
    """A state dict a framework saved with `torch.save` (tensors and plain values only)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, where: str) -> None:
    """Load the full, position-keyed optimizer state dict saved at `path` (read on every rank)
    into the optimizer of the wrapped `model` ([Note: a DDP optimizer state dict]). Collective."""
    named: dict[str, Any] | None = None
    error: str | None = None
    try:
        named = _by_name(read_pickled(path), model, optimizer)
    except Exception as e:  # any failure to read or match: every rank must hear of it
        error = f"{type(e).__name__}: {e}"
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, first = failed[0]
        raise ValueError(f"{where}: cannot load the optimizer state (on rank {rank}: {first})")
    assert named is not None, f"rank {dist.get_rank()}: no error and no state"
    # strict=False: a parameter may have no saved state (no gradient yet when it was saved);
    # _by_name has checked the groups. set_optimizer_state_dict first creates every parameter's
    # state by a step with lr 0; a parameter without saved state has none after
    # Optimizer.load_state_dict, and must not start with a step count of 1 here
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True, strict=False))
    for name, param in model.named_parameters():
        if name not in named["state"]:
            optimizer.state.pop(param, None)


def _by_name(saved: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`saved` (position-keyed) re-keyed by the names of `optimizer`'s parameters at those positions."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"the saved optimizer has param groups of {saved_sizes} parameters, this one {sizes}: "
            "build the optimizer as the saved run did (same groups, same order)"
        )
    state: dict[str, Any] = {}
    param_groups: list[dict[str, Any]] = []
    for group, saved_group in zip(groups, saved_groups):
        fqns = []
        for param, position in zip(group["params"], saved_group["params"]):
            name = names.get(id(param))
            if name is None:
                raise ValueError("the optimizer holds a parameter that is not the model's")
            entry = saved["state"].get(position)
            if entry is not None:
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                        raise ValueError(
                            f"the saved state {key!r} of parameter {position} has shape {tuple(value.shape)}, "
                            f"the parameter at that position ({name}) {tuple(param.shape)}: build the "
                            "optimizer as the saved run did (same groups, same order)"
                        )
                state[name] = entry
            fqns.append(name)
        param_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": param_groups}


__all__ = ["load_full_optimizer_state_dict", "load_full_weights", "read_full_weights", "read_pickled"]
