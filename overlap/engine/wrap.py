"""`overlap.wrap`: shard a model in place and install the hooks that drive the schedule.

The orchestrator, in the order it runs: resolve the groups (groups.py) and check that every rank
wraps the same model and config (checks.py); find the units and their flat layouts (units.py);
shard each unit, materializing a meta-device model one unit at a time (sharding.py, init.py)
from rank 0's values (source_values.py); then attach the state and its hooks (state.py), which drive the
schedule (schedule.py) and the runtime (runtime.py) over the transport (overlap/transport/).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from overlap.config import OverlapConfig
from overlap.engine import compose, experts, process_hooks, teardown
from overlap.engine.checks import check_same_config, check_same_model
from overlap.engine.groups import Groups, resolve_groups
from overlap.engine.guard import remember_replaced
from overlap.engine.init import ParamInitFn, initialize_sharded, materialize_and_shard
from overlap.engine.local_step import register_sharded
from overlap.engine.module import as_overlap_module
from overlap.engine.replicated import is_replicated
from overlap.engine.sharding import params_by_unit_module, shard_buffers, shard_unit, unit_label, unit_of_module
from overlap.engine.source_values import SourcePlan, broadcast_replicas, broadcast_tensors, plan_source
from overlap.engine.state import HookedModules, OverlapState
from overlap.engine.unit_tensors import UnitTensors
from overlap.engine.units import (
    CHUNK_ALIGN_NUMEL,
    ParamInfo,
    UnitLayout,
    find_unit_modules,
    group_units,
    make_layout,
    split_by_dtype,
)
from overlap.transport import backend, check_settings


def wrap(
    model: nn.Module,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    config: OverlapConfig | None = None,
    *,
    param_init_fn: ParamInitFn | None = None,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> nn.Module:
    """Shard `model` in place across `group` and return it.

    Parameters become DTensor shards (`Shard(0)`) under their original names, ndim and dtype,
    so `torch.optim.AdamW(model.parameters())` builds a sharded optimizer. A unit whose
    parameters have several dtypes (fp32 norms beside bf16 weights) is split into one unit per
    dtype over the same modules ([Note: one dtype per unit] in units.py). Forward and backward
    all-gather each unit's parameters just ahead of use and reduce-scatter its gradients while
    backward goes on. `overrides` replace fields of `config` (e.g. `prefetch_depth=2`).
    Collective over `group`: every rank must call it with the same model structure.

    As DDP does, every rank ends with rank 0's parameter and buffer values (its shards are
    scattered from rank 0 unit by unit; see [Note: sync from the source] in source_values.py), unless
    `sync_module_states=False`, with which each rank keeps its own rows of its own values.

    A model built on the meta device is materialized one unit at a time on `device` (default:
    the current CUDA device for an NCCL group, else the CPU) and initialized by
    `param_init_fn(module)` or each module's `reset_parameters()`, in the order eager
    construction uses (see [Note: init order] in init.py): the same values as the eager model
    built with the same seed, without ever holding the whole model unsharded. With
    `sync_module_states` only rank 0 initializes; the other ranks build nothing but their shards.
    A meta model with tensor-parallel parameters is sharded first and initialized on the shards
    by every rank, as FSDP2 + `to_empty` + init does, to FSDP2's values ([Note: deferred init
    with tensor parallelism] in init.py).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"overlap.wrap expects an nn.Module, got {type(model).__name__}")
    if getattr(model, "_overlap_state", None) is not None:
        raise ValueError("overlap.wrap: this model is already wrapped")
    config = (config or OverlapConfig()).replace(**overrides)
    if not dist.is_initialized():
        raise RuntimeError(
            "overlap.wrap needs torch.distributed: call dist.init_process_group first "
            "(or launch with torchrun / overlap.launch.run_local_world)"
        )
    model_device = _model_device(model)
    deferred = model_device.type == "meta"
    if device is not None:
        device = torch.device(device)
        if not deferred and device != model_device:
            raise ValueError(
                f"overlap.wrap: device={device} but the model is on {model_device}; `device` is "
                "for meta-device models (move a materialized model yourself)"
            )
    elif deferred:
        device = _default_device(group)
    else:
        device = model_device
    if not deferred and param_init_fn is not None:
        raise ValueError("overlap.wrap: param_init_fn is only used for meta-device models")
    if experts.is_expert_parallel(model, group):  # [Note: expert parallelism] in experts.py
        assert isinstance(group, DeviceMesh)
        return _wrap_expert_parallel(model, group, config, device, deferred)
    group = compose.data_parallel_mesh(group, model)  # the whole (dp, tp) mesh: its dp part
    # [Note: composition refusals] in compose.py: before any group is made, on every rank
    compose.agree(compose.refusal(model, group), model, group, device)
    state = _wrap_state(
        model, resolve_groups(group, device, config.hybrid_mode), config, device, deferred, param_init_fn
    )
    return _attach(model, state)


