"""Sharding: the model's parameters assigned to units, and each unit's full parameters replaced by
DTensor shards that view one flat shard buffer ([Note: flat layout] in units.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from overlap.config import OverlapConfig
from overlap.engine.compose import TensorParallel
from overlap.engine.groups import shard_placements
from overlap.engine.init import ScratchBuffer
from overlap.engine.lazy_torch import is_dtensor
from overlap.engine.replicated import is_replicated
from overlap.engine.source_values import SourcePlan, pack_rank_major, scatter_shard
from overlap.engine.unit_tensors import UnitTensors
from overlap.engine.units import ParamInfo, UnitLayout
from overlap.transport.fingerprint import TAG_NUMEL


def unit_label(index: int, members: tuple[str, ...], dtype: torch.dtype | None, first: bool) -> str:
    """ "unit3 (layers.3)", "root"; a module group's unit of one of several dtypes names it."""
    where = "root" if members == ("",) else f"{members[0]}{'..' + members[-1] if len(members) > 1 else ''}"
    kind = "" if dtype is None else str(dtype).removeprefix("torch.")
    if where == "root" and first:
        return f"root ({kind})" if kind else "root"
    return f"unit{index} ({where}{', ' + kind if kind else ''})"


def unit_of_module(module_fqn: str, unit_set: set[str]) -> str:
    """The unit module containing `module_fqn` ("" = the root unit)."""
    parts = module_fqn.split(".") if module_fqn else []
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in unit_set:
            return prefix
    return ""


def params_by_unit_module(
    model: nn.Module,
    unit_fqns: list[str],
    tensor_parallel: Callable[[torch.Tensor], TensorParallel | None] | None = None,
) -> dict[str, list[ParamInfo]]:
    """Assign every parameter to the unit module that contains it ("" = root unit); 0-dim ones
    to none (see [Note: replicated parameters] in replicated.py).

    A parameter held by several modules (tied weights, e.g. GPT-2's embedding and LM head)
    belongs to the unit of their lowest common ancestor, as FSDP does: the one unit containing
    all its owners, or the root unit when they sit in different units. `tensor_parallel`
    describes a DTensor parameter ([Note: tensor-parallel parameters] in compose.py): its local
    tensor is what is laid out and sharded.
    """
    unit_set = set(unit_fqns)
    found: dict[int, tuple[str, list[tuple[str, str]], nn.Parameter]] = {}
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            if is_replicated(param):
                continue  # kept whole on every rank: [Note: replicated parameters] in replicated.py
            if param.is_sparse or param.is_complex() or not param.dtype.is_floating_point:
                raise ValueError(
                    f"overlap.wrap: parameter {fqn!r} ({param.dtype}, layout {param.layout}) is "
                    "not a dense real floating tensor, which is all overlap can shard"
                )
            entry = found.setdefault(id(param), (fqn, [], param))
            if (module_fqn, name) not in entry[1]:
                entry[1].append((module_fqn, name))
    if not found:
        scalars = [n for n, p in model.named_parameters() if is_replicated(p)]
        raise ValueError(
            f"overlap.wrap: every parameter of the model is a scalar (0-dim: {scalars}), so there "
            "is nothing to shard; use torch.nn.parallel.DistributedDataParallel for this model"
        )
    by_unit: dict[str, list[ParamInfo]] = {fqn: [] for fqn in unit_fqns}
    by_unit[""] = []
    for fqn, owners, param in found.values():
        units = {unit_of_module(module_fqn, unit_set) for module_fqn, _ in owners}
        unit = units.pop() if len(units) == 1 else ""
        tp = None if tensor_parallel is None else tensor_parallel(param)
        shape = param.shape if tp is None else tp.local_shape
        info = ParamInfo(fqn, tuple(owners), shape, param.requires_grad, param.dtype, tp)
        by_unit[unit].append(info)
    return by_unit


def _unit_params(
    modules: dict[str, nn.Module], layout: UnitLayout
) -> tuple[list[list[tuple[nn.Module, str]]], list[nn.Parameter], torch.dtype]:
    """The unit's (module, attribute) owners per parameter, its current full parameters, and
    their one dtype ([Note: one dtype per unit] in units.py)."""
    owners = [[(modules[m], name) for m, name in slot.owners] for slot in layout.slots]
    full = [holders[0][0]._parameters[holders[0][1]] for holders in owners]
    dtypes = {p.dtype for p in full}
    assert len(dtypes) == 1, f"rank {dist.get_rank()}: {layout.label} has dtypes {dtypes} (split_by_dtype)"
    (dtype,) = dtypes
    return owners, full, dtype  # type: ignore[return-value]


def _new_shard(layout: UnitLayout, dtype: torch.dtype, device: torch.device, source: SourcePlan | None) -> torch.Tensor:
    """The unit's flat shard buffer: zeros where this rank copies its own rows (the padding must
    be zero), uninitialized where the scatter fills all of it."""
    alloc = torch.zeros if source is None else torch.empty
    # TAG_NUMEL more behind the shard: the all-gather's tag ([Note: collective fingerprints])
    return alloc(layout.shard_numel + TAG_NUMEL, dtype=dtype, device=device)[: layout.shard_numel]


