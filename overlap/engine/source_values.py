"""Rank-0 values at wrap and at load: shards and buffers sent from one source rank.

[Note: sync from the source]
DDP broadcasts rank 0's parameters and buffers when it is built, and training scripts rely on
it (ranks seeded differently, a checkpoint read on rank 0 only). `overlap.wrap` keeps that
promise (`OverlapConfig.sync_module_states`) without a whole-model broadcast: for each unit, in
wrap's shard order (the same on every rank, so the collectives pair), the source packs the
unit's rank-major buffer ([Note: flat layout] in units.py) and scatters it over its shard
group. Every rank receives exactly its shard, one collective per unit, and the source sends each
byte once. `overlap.load_full_state_dict` sends the source's dict the same way.

The source is rank 0 of the shard group on a 1-D group (global rank 0 for the default group),
and mesh[0][0] on a 2-D mesh (global rank 0 for a mesh from `init_device_mesh`). On a 2-D mesh
(HSDP) the scatter runs in row 0's shard group, then each rank of row 0 broadcasts its shard
down its mesh column (its replicate group), so every replica ends identical to the source.
Buffers (never sharded) travel in the same two stages, coalesced into one tensor per dtype.
On every rank the shard groups and replicate groups are entered in the same order (row 0
scatters unit k, then broadcasts it; the other rows only broadcast), so no rank waits on a
collective that its peer issues after one it is itself waiting for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from overlap import kernels
from overlap.engine.units import UnitLayout
from overlap.transport import collectives as comm


@dataclass(frozen=True)
class SourcePlan:
    """Where this rank's values come from; see [Note: sync from the source]."""

    shard_group: dist.ProcessGroup
    shard_world_size: int
    source: int  # global rank whose values every rank ends with
    in_source_row: bool  # this rank's shard group holds the source (always true on a 1-D group)
    replicate_group: dist.ProcessGroup | None  # HSDP: this rank's mesh column
    replicate_src: int  # global rank of this column's member in the source row; -1 without one
    device: torch.device  # where the collectives' buffers live (the model's device)
    timeout: timedelta | None  # per collective; None: the process group's timeout

    @property
    def is_source(self) -> bool:
        return dist.get_rank() == self.source


def plan_source(
    shard_group: dist.ProcessGroup,
    replicate_group: dist.ProcessGroup | None,
    mesh: DeviceMesh,
    device: torch.device,
    timeout: timedelta | None = None,
) -> SourcePlan:
    """The plan for a model sharded over `shard_group` (and replicated over `replicate_group`
    on the 2-D `mesh`, for HSDP)."""
    world = dist.get_world_size(shard_group)
    if replicate_group is None:
        source = dist.get_global_rank(shard_group, 0)
        return SourcePlan(shard_group, world, source, True, None, -1, device, timeout)
    assert mesh.ndim == 2, f"rank {dist.get_rank()}: a replicate group needs a 2-D mesh"
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, f"rank {dist.get_rank()} is not in the mesh"
    row, column = coordinate
    ranks = mesh.mesh
    return SourcePlan(
        shard_group, world, int(ranks[0, 0]), row == 0, replicate_group, int(ranks[0, column]), device, timeout
    )


def pack_rank_major(
    layout: UnitLayout,
    sources: Sequence[torch.Tensor | None],
    dtype: torch.dtype,
    device: torch.device,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unit's rank-major buffer ([Note: flat layout]): every rank's shard in turn, each
    parameter zero-padded to its chunks; a None source gives zeros. One fused pass
    (kernels.copy_in), cast to `dtype`, into `out` (contiguous, `layout.unsharded_numel`
    elements) when given."""
    world = layout.world_size
    packed = torch.empty(layout.unsharded_numel, dtype=dtype, device=device) if out is None else out
    srcs = [None if s is None else s.detach().to(device) for s in sources]
    sizes = [world * slot.padded_chunk_numel for slot in layout.slots]
    data_cols = [slot.chunk_numel for slot in layout.slots]
    kernels.copy_in(srcs, packed, sizes=sizes, data_cols=data_cols, num_rows=world)
    return packed


def scatter_shard(plan: SourcePlan, shard: torch.Tensor, packed: torch.Tensor | None) -> None:
    """Fill this rank's flat `shard` from the source's rank-major `packed` (None elsewhere)."""
    assert (packed is not None) == plan.is_source, f"rank {dist.get_rank()}: packed only on the source"
    if plan.in_source_row:
        if plan.shard_world_size == 1:
            assert packed is not None
            shard.copy_(packed)
        else:
            chunks = list(packed.view(plan.shard_world_size, -1).unbind(0)) if packed is not None else None
            work = dist.scatter(shard, chunks, src=plan.source, group=plan.shard_group, async_op=True)
            comm.wait(comm.CommResult(shard, work, () if packed is None else (packed,)), plan.timeout)
    _broadcast_down_column(plan, shard)


def broadcast_replicas(plan: SourcePlan, shards: Sequence[torch.Tensor]) -> None:
    """HSDP: overwrite each replica's `shards` (every rank's own rows) with those of its member
    of the source row, one broadcast per shard down the mesh column; nothing on a 1-D group.
    For shards each rank made itself ([Note: deferred init with tensor parallelism] in init.py)."""
    for shard in shards:
        _broadcast_down_column(plan, shard)


def broadcast_tensors(plan: SourcePlan, tensors: Sequence[torch.Tensor]) -> None:
    """Overwrite `tensors` (the same names, shapes and dtypes on every rank) with the source's,
    one broadcast per dtype (two stages on a 2-D mesh)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1).to(plan.device) for t in group])
        if plan.in_source_row and plan.shard_world_size > 1:
            work = dist.broadcast(flat, src=plan.source, group=plan.shard_group, async_op=True)
            comm.wait(comm.CommResult(flat, work, ()), plan.timeout)
        _broadcast_down_column(plan, flat)
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()


def share_object(plan: SourcePlan, obj: Any) -> Any:
    """The source's `obj` (picklable) on every rank: for decisions that only the source can
    make (a checkpoint's keys, an error), so that every rank then runs the same collectives."""
    box = [obj]
    if plan.in_source_row and plan.shard_world_size > 1:
        dist.broadcast_object_list(box, src=plan.source, group=plan.shard_group, device=plan.device)
    if plan.replicate_group is not None:
        dist.broadcast_object_list(box, src=plan.replicate_src, group=plan.replicate_group, device=plan.device)
    return box[0]


def _broadcast_down_column(plan: SourcePlan, tensor: torch.Tensor) -> None:
    if plan.replicate_group is None:
        return
    work = dist.broadcast(tensor, src=plan.replicate_src, group=plan.replicate_group, async_op=True)
    comm.wait(comm.CommResult(tensor, work, ()), plan.timeout)