def _attach(model: nn.Module, state: OverlapState) -> nn.Module:
    model._overlap_state = state
    as_overlap_module(model)  # ecosystem: model.no_sync(), .unshard(), ... (overlap/engine/module.py)
    return model


def _wrap_expert_parallel(
    model: nn.Module, group: DeviceMesh, config: OverlapConfig, device: torch.device, deferred: bool
) -> nn.Module:
    """The experts' state over dp_mod_ep, then the model's over all of dp, each wrapping the
    model with the other's parameters hidden ([Note: expert parallelism] in experts.py)."""
    compose.agree(experts.refusal(model, group, config, deferred), model, group, device)
    plan = experts.plan(model, group)
    expert_ids = {id(p) for p in model.parameters() if experts.is_expert(p, group)}
    with experts.hidden(model, lambda p: id(p) not in expert_ids):
        pgs = resolve_groups(plan.expert_mesh, device, config.hybrid_mode)
        pgs = pgs._replace(gradient_divide_factor=plan.dp_size)
        expert_state = _wrap_state(model, pgs, config, device, False, None, writes_files=False)
    expert_ids = {id(p) for unit in expert_state.units for p in unit.sharded_params}
    with experts.hidden(model, lambda p: id(p) in expert_ids):
        state = _wrap_state(
            model, resolve_groups(plan.dense_mesh, device, config.hybrid_mode), config, device, False, None
        )
    state.experts = (expert_state,)
    return _attach(model, state)


