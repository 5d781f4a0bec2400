"""The process groups `wrap` runs on, from its `group` argument (a group, or a 1-D or 2-D mesh)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from overlap.engine import torch_compat

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement


class Groups(NamedTuple):
    """The process groups `wrap` runs on. See [Note: hybrid sharding]."""

    shard: dist.ProcessGroup  # all-gathers and reduce-scatters
    replicate: dist.ProcessGroup | None  # HSDP: reduced shards are all-reduced across replicas
    secondary: dist.ProcessGroup | None  # hpZ: backward all-gathers from the secondary copy
    mesh: DeviceMesh  # the mesh of the sharded parameters' DTensors
    everyone: dist.ProcessGroup  # every rank of the model: the same-model/config checks
    # the parameters' tensor-parallel group: [Note: tensor-parallel parameters] in compose.py
    tensor: dist.ProcessGroup | None = None
    # experts: gradients divided by the size of all of dp, not of `shard` ([Note: expert
    # parallelism] in experts.py); None: by the ranks the gradients are reduced over
    gradient_divide_factor: int | None = None
    # every rank of the job the model spans: with tensor parallelism the data- and tensor-parallel
    # ranks together (autotune decides over it, one decision for all); None: `everyone`
    job: dist.ProcessGroup | None = None


def resolve_groups(group: dist.ProcessGroup | DeviceMesh | None, device: torch.device, hybrid_mode: str) -> Groups:
    """The groups for `wrap`'s `group` argument.

    [Note: hybrid sharding]
    A 2-D DeviceMesh is (outer, inner), e.g. (nodes, GPUs per node).
    hybrid_mode="replicate" (HSDP): parameters are sharded over the inner dimension (the shard
    group) and replicated over the outer one. All-gathers and reduce-scatters run inside the
    shard group; each reduced gradient shard is then summed across replicas by an all-reduce in
    the replicate group and divided by the total number of ranks, which makes the update DDP's
    average over every rank. Parameters are DTensors with placements (Replicate(), Shard(0)).
    hybrid_mode="secondary" (hpZ): parameters are sharded over every rank of the mesh (a 1-D
    mesh over the flattened group, so DTensors, checkpoints and state dicts are those of plain
    sharding over all ranks); after a unit's forward all-gather each rank keeps the parts that
    its inner group needs (1/inner of the unit), and the unit's backward all-gather runs inside
    the inner group from those copies ([Note: secondary copy] in runtime.py). Gradients are
    reduce-scattered over every rank. With tensor parallelism (`group=mesh["rep", "dp"]` of a
    (rep, dp, tp) mesh) that 1-D mesh is the flattened (rep, dp) dimension of the whole mesh, so
    the sharded DTensors are FSDP2's over it: (flattened dp, tp) ([Note: tensor-parallel
    parameters] in compose.py).
    """
    if not isinstance(group, DeviceMesh) or group.ndim == 1:
        if isinstance(group, DeviceMesh):
            pg, mesh = group.get_group(), group
        else:
            pg = group if group is not None else dist.group.WORLD
            assert pg is not None
            mesh = DeviceMesh.from_group(pg, device.type)
        return Groups(pg, None, None, mesh, pg)
    if group.ndim != 2:
        raise ValueError(
            f"overlap.wrap: a {group.ndim}-D DeviceMesh was given; pass a 1-D mesh (shard) or a "
            "2-D mesh (replicate, shard), e.g. init_device_mesh('cpu', (2, 2))"
        )
    ranks = group.mesh.flatten().tolist()  # once, at wrap: the mesh tensor lives on the CPU
    flat = _mesh_of_all(group, ranks)
    everyone = flat.get_group()
    if hybrid_mode == "replicate":
        replicate = group.get_group(0) if group.size(0) > 1 else None
        return Groups(group.get_group(1), replicate, None, group, everyone)
    if ranks != sorted(ranks):
        raise ValueError(
            "overlap.wrap: hybrid_mode='secondary' needs a mesh laid out in rank order (as "
            f"init_device_mesh makes it); got ranks {group.mesh.tolist()}"
        )
    secondary = group.get_group(1) if group.size(0) > 1 and group.size(1) > 1 else None
    return Groups(everyone, None, secondary, flat, everyone)


def _mesh_of_all(mesh: DeviceMesh, ranks: list[int]) -> DeviceMesh:
    """A 1-D mesh over every rank of the 2-D `mesh` (its group: hpZ's shard group, the checks'). A
    whole mesh gets a new group (collective over the default group, as wrap is). Part of a larger
    mesh, e.g. the (replicate, shard) dimensions of a (replicate, shard, tp) mesh ([Note:
    tensor-parallel parameters] in compose.py), other ranks hold other slices of it: DeviceMesh
    flattens it, making every slice's group together, and the flattened dimension belongs to the
    larger mesh, so that hpZ x TP's sharded DTensors live on (flattened, tp)."""
    root = torch_compat.root_mesh(mesh, "HSDP")
    if mesh.mesh_dim_names is not None and root is not mesh and mesh.size() < root.size():
        return torch_compat.flatten(mesh, "HSDP")
    return DeviceMesh.from_group(dist.new_group(ranks=sorted(ranks)), mesh.device_type)


def shard_placements(mesh: DeviceMesh) -> list[Placement]:
    """DTensor placements of a sharded parameter (and its gradient) on `mesh`."""
    from torch.distributed.tensor import Replicate, Shard  # [Note: import cost] in lazy_torch.py

    return [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
