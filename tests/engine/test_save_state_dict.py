"""`torch.save(model.state_dict())` of a wrapped model ([Note: shards with their own storage] in
overlap/engine/sharding.py): each rank saves its DTensor shards, the file holds each parameter's bytes (not
its unit's whole flat buffer once per parameter), `torch.load` (weights_only) gives the same
local shards, and `load_state_dict` of them writes into the flat buffers the engine gathers."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from helpers.models import batch, loss_of, tiny_lm
from test_mixed_dtypes import mixed_lm
from torch.distributed.tensor import DTensor

import overlap

# pickling a DTensor stores its spec (mesh, placements, shape): about 1 KB per entry measured
PER_ENTRY_BYTES = 2048


def _shard_views(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's rows as the engine sees them: a view of its unit's flat shard buffer."""
    out = {}
    for unit in model._overlap_state.units:
        rank = model._overlap_state.rank
        for slot in unit.layout.slots:
            chunk = unit.shard[slot.shard_offset : slot.shard_offset + slot.chunk_numel]
            out[slot.fqn] = chunk.view(slot.rows_per_rank, *slot.shape[1:])[: slot.local_rows(rank)]
    return out


def save_and_load(rank: int, world: int, path: str, model_name: str) -> dict:
    build = {
        "tiny": lambda seed=0: tiny_lm(seed, dim=64, hidden=96),
        "mixed": mixed_lm,
        "one_row": lambda seed=0: tiny_lm(seed, vocab=1),
    }
    model = overlap.wrap(build[model_name]())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)  # eps: fp16 parameters (mixed)
    loss_of(model(batch(model, rank, 0))).backward()
    opt.step()
    views = _shard_views(model)
    # the optimizer wrote through the local tensors into the flat buffers
    in_buffer = all(torch.equal(views[n], p.to_local()) for n, p in model.named_parameters())

    file = os.path.join(path, f"rank{rank}.pt")
    torch.save(model.state_dict(), file)
    loaded = torch.load(file)  # weights_only: DTensors and their specs are allowed
    params = dict(model.named_parameters())
    same = set(loaded) == set(model.state_dict())
    for name, p in params.items():
        value = loaded[name]
        same &= isinstance(value, DTensor) and value.placements == p.placements and value.shape == p.shape
        same &= value.dtype == p.dtype and torch.equal(value.to_local(), p.to_local())
    shard_bytes = sum(v.numel() * v.element_size() for v in views.values())
    whole_buffers = sum(
        u.shard.numel() * u.shard.element_size() * len(u.layout.slots) for u in model._overlap_state.units
    )

    fresh = overlap.wrap(build[model_name](seed=5))
    fresh.load_state_dict(loaded)
    x = batch(model, rank, 1)
    with torch.no_grad():
        reloaded = torch.equal(fresh(x), model(x))  # gathered from the fresh model's flat buffers
    return {
        "in_buffer": in_buffer,
        "same": bool(same),
        "reloaded": reloaded,
        "file_bytes": os.path.getsize(file),
        "shard_bytes": shard_bytes,
        "whole_buffers": whole_buffers,
        "entries": len(loaded),
    }


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["in_buffer"] and r["same"] and r["reloaded"], (rank, r)
        assert r["file_bytes"] <= r["shard_bytes"] + PER_ENTRY_BYTES * r["entries"], (rank, r)


def test_torch_save_writes_each_shard_once(world2, tmp_path):
    results = world2.run(save_and_load, path=str(tmp_path), model_name="tiny")
    _check(results)
    for rank, r in enumerate(results):  # a flat buffer per parameter would be several times more
        assert r["file_bytes"] * 2 < r["whole_buffers"], (rank, r)


def test_torch_save_of_mixed_dtypes_and_empty_shards(world2, tmp_path):
    _check(world2.run(save_and_load, path=str(tmp_path), model_name="mixed"))
    # vocab 1: the embedding and head have one row, which rank 1 does not own (empty shards)
    _check(world2.run(save_and_load, path=str(tmp_path), model_name="one_row"))
