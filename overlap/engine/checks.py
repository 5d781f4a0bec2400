"""Wrap-time agreement: every rank wraps the same model with the same config, or all raise."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.config import OverlapConfig
from overlap.engine.schedule import order_hash
from overlap.transport import collectives as comm


def check_same_model(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank must wrap the same structure (parameters, and buffers, which the rank-0 sync
    broadcasts); a mismatch raises on every rank."""
    signature = tuple(
        (name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()
    ) + tuple((name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers())
    hashes = comm.all_gather_int(order_hash(signature), group, device)  # type: ignore[arg-type]
    if len(set(hashes)) != 1:
        raise ValueError(
            "overlap.wrap: the model differs across ranks (parameter or buffer names, shapes, "
            f"dtypes or requires_grad); signature hashes by rank: {hashes}. Build the same model "
            "on every rank."
        )


# Fields that only change what this rank records or how it allocates, never which collectives
# run or in what order: they may differ across ranks (e.g. a per-rank metrics file).
_RANK_LOCAL_FIELDS = frozenset(
    {
        "cpu_keep_freed_memory",
        "collective_timeout_s",
        "trace_dir",
        "metrics_file",
        "alert_exposed_comm_share",
        "alert_collective_slowdown",
        "alert_step_gap_ms",
        "alert_memory_bytes",
    }
)


def _config_signature(config: OverlapConfig) -> dict[str, str]:
    """The fields that decide the collectives, as strings equal on ranks that agree."""

    def describe(value: Any) -> str:
        if isinstance(value, frozenset):  # a unit_policy set of classes
            return repr(sorted(f"{c.__module__}.{c.__qualname__}" for c in value))
        if callable(value) and not isinstance(value, type):  # a unit_policy callable
            return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
        return repr(value)

    return {
        f.name: describe(getattr(config, f.name))
        for f in dataclasses.fields(config)
        if f.name not in _RANK_LOCAL_FIELDS
    }


def check_same_config(config: OverlapConfig, group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank must wrap with the same config (prefetch depth, buckets, dtypes, codecs decide
    the sequence and sizes of the collectives); a mismatch raises on every rank, naming the field."""
    signature = _config_signature(config)
    hashes = comm.all_gather_int(order_hash(tuple(signature.items())), group, device)  # type: ignore[arg-type]
    if len(set(hashes)) == 1:
        return
    # Every rank saw the same hashes, so all take this branch and run the same collectives.
    differing = [
        name
        for name, value in signature.items()
        if len(set(comm.all_gather_int(order_hash((value,)), group, device))) > 1  # type: ignore[arg-type]
    ]
    mine = ", ".join(f"{name}={signature[name]}" for name in differing)
    raise ValueError(
        f"overlap.wrap: the OverlapConfig differs across ranks in {', '.join(differing)} (on rank "
        f"{dist.get_rank(group)}: {mine}); config hashes by rank: {hashes}. Pass the same config "
        "(and keyword overrides) on every rank: these fields decide which collectives run, in "
        "what order and with what sizes. Only rank-local fields may differ: "
        f"{', '.join(sorted(_RANK_LOCAL_FIELDS))}."
    )
