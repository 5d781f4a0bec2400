"""Full (unsharded) state dicts of a wrapped model: export to rank 0, load from rank 0.

Both move one unit at a time between the source rank (global rank 0; mesh[0][0] on a 2-D mesh)
and the shards ([Note: sync from the source] in source_values.py): a rank other than the source never
holds a full parameter, and the source holds the dict plus one unit's rank-major buffer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap import kernels
from overlap.engine.init import ScratchBuffer
from overlap.engine.late_checks import check_deferred
from overlap.engine.lazy_torch import is_dtensor
from overlap.engine.source_values import (
    SourcePlan,
    broadcast_tensors,
    pack_rank_major,
    plan_source,
    scatter_shard,
    share_object,
)
from overlap.engine.state import OverlapState, state_of
from overlap.engine.unit_tensors import UnitTensors
from overlap.engine.units import ParamSlot
from overlap.transport import collectives as comm


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict under the original names, on CPU: what the unwrapped model's
    `load_state_dict` accepts. Collective: every rank must call it.

    With `rank0_only`, each unit's shards are gathered to rank 0 (one collective per unit; on a
    2-D mesh only row 0 takes part, the replicas hold the same values) and ranks other than 0
    get an empty dict. With tensor or expert parallelism every rank gathers each parameter's
    `full_tensor()` in turn, and only rank 0 copies it to the host: no other rank holds more than
    one full tensor, nor any host copy. Without `rank0_only`, every rank all-gathers every
    parameter and keeps the dict. The checks the last step left unread run first, on every rank
    ([Note: final checks] in engine/late_checks.py)."""
    state = state_of(model)
    check_deferred(state, "overlap.full_state_dict")
    own = model.state_dict()
    if not rank0_only or _by_dtensor(state):  # TP, EP: [Note: full state dicts with tensor parallelism]
        keeps = not rank0_only or _is_tp_source(state)
        full = {}
        for name, value in own.items():
            whole = value.full_tensor() if is_dtensor(value) else value  # collective: every rank
            if keeps:
                full[name] = _host_copy(whole, value)
            del whole  # one full tensor at a time on the ranks that keep nothing
        return full
    plan = _plan(state)
    if not plan.in_source_row:
        return {}
    gathered: dict[str, torch.Tensor] = {}
    scratch = ScratchBuffer(plan.device)
    for unit in state.units:
        full = _gather_unit(plan, unit, scratch)
        for slot, tensor in zip(unit.layout.slots, full or ()):
            first, *aliases = _names(slot)
            gathered[first] = tensor
            for name in aliases:  # a tied parameter: one tensor per key, as state_dict() gives
                gathered[name] = tensor.clone()
    if not plan.is_source:
        return {}
    return {name: gathered[name] if is_dtensor(value) else _host_copy(value, value) for name, value in own.items()}


def _host_copy(tensor: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """`tensor` on the host, sharing no memory with `owned` (the model's tensor it came from): one
    device-to-host copy, or a clone where `tensor` is already the model's own host memory (a buffer
    on the CPU, or a `full_tensor()` that had nothing to gather); never both. Export only (a
    state dict, a checkpoint), once per tensor on the writing rank: never in the training step."""
    host = tensor.detach().cpu()  # a blocking device-to-host copy, outside the hot path
    local = owned.to_local() if is_dtensor(owned) else owned
    if host.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        host = host.clone()
    return host


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any] | None, strict: bool = True, *, rank0_only: bool = True
) -> None:
    """Load an unsharded state dict (original names, as `full_state_dict` returns) into the
    sharded model. Collective: every rank must call it.

    `rank0_only=True` (default): only rank 0's dict is read (mesh[0][0] on a 2-D mesh); the other
    ranks pass None (a dict they pass is ignored), so only rank 0 needs the checkpoint in memory.
    Rank 0 checks the keys and shapes (an error raises on every rank), then scatters the
    parameters unit by unit and broadcasts the buffers: no other rank holds more than its shards
    (plus one shard's worth for a unit that `strict=False` loads only in part).
    `rank0_only=False`: every rank passes the same full dict and copies its own rows; no
    communication.
    """
    state = state_of(model)
    own = model.state_dict()
    if _by_dtensor(state):
        _load_tensor_parallel(state, own, state_dict, strict, rank0_only)
        return
    if not rank0_only:
        if state_dict is None:
            raise ValueError("load_full_state_dict: rank0_only=False needs the full state_dict on every rank")
        _load_own_rows(state, own, state_dict, strict)
        return
    plan = _plan(state)
    verdict = None
    if plan.is_source:
        verdict = _check(own, state_dict, strict)
    error, present = share_object(plan, verdict)
    if error is not None:
        raise ValueError(f"load_full_state_dict (checked on rank {plan.source}): {error}")
    keys = set(present)
    scratch = ScratchBuffer(plan.device)  # the packed unit (source) or a partial unit's shard
    for unit in state.units:
        names = [next((n for n in _names(slot) if n in keys), None) for slot in unit.layout.slots]
        if any(names):
            _scatter_unit(plan, unit, names, state_dict, scratch)
    buffers = [name for name in present if not is_dtensor(own[name])]
    if plan.is_source:
        assert state_dict is not None
        for name in buffers:
            own[name].copy_(state_dict[name])
    if buffers:
        broadcast_tensors(plan, [own[name] for name in buffers])