def _wrap_state(
    model: nn.Module,
    pgs: Groups,
    config: OverlapConfig,
    device: torch.device,
    deferred: bool,
    param_init_fn: ParamInitFn | None,
    writes_files: bool = True,
) -> OverlapState:
    """Shard `model` over `pgs` and build its state (hooks installed): the body of `wrap`, once
    per state."""
    check_same_model(model, pgs.everyone, device)
    check_same_config(config, pgs.everyone, device)
    composer = compose.Composer(pgs.mesh)
    group, mesh = pgs.shard, pgs.mesh
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    check_settings(group, device, config.all_gather_impl)  # what the transport cannot honour
    source = _source_plan(pgs, device, config) if config.sync_module_states else None

    unit_fqns = find_unit_modules(model, config.unit_policy)
    modules = dict(model.named_modules())
    params_of = params_by_unit_module(model, unit_fqns, composer)
    pgs = pgs._replace(tensor=composer.tensor_group(), job=composer.job_group() if config.autotune else None)
    numels = {fqn: sum(math.prod(p.shape) for p in params_of[fqn]) for fqn in unit_fqns}
    groups = group_units(unit_fqns, numels, config.min_unit_numel)

    layouts: list[UnitLayout] = []
    parts_of: list[tuple[int, ...]] = []  # per module group (the root's first): its units

    def add_units(members: tuple[str, ...], params: list[ParamInfo]) -> tuple[int, ...]:
        """One unit per dtype of `params` ([Note: one dtype per unit] in units.py)."""
        parts = split_by_dtype(params)
        indices = tuple(range(len(layouts), len(layouts) + len(parts)))
        for index, part in zip(indices, parts):
            label = unit_label(index, members, part[0].dtype if len(parts) > 1 else None, index == indices[0])
            layouts.append(make_layout(index, label, members, part, world_size, CHUNK_ALIGN_NUMEL))
        parts_of.append(indices)
        return indices

    root_units: tuple[int, ...] = add_units(("",), params_of[""]) if params_of[""] else ()
    hooked: list[HookedModules] = []
    for members in groups:
        params = [p for fqn in members for p in params_of[fqn]]
        if not params:
            continue  # its parameters are tied to modules elsewhere and moved up to the root
        hooked.append(HookedModules(tuple(modules[fqn] for fqn in members), add_units(members, params)))

    if device.type == "cpu" and config.cpu_keep_freed_memory:
        process_hooks.keep_freed_cpu_memory()  # [Note: process-wide hooks]

    owner_modules = dict(model.named_modules(remove_duplicate=False))
    # tensor parallelism on the meta device: each rank initializes its own shards, FSDP2's values
    # ([Note: deferred init with tensor parallelism] in init.py); nothing is scattered
    init_on_shards = deferred and pgs.tensor is not None
    shard_source = None if init_on_shards else source
    shards, packing = shard_buffers(owner_modules, layouts, device, shard_source, preallocate=deferred)

    def shard(index: int) -> UnitTensors:
        return shard_unit(
            owner_modules, layouts[index], mesh, rank, config, device, shard_source, shards[index], packing
        )

    def shard_group(group_index: int) -> list[UnitTensors]:  # in unit order: collectives pair
        return [shard(i) for i in parts_of[group_index]]

    # weakly: see guard.py; 0-dim parameters are kept as they are (replicated.py), not replaced
    remember_replaced((n, p) for n, p in model.named_parameters() if not is_replicated(p))

    if init_on_shards:
        units = [shard(i) for i in range(len(layouts))]
        initialize_sharded(model, device, param_init_fn)
        if source is not None:  # HSDP: the replicas of a shard start equal, the source row's
            broadcast_replicas(source, [unit.shard for unit in units])
    elif deferred:
        # materialized per module group, all of whose units (one per dtype) are then sharded
        root_group = 0 if root_units else None
        index_of = {
            fqn: g for g, parts in enumerate(parts_of) if g != root_group for fqn in layouts[parts[0]].module_fqns
        }
        unit_set = set(unit_fqns)

        def group_of_module(fqn: str) -> int | None:
            return index_of.get(unit_of_module(fqn, unit_set))

        params = [[slot.owners[0] for i in parts for slot in layouts[i].slots] for parts in parts_of]
        init_params = source is None or source.is_source
        done = materialize_and_shard(
            model, group_of_module, params, root_group, device, param_init_fn, shard_group, init_params
        )
        units = [unit for parts in done for unit in parts]  # type: ignore[attr-defined]
    else:
        units = [shard(i) for i in range(len(layouts))]
    if source is not None:
        buffers = list(model.buffers())
        if buffers:
            broadcast_tensors(source, buffers)
    state = OverlapState(model, config, pgs, units, root_units, hooked, writes_files)
    teardown.watch(state)  # [Note: quiet exit], [Note: final checks] in late_checks.py
    register_sharded(p for unit in units for p in unit.sharded_params)  # [Note: local optimizer step]
    return state


def _model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise ValueError("overlap.wrap: the model has no parameters to shard")
    if len(devices) > 1:
        where = {}
        for name, p in model.named_parameters():
            where.setdefault(p.device, name)
        raise ValueError(
            "overlap.wrap: parameters are on several devices "
            f"({', '.join(f'{d} (e.g. {n})' for d, n in where.items())}); move the model to one"
        )
    (device,) = devices
    return device


def _default_device(group: dist.ProcessGroup | DeviceMesh | None) -> torch.device:
    if isinstance(group, DeviceMesh):
        return torch.device(group.device_type)
    return backend.default_device(group)


def _source_plan(pgs: Groups, device: torch.device, config: OverlapConfig) -> SourcePlan:
    """Where `sync_module_states` sends every rank's values from: see [Note: sync from the source]."""
    timeout = None if config.collective_timeout_s is None else timedelta(seconds=config.collective_timeout_s)
    return plan_source(pgs.shard, pgs.replicate, pgs.mesh, device, timeout)