def shard_buffers(
    modules: dict[str, nn.Module],
    layouts: list[UnitLayout],
    device: torch.device,
    source: SourcePlan | None,
    preallocate: bool,
) -> tuple[list[torch.Tensor | None], ScratchBuffer]:
    """Every unit's shard buffer when `preallocate` (else None: `shard_unit` allocates it), and
    the buffer the source packs each unit into, sized for the largest unit.

    [Note: shards first]
    The shards outlive wrap; a deferred unit's full parameters and the source's packed copy do
    not (they live in ScratchBuffers, init.py). Allocated one by one between those temporaries,
    every shard would pin a hole in the heap (glibc on CPU; split segments in CUDA's caching
    allocator); allocated before the walk, they stay out of the temporaries' way.
    """
    dtypes = [_unit_params(modules, layout)[2] for layout in layouts]
    shards: list[torch.Tensor | None] = [None] * len(layouts)
    if preallocate:
        shards = [_new_shard(layout, dtype, device, source) for layout, dtype in zip(layouts, dtypes)]
    packing = ScratchBuffer(device)
    if source is not None and source.is_source:
        sizes = [ScratchBuffer.aligned(layout.unsharded_numel * d.itemsize) for layout, d in zip(layouts, dtypes)]
        packing.reserve(max(sizes))
    return shards, packing


def shard_unit(
    modules: dict[str, nn.Module],
    layout: UnitLayout,
    mesh: DeviceMesh,
    rank: int,
    config: OverlapConfig,
    device: torch.device,
    source: SourcePlan | None,
    shard: torch.Tensor | None = None,
    packing: ScratchBuffer | None = None,
) -> UnitTensors:
    """Replace the unit's parameters by DTensor shards that are views of one flat shard buffer
    (`shard` if preallocated, see [Note: shards first]).

    The shard holds this rank's rows of the source's values (`source`, [Note: sync from the
    source]; the full parameters need to be real on the source only) or, without a source, of
    this rank's own values; a meta parameter's rows are left zero, for the init functions to
    fill on the shard ([Note: deferred init with tensor parallelism] in init.py). `modules` maps
    every module FQN (duplicates kept) to its module; `packing` holds the source's rank-major
    copy (see ScratchBuffer in init.py)."""
    from torch.distributed.tensor import DTensor  # [Note: import cost] in lazy_torch.py

    owners, full, dtype = _unit_params(modules, layout)
    world_size = layout.world_size
    if shard is None:
        shard = _new_shard(layout, dtype, device, source)
    if source is not None:
        packed = None
        if source.is_source:
            out = None if packing is None else packing.take([(torch.Size([layout.unsharded_numel]), dtype)])[0]
            packed = pack_rank_major(layout, [_data(p) for p in full], dtype, device, out)
        scatter_shard(source, shard, packed)
        del packed
    gather_dtype = config.param_dtype or dtype
    unsharded_flat = torch.empty(layout.unsharded_numel, dtype=gather_dtype, device=device)
    sharded_params, unsharded_params = [], []
    for slot, param in zip(layout.slots, full):
        rows, local_rows = slot.rows_per_rank, slot.local_rows(rank)
        chunk = shard[slot.shard_offset : slot.shard_offset + slot.chunk_numel]
        local = chunk.view(rows, *slot.shape[1:])[:local_rows]
        if source is None and not param.is_meta:  # a meta one: [Note: deferred init with tensor parallelism]
            with torch.no_grad():
                local.copy_(_data(param).detach()[rank * rows : rank * rows + local_rows])
        tp = slot.tensor_parallel  # [Note: tensor-parallel parameters] in compose.py
        if tp is None:
            dtensor = DTensor.from_local(
                _own_storage(local),
                mesh,
                shard_placements(mesh),
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        else:
            dtensor = tp.sharded(_own_storage(local))
        sharded_params.append(nn.Parameter(dtensor, requires_grad=param.requires_grad))
        padded = unsharded_flat[slot.unsharded_offset : slot.unsharded_offset + world_size * slot.chunk_numel]
        view = padded.view(world_size * rows, *slot.shape[1:])[: slot.shape[0]]
        unsharded = view if tp is None else tp.unsharded(view)
        unsharded_params.append(nn.Parameter(unsharded, requires_grad=param.requires_grad))
    unsharded_flat.untyped_storage().resize_(0)
    unit = UnitTensors(layout, shard, sharded_params, unsharded_flat, unsharded_params, owners)
    unit.swap_in(sharded_params)
    return unit


def _data(param: torch.Tensor) -> torch.Tensor:
    """A parameter's values as wrap lays them out: a DTensor's local tensor ([Note:
    tensor-parallel parameters] in compose.py), a plain tensor itself."""
    return param._local_tensor if is_dtensor(param) else param


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """`view`'s memory as a tensor with a storage object of its own, covering exactly its bytes.

    [Note: shards with their own storage]
    A sharded parameter's local tensor is this rank's rows in the unit's flat shard buffer: the
    optimizer writes there and the all-gather reads from there. As a plain view it would carry
    the flat buffer's storage, with an offset, and `torch.save(model.state_dict())` would fail
    (torch 2.13 gives the DTensor wrapper the local's storage offset, so pickling takes the plain
    tensor path and reads the wrapper's null storage) or, where it succeeds, write the whole
    flat buffer once per parameter. Through DLPack the local tensor shares the memory (in-place
    writes land in the flat buffer; the DLPack capsule keeps that buffer alive) but owns a storage
    of its own bytes at offset 0: saving writes each parameter's bytes and nothing else.
    Nothing may rely on `untyped_storage()` identity between a local tensor and its flat shard;
    `data_ptr()` is shared."""
    return torch.from_dlpack(view)
