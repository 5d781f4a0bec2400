"""Expert parallelism: experts sharded on their own mesh dimension, in a state of their own.

[Note: expert parallelism]
torchtitan's expert parallelism (ExpertParallel, then apply_fsdp with dp_mod_ep_mesh) places the
experts' stacked weights [num_experts, ...] Shard(0) over an `ep` mesh dimension that is *part of
the data-parallel ranks*: each ep rank holds other tokens, dispatched to the experts' owners by an
all-to-all over ep. The dense parameters are then sharded over all of dp (dp_mod_ep x ep), the
experts over dp_mod_ep only, and the experts' gradients divided by the size of all of dp (FSDP2's
`set_gradient_divide_factor`), since their tokens came from every dp rank.

`wrap(model, group=mesh)` with the whole data-parallel mesh, e.g.
`init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))`: a DTensor parameter whose
mesh dimensions are dimensions of `group` (or whose 1-D mesh is one of them flattened under
another name: torchtitan's `world_mesh["dp_shard_in_ep"]._flatten("ep")`, found by its ranks), one
of the names saying experts (a word "ep", "expert(s)" or "moe" in it), is an expert parameter.
The name decides: a whole (dp, tp) mesh has the same shape, its tp dimension holds tensor-parallel
parameters ([Note: tensor-parallel parameters] in compose.py). Then `wrap` builds two states over
the same module tree, each seeing only its own parameters (`hidden`), FSDP2's two `fully_shard`
meshes as two groups:

- the experts' state, over the other dimensions of `group` (dp_mod_ep), built first: its units are
  found by the config's `unit_policy` among modules that hold expert parameters (with "auto",
  the MoE blocks), so each block's experts are gathered at its forward, resharded after it,
  prefetched and reduce-scattered in buckets of their own, as any unit. Its sharded parameters are
  DTensors on the (dp_mod_ep, ep) mesh with FSDP2's placements (`_StridedShard(0, sf=ep)` over
  dp_mod_ep, `Shard(0)` over ep: the ep dimension is composed as a tp one is, [Note:
  tensor-parallel parameters] in compose.py); its gradients are divided by the size of all of dp
  (`Groups.gradient_divide_factor`); its values come from rank 0 of the rank's own dp_mod_ep group
  (ep rank j keeps ep rank j's experts); its same-model/config checks, collective fingerprints,
  order checks and deferred checks run in that group;
- the model's state, over all of `group` flattened (1-D DTensors on it, as FSDP2's
  `fully_shard(model, mesh=dp)`), holding every other parameter;
- HSDP: a 3-D `group` (dp_replicate, dp_mod_ep, ep) gives the experts' state the 2-D mesh
  (dp_replicate, dp_mod_ep) and the model's (dp_replicate, dp_mod_ep x ep flattened): each shards
  over its second dimension and all-reduces across replicas ([Note: hybrid sharding] in
  groups.py), the experts' gradients divided by the size of all of `group`; `model._overlap_state`, with the
  experts' state in its `experts` (no_sync, set_requires_gradient_sync and the deferred checks
  reach it).

Both states hook the same modules; a bucket holds units of one state, so never two groups. Every
element of a dense or expert gradient lives on exactly one rank of all of dp, so
`clip_grad_norm_`'s one sum of squares over dp counts each once. Full state dicts take the DTensor
path (`full_tensor()`, `distribute_tensor`), which gathers an expert over its own mesh; DCP
checkpoints save the DTensors on their meshes. A step in which some rank routes no token to some
expert computes that expert on an empty batch (zero gradients), or leaves its gradient None
([Note: used flags] in reduction.py): neither skips a collective. Everything else raises at wrap
on every rank (`refusal`, [Note: composition refusals] in compose.py). `step_stats`,
`memory_stats`, the metrics file and the traces report the model's state only (the experts'
state, whose ranks are numbered in its own group, would write over the files of other ranks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from overlap.config import OverlapConfig
from overlap.engine import torch_compat
from overlap.engine.compose import compiled_refusal, names_experts
from overlap.engine.lazy_torch import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

RECIPE = (
    "wrap(model, group=mesh) with the whole data-parallel mesh, e.g. mesh = "
    "init_device_mesh(device, (dp // ep, ep), mesh_dim_names=('dp_mod_ep', 'ep')) and the experts' "
    "stacked weights distribute_tensor(w, mesh['ep'], [Shard(0)])"
)


@dataclass(frozen=True)
class ExpertPlan:
    """How `wrap` splits a model with expert parameters ([Note: expert parallelism])."""

    expert_mesh: DeviceMesh  # the experts': group's other dims (dp_mod_ep; HSDP: dp_replicate, dp_mod_ep)
    dense_mesh: DeviceMesh  # the rest's: all of group flattened (HSDP: dp_replicate, the rest flattened)
    dp_size: int  # the experts' gradient divide factor: the size of all of dp


def _expert_params(model: nn.Module, group: DeviceMesh) -> list[tuple[str, DTensor]]:
    return [(n, p) for n, p in model.named_parameters() if is_expert(p, group)]  # type: ignore[misc]


def is_expert_parallel(model: nn.Module, group: object) -> bool:
    """Whether `model` has expert parameters (`is_expert`) for the mesh `group`."""
    if not isinstance(group, DeviceMesh) or group.mesh_dim_names is None or group.ndim < 2:
        return False
    return bool(_expert_params(model, group))


def _group_dims(param: object, group: DeviceMesh) -> tuple[str, ...]:
    """The dimensions of `group` that `param`'s mesh is on: by their names, or, for a 1-D mesh
    flattened from one of them under another name (torchtitan's
    `mesh["dp_shard_in_ep"]._flatten("ep")`), by its ranks; () for anything else."""
    if not is_dtensor(param):
        return ()
    dims, names = param.device_mesh.mesh_dim_names or (), group.mesh_dim_names or ()
    if dims and set(dims) <= set(names):
        return dims
    if param.device_mesh.ndim == 1 and group.get_coordinate() is not None:
        ranks = dist.get_process_group_ranks(param.device_mesh.get_group())
        return tuple(n for n in names if dist.get_process_group_ranks(group.get_group(n)) == ranks)[:1]
    return ()


def is_expert(param: object, group: DeviceMesh) -> bool:
    """Whether `param` (before wrap) is an expert parameter for the mesh `group`: a DTensor on
    dimensions of `group`, one of them named as experts' ("ep", "dp_shard_in_ep", ...). A
    tensor-parallel dimension of the whole mesh ("tp") is the other case."""
    dims = _group_dims(param, group)
    own = param.device_mesh.mesh_dim_names or () if is_dtensor(param) else ()
    return any(names_experts(n) for n in (*dims, *own)) if dims else False


def refusal(model: nn.Module, group: DeviceMesh, config: OverlapConfig, deferred: bool) -> str | None:
    """Why this expert-parallel model cannot be wrapped over `group`, or None: the mesh, the
    expert parameters, the modules holding them, the rest of the model, then the config."""
    experts = _expert_params(model, group)
    name, first = experts[0]
    where = (
        f"overlap.wrap: parameter {name!r} is an expert DTensor (placements "
        f"{tuple(first.placements)} on mesh dims {first.device_mesh.mesh_dim_names})"
    )
    problem = (
        _mesh_refusal(group, _group_dims(first, group))
        or _params_refusal(experts, group)
        or _modules_refusal(model, experts)
        or compiled_refusal(model, "expert parallelism", "leave the blocks eager")
    )
    if problem is not None:
        return f"{where}, and {problem}"
    if deferred:
        return f"{where} on the meta device: deferred init with expert parallelism is not supported; materialize the model first"
    problem = _config_refusal(config)
    return None if problem is None else f"{where}, and {problem}"


def _mesh_refusal(group: DeviceMesh, ep_dims: tuple[str, ...]) -> str | None:
    names = group.mesh_dim_names or ()
    if group.ndim not in (2, 3) or (group.ndim == 3 and names[-1] not in ep_dims):
        return (
            f"`group` is {group.ndim}-D {names}: expert parallelism is supported on a 2-D "
            "(dp_mod_ep, ep) or a 3-D (dp_replicate, dp_mod_ep, ep) data-parallel mesh (HSDP), the "
            f"ep dimension last; tensor parallelism beside it is not supported yet; {RECIPE}"
        )
    other = [n for n in names if n not in ep_dims]
    if group[other[-1]].size() == 1:
        return (
            "the ep dimension is all of the shard dimension: the experts would not be sharded over "
            "data-parallel ranks (dp_mod_ep of size 1), which is not supported yet; make dp_mod_ep "
            "at least 2, or keep the experts data-parallel"
        )
    return None


def _params_refusal(experts: list[tuple[str, DTensor]], group: DeviceMesh) -> str | None:
    from torch.distributed.tensor import Shard  # loaded: `experts` are DTensors

    ep_dims = _group_dims(experts[0][1], group)
    for fqn, param in experts:
        mesh = param.device_mesh
        if _group_dims(param, group) != ep_dims:
            return f"expert parameter {fqn!r} is on mesh dims {mesh.mesh_dim_names}: put every expert weight on the same ep dimension"
        if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
            return (
                f"expert parameter {fqn!r} has placements {tuple(param.placements)} on mesh dims "
                f"{mesh.mesh_dim_names}: only Shard(0) over one ep dimension (stacked experts "
                f"[num_experts, ...], torchtitan's ExpertParallel) is supported; {RECIPE}"
            )
        if param.shape[0] % mesh.size() != 0:
            return f"expert parameter {fqn!r} has {param.shape[0]} experts, not a multiple of the {mesh.size()} ep ranks; pad the experts"
    return None


def _modules_refusal(model: nn.Module, experts: list[tuple[str, DTensor]]) -> str | None:
    modules = dict(model.named_modules())
    expert_ids = {id(p) for _, p in experts}
    owners = sorted({fqn.rpartition(".")[0] for fqn, _ in experts})
    for owner in owners:
        if owner == "":
            return "expert parameters held by the root module are not supported; hold them in an experts submodule"
        other = next((n for n, p in modules[owner].named_parameters() if id(p) not in expert_ids), None)
        if other is not None:
            return (
                f"module {owner!r} holds expert parameters and {other!r}, which is not one (a plain "
                "or tensor-parallel parameter): an experts module must hold only expert weights; "
                "move the others to a sibling module"
            )
        nested = next((o for o in owners if o != owner and o.startswith(owner + ".")), None)
        if nested is not None:
            return f"expert modules {owner!r} and {nested!r} nest; hold the expert weights in sibling modules"
    plain = next(((n, p) for n, p in model.named_parameters() if is_dtensor(p) and id(p) not in expert_ids), None)
    if plain is not None:
        return (
            f"parameter {plain[0]!r} is a DTensor on mesh dims {plain[1].device_mesh.mesh_dim_names}, "
            f"not of `group`: tensor parallelism beside expert parallelism is not supported yet; {RECIPE}"
        )
    return None


def _config_refusal(config: OverlapConfig) -> str | None:
    """The settings not verified with expert parallelism: each raises instead of running untested."""
    unverified = {
        "param_compression": config.param_compression is not None,
        "grad_compression": config.grad_compression is not None,
        "autotune": bool(config.autotune),
        "hybrid_mode='secondary'": config.hybrid_mode == "secondary",
    }
    named = [name for name, on in unverified.items() if on]
    if not named:
        return None
    return (
        f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} not supported with expert "
        "parallelism yet (each state would compress or tune on its own group, unverified); "
        "leave the default"
    )


def plan(model: nn.Module, group: DeviceMesh) -> ExpertPlan:
    """The plan for a model `refusal` accepted."""
    experts = _expert_params(model, group)
    ep_dims = _group_dims(experts[0][1], group)
    other = tuple(n for n in group.mesh_dim_names or () if n not in ep_dims)
    if group.ndim == 2:
        return ExpertPlan(group[other], torch_compat.flatten(group, "EP"), group.size())
    # HSDP: (dp_replicate, dp_mod_ep x ep flattened) for the rest, (dp_replicate, dp_mod_ep) for
    # the experts; both replicated over dp_replicate ([Note: hybrid sharding] in groups.py)
    shard = torch_compat.flatten(group[(other[-1], *ep_dims)], "EP")
    return ExpertPlan(group[other], torch_compat.concatenate([group[other[0]], shard], "EP"), group.size())


@contextlib.contextmanager
def hidden(model: nn.Module, hide: Callable[[nn.Parameter], bool]) -> Iterator[None]:
    """`model` without the parameters `hide` selects while one state wraps it: each state sees
    only its own ([Note: expert parallelism]). What wrap swaps in stays; the order is kept."""
    saved = [(m, dict(m._parameters)) for m in model.modules()]
    for m, params in saved:
        for name, param in params.items():
            if param is not None and hide(param):
                del m._parameters[name]
    try:
        yield
    finally:
        for m, params in saved:
            now = dict(m._parameters)
            m._parameters.clear()
            m._parameters.update({name: now.get(name, param) for name, param in params.items()})
