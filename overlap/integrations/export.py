"""Whole-model exports of a wrapped model through a framework's own save calls.

[Note: gathered exports]
A wrapped model's `state_dict()` holds DTensor shards, which `safetensors` cannot write (the
"invalid python storage" error) and a plain model cannot load. Every export route therefore
gathers the full state dict with `overlap.full_state_dict`, a collective: every rank calls it,
rank 0 gets the whole model on CPU and the others an empty dict, which writes nothing (the
frameworks write from rank 0 only: transformers' `save_pretrained` checks the torch.distributed
rank itself, accelerate's `save` the main process). Where a framework writes once per node
(`save_on_each_node`), every rank gathers the whole model instead. Called on rank 0 alone (inside
`if accelerator.is_main_process:`), the gather waits for ranks that never come, until the
collective timeout: call the export on every rank, as under FSDP.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor

import overlap
from overlap.integrations import is_wrapped


def gathered_state_dict(model: nn.Module, every_rank: bool = False) -> dict[str, Any]:
    """The whole state dict of the wrapped `model` on rank 0 ({} elsewhere), or on every rank
    with `every_rank`. Collective ([Note: gathered exports])."""
    return overlap.full_state_dict(model, rank0_only=not every_rank)


def gather_on_save_pretrained(model: nn.Module) -> None:
    """Make `model.save_pretrained(dir, ...)` of a wrapped Hugging Face model write the whole model:
    without `state_dict` it gathers one (collective: call it on every rank); a `state_dict` still
    holding shards (`model.state_dict()`) is refused at once. A no-op for other models, and when
    already installed."""
    original = getattr(model, "save_pretrained", None)
    if not is_wrapped(model) or original is None or getattr(original, "gathers_state_dict", False):
        return

    @functools.wraps(original)
    def save_pretrained(
        save_directory: Any, *args: Any, state_dict: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        if state_dict is None:
            state_dict = gathered_state_dict(model)
        elif any(isinstance(value, DTensor) for value in state_dict.values()):
            raise ValueError(
                "save_pretrained: state_dict holds the DTensor shards of a model wrapped by "
                "overlap.wrap (model.state_dict()); pass the gathered one, on every rank: "
                "state_dict=overlap.full_state_dict(model) (accelerate: accelerator.get_state_dict(model)), "
                "or no state_dict"
            )
        return original(save_directory, *args, state_dict=state_dict, **kwargs)

    save_pretrained.gathers_state_dict = True  # type: ignore[attr-defined]
    model.save_pretrained = save_pretrained  # an instance attribute: the class is untouched


__all__ = ["gather_on_save_pretrained", "gathered_state_dict"]