def _plan(state: OverlapState) -> SourcePlan:
    timeout = state.config.collective_timeout_s
    device = state.units[0].shard.device
    return plan_source(
        state.group, state.replicate_group, state.mesh, device, None if timeout is None else timedelta(seconds=timeout)
    )


def _names(slot: ParamSlot) -> list[str]:
    """Every state-dict key of the parameter (a tied parameter has one per owner)."""
    return [f"{module}.{attr}" if module else attr for module, attr in slot.owners]


def _gather_unit(plan: SourcePlan, unit: UnitTensors, scratch: ScratchBuffer) -> list[torch.Tensor] | None:
    """The unit's full parameters on the source (CPU), gathered from row 0's shards; None elsewhere."""
    layout = unit.layout
    world = plan.shard_world_size
    gathered = None
    if plan.is_source:
        gathered = scratch.take([(torch.Size([layout.unsharded_numel]), unit.shard.dtype)])[0]
    if world == 1:
        assert gathered is not None
        gathered.copy_(unit.shard)
    else:
        chunks = list(gathered.view(world, -1).unbind(0)) if gathered is not None else None
        work = dist.gather(unit.shard, chunks, dst=plan.source, group=plan.shard_group, async_op=True)
        comm.wait(comm.CommResult(unit.shard, work, () if gathered is None else (gathered,)), plan.timeout)
    if gathered is None:
        return None
    outs = [torch.empty(slot.shape, dtype=gathered.dtype, device=gathered.device) for slot in layout.slots]
    sizes = [world * slot.padded_chunk_numel for slot in layout.slots]
    data_cols = [slot.chunk_numel for slot in layout.slots]
    kernels.copy_out(gathered, outs, sizes=sizes, data_cols=data_cols, num_rows=world)
    return [t.cpu() for t in outs]


def _check(own: dict[str, Any], state_dict: Mapping[str, Any] | None, strict: bool) -> tuple[str | None, list[str]]:
    """On the source: (an error message or None, the keys to load in `own`'s order)."""
    if state_dict is None:
        return "rank 0 passed state_dict=None; pass the full state dict there (other ranks may pass None)", []
    tensors = {name for name, value in own.items() if isinstance(value, torch.Tensor)}
    missing = sorted(tensors - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        return f"missing keys {missing}, unexpected keys {unexpected}", []
    present = [name for name in own if name in tensors and name in state_dict]
    for name in present:
        source = state_dict[name]
        if not isinstance(source, torch.Tensor) or tuple(source.shape) != tuple(own[name].shape):
            got = tuple(source.shape) if isinstance(source, torch.Tensor) else type(source).__name__
            return f"{name!r} has shape {got}, the model expects {tuple(own[name].shape)}", []
    return None, present


def _scatter_unit(
    plan: SourcePlan,
    unit: UnitTensors,
    names: list[str | None],
    state_dict: Mapping[str, Any] | None,
    scratch: ScratchBuffer,
) -> None:
    """Overwrite the unit's shards with the source's values for the slots named (None: keep)."""
    dtype = unit.shard.dtype
    partial = not all(names)
    specs = [(torch.Size([unit.layout.unsharded_numel]), dtype)] if plan.is_source else []
    specs += [(unit.shard.shape, dtype)] if partial else []
    buffers = scratch.take(specs)
    packed = None
    if plan.is_source:
        assert state_dict is not None
        sources = [None if name is None else state_dict[name] for name in names]
        packed = pack_rank_major(unit.layout, sources, dtype, plan.device, buffers[0])
    if not partial:
        scatter_shard(plan, unit.shard, packed)
        return
    received = buffers[-1]
    scatter_shard(plan, received, packed)
    for slot, name in zip(unit.layout.slots, names):
        if name is not None:
            span = slice(slot.shard_offset, slot.shard_offset + slot.chunk_numel)
            unit.shard[span].copy_(received[span])


def _load_own_rows(state: OverlapState, own: dict[str, Any], state_dict: Mapping[str, Any], strict: bool) -> None:
    """rank0_only=False: every rank holds the full dict; copy this rank's rows, no communication."""
    error, present = _check(own, state_dict, strict)
    if error is not None:
        raise ValueError(f"load_full_state_dict: {error}")
    for name in present:
        target, source = own[name], state_dict[name]
        if is_dtensor(target):
            local = target.to_local()
            rows = math.ceil(target.shape[0] / state.world_size)  # the shard dim of the mesh
            start = state.rank * rows
            local.copy_(source[start : start + local.shape[0]])
        else:
            target.copy_(source)


# [Note: full state dicts with tensor parallelism]
# A tensor-parallel model's sharded parameters are DTensors on the (dp, tp) mesh ([Note:
# tensor-parallel parameters] in engine/compose.py), so a unit's gathered shards are tp-local
# tensors, not full ones. Exporting takes each parameter's `full_tensor()` (one at a time, on every
# rank: a collective), and only the source (rank 0 of dp, tp and, under HSDP, the replicas) copies
# it to the host and keeps it; every other rank drops it before the next, so that no rank but the
# source holds more than one full tensor, and none but the source any host copy (with
# `rank0_only=False` every rank keeps the dict it asked for); loading sends each
# tensor from the source down the tp group, then (HSDP) down the replicate groups of dp row 0, then
# down each dp group (`_tp_stages`), and every rank cuts its local rows out of the full
# tensor by its own placements (`distribute_tensor` without communication). Simpler than the
# unit-by-unit scatter of the plain path, and holding one full tensor at a time on every rank.
# Expert parallelism takes the same path ([Note: expert parallelism] in engine/experts.py): the
# model's state is over all of dp, which holds every rank of the experts' (dp_mod_ep, ep) mesh, so
# a broadcast over dp reaches every rank, and `full_tensor()` gathers an expert over its own mesh.


def _by_dtensor(state: OverlapState) -> bool:
    """Whether the full state dict goes through DTensors (TP, EP) rather than unit by unit."""
    return state.tensor_group is not None or bool(state.experts)


def _is_tp_source(state: OverlapState) -> bool:
    tp_first = state.tensor_group is None or dist.get_rank(state.tensor_group) == 0
    return dist.get_rank(state.group) == 0 and tp_first and state.replica_rank == 0


def _tp_stages(state: OverlapState) -> list[dist.ProcessGroup]:
    """The groups a value takes from the source, in order, on this rank: tp (in the source's
    replica and dp row), replicate (HSDP, in dp row 0), dp (everywhere)."""
    first_dp = dist.get_rank(state.group) == 0
    stages = []
    if first_dp and state.replica_rank == 0 and state.tensor_group is not None:
        stages.append(state.tensor_group)
    if first_dp and state.replicate_group is not None:
        stages.append(state.replicate_group)
    return [*stages, state.group]


def _from_tp_source(state: OverlapState, tensor: torch.Tensor) -> None:
    """Overwrite `tensor` with the source's ([Note: full state dicts with tensor parallelism])."""
    for group in _tp_stages(state):
        dist.broadcast(tensor, group=group, group_src=0)


def _share_from_tp_source(state: OverlapState, obj: Any) -> Any:
    box = [obj]
    for group in _tp_stages(state):
        dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _load_tensor_parallel(
    state: OverlapState, own: dict[str, Any], state_dict: Mapping[str, Any] | None, strict: bool, rank0_only: bool
) -> None:
    """load_full_state_dict of a tensor-parallel model ([Note: full state dicts with tensor
    parallelism])."""
    from torch.distributed.tensor import distribute_tensor

    source = _is_tp_source(state)
    if rank0_only:
        error, present = _share_from_tp_source(state, _check(own, state_dict, strict) if source else None)
    elif state_dict is None:
        raise ValueError("load_full_state_dict: rank0_only=False needs the full state_dict on every rank")
    else:
        error, present = _check(own, state_dict, strict)
    if error is not None:
        raise ValueError(f"load_full_state_dict{' (checked on the source rank)' if rank0_only else ''}: {error}")
    for name in present:
        target = own[name]
        if not rank0_only or source:
            assert state_dict is not None
            value = state_dict[name].to(device=target.device, dtype=target.dtype)
        else:
            value = torch.empty(target.shape, dtype=target.dtype, device=target.device)
        if rank0_only:
            _from_tp_source(state, value)
        if is_dtensor(target):
            local = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(local.to_local())
        else:
            target.copy_(value)
