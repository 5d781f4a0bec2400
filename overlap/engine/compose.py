"""Composition with tensor parallelism: parameters that arrive as DTensors placed over a tensor-
parallel mesh dimension are sharded over the data-parallel dimension of the same mesh.

[Note: tensor-parallel parameters]
`parallelize_module(block, mesh["tp"], plan)` leaves each parameter a DTensor on the tp mesh,
with one placement (Shard(d) or Replicate()). `wrap(model, group=mesh["dp"])` (or the whole mesh:
its dimensions the parameters do not use are the data-parallel ones) shards each such parameter's
*local tensor* over dp exactly as it shards a plain parameter ([Note: flat layout] in units.py):
the unit's flat buffers, collectives, codecs and schedule never see a DTensor. Only three places
do, as FSDP2's `FSDPParam` does (torch/distributed/fsdp/_fully_shard/_fsdp_param.py):

- the sharded parameter the optimizer sees: a DTensor on the concatenated (dp, tp) mesh, with dp
  placement Shard(0), or `_StridedShard(0, split_factor=tp shards on dim 0)` when tensor
  parallelism shards dim 0 too (the dp rows are cut from the tp rows: FSDP2's placements, so
  `full_tensor()`, DCP and the optimizer state are those of FSDP2); under HSDP x TP (a 2-D
  data-parallel part, `group=mesh["rep", "dp"]` or the whole 3-D mesh) the mesh is (replicate,
  dp, tp) and Replicate() comes first, and under hpZ x TP (`hybrid_mode="secondary"`) it is
  (flattened (replicate, dp), tp) ([Note: hybrid sharding] in groups.py);
- the unsharded parameter forward uses: a DTensor on the tp mesh with the parameter's own
  placement, whose local tensor is the view of the unit's unsharded buffer (the all-gather over
  dp of the local shards);
- its gradient, which autograd leaves as a DTensor (a Replicate() parameter's may be Partial()):
  redistributed to the parameter's placement, then its local tensor is reduce-scattered over dp
  (`grad_data`, FSDP2's `_get_grad_inner_tensor`).

torchtitan's order works as with FSDP2: a model built on the meta device and made tensor-parallel
there is sharded first, then initialized on its shards by every rank, to FSDP2's values ([Note:
deferred init with tensor parallelism] in init.py); blocks compiled per block
(`torch.compile(block)`, `block.compile()`) trace their forward over the unsharded DTensors the
hooks swap in, as under FSDP2, with no recompile per step (tests/parity/test_compose_meta_compile.py).

Plain parameters of such a model (a norm, a head) are sharded over dp as always (1-D DTensors on
the dp mesh, FSDP2's too). Whatever this does not cover raises at wrap on every rank, naming the
parameter ([Note: composition refusals]). Expert parallelism is wrap's, before this module:
[Note: expert parallelism] in experts.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from overlap.engine import torch_compat
from overlap.engine.actions import order_hash
from overlap.engine.lazy_torch import is_dtensor
from overlap.transport import collectives as comm

if TYPE_CHECKING:  # DTensorSpec at run time through torch_compat: [Note: private torch APIs] there
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel parameter as wrap found it, and the specs overlap gives it."""

    spec: DTensorSpec  # the parameter's own: tp mesh, placement, global shape, stride and dtype
    sharded_spec: DTensorSpec  # the optimizer's DTensor: (dp, tp) mesh with FSDP2's placements

    @property
    def local_shape(self) -> torch.Size:
        """The shape of this rank's tensor-parallel local tensor: what overlap shards over dp."""
        assert self.spec.tensor_meta is not None
        return torch_compat.local_shape(self.spec.tensor_meta.shape, self.spec.mesh, self.spec.placements)

    def sharded(self, local: torch.Tensor) -> DTensor:
        """The optimizer's DTensor over this rank's rows of the tp local tensor."""
        return torch_compat.dtensor(local, self.sharded_spec)

    def unsharded(self, local: torch.Tensor) -> DTensor:
        """Forward's DTensor on the tp mesh over the gathered local tensor (of the gather dtype)."""
        return torch_compat.dtensor(local, _with_dtype(self.spec, local.dtype))


def _with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    meta = spec.tensor_meta
    assert meta is not None
    if meta.dtype == dtype:
        return spec
    meta = torch_compat.tensor_meta(meta.shape, meta.stride, dtype)
    return torch_compat.dtensor_spec(spec.mesh, spec.placements, meta)


def grad_data(
    params: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    sum_over: Callable[[torch.Tensor, dist.ProcessGroup], None],
) -> list[torch.Tensor | None]:
    """The plain gradients a reduction copies in for `params` (unsharded parameters): a DTensor
    gradient redistributed to its parameter's placement, then its local tensor ([Note:
    tensor-parallel parameters]); a plain gradient as it is.

    A Partial() gradient of a Replicate() parameter (a norm's under SequenceParallel) is summed
    over tp with the bucket's others of its mesh and dtype: one flat buffer, one all-reduce per
    mesh dimension by `sum_over` (the transport's, on its reduce stream), where a redistribute
    each would issue one all-reduce per parameter on the compute stream. Every tp rank has the
    same Partial() gradients in the same order, so their all-reduces match."""
    out: list[torch.Tensor | None] = []
    partial: dict[tuple[DeviceMesh, tuple[int, ...], torch.dtype], list[int]] = {}
    for i, (param, grad) in enumerate(zip(params, grads)):
        if not is_dtensor(grad):
            out.append(grad)
            continue
        placements = param.placements  # type: ignore[attr-defined]
        if grad.placements != placements:
            dims = _summed_dims(grad.placements, placements)
            if dims is None:
                grad = grad.redistribute(param.device_mesh, placements)  # type: ignore[attr-defined]
            else:
                partial.setdefault((grad.device_mesh, dims, grad.dtype), []).append(i)
        out.append(grad._local_tensor)
    for (mesh, dims, _), members in partial.items():
        locals_ = [out[i] for i in members]
        flat = torch.cat([t.reshape(-1) for t in locals_])  # type: ignore[union-attr]
        for dim in dims:
            sum_over(flat, mesh.get_group(dim))
        for i, t, summed in zip(members, locals_, flat.split([t.numel() for t in locals_])):  # type: ignore[union-attr]
            out[i] = summed.view(t.shape)  # type: ignore[union-attr]
    return out


def _summed_dims(have: tuple, want: tuple) -> tuple[int, ...] | None:
    """The mesh dimensions a sum turns `have` into `want` on (Partial("sum") -> Replicate()), or
    None where another redistribution is needed too."""
    dims = []
    for dim, (h, w) in enumerate(zip(have, want)):
        if h == w:
            continue
        if not (h.is_partial() and h.reduce_op == "sum" and w.is_replicate()):
            return None
        dims.append(dim)
    return tuple(dims)


def data_parallel_mesh(
    group: dist.ProcessGroup | DeviceMesh | None, model: nn.Module
) -> dist.ProcessGroup | DeviceMesh | None:
    """`group` as `resolve_groups` takes it: a mesh whose named dimensions include those of the
    model's DTensor parameters becomes its other dimensions (the data-parallel ones); anything
    else is returned as it is (and refused by `refusal` where it does not fit)."""
    if not isinstance(group, DeviceMesh) or group.mesh_dim_names is None or group.ndim < 2:
        return group
    used: set[str] = set()
    for _, param in _dtensor_params(model):
        names = param.device_mesh.mesh_dim_names
        if names is None:
            return group
        used.update(names)
    names = group.mesh_dim_names
    if not used or not used < set(names):
        return group
    return group[tuple(n for n in names if n not in used)]


def _dtensor_params(model: nn.Module) -> list[tuple[str, DTensor]]:
    return [(n, p) for n, p in model.named_parameters() if is_dtensor(p)]


def _describe(param: DTensor) -> str:
    mesh = param.device_mesh
    return f"placements {tuple(param.placements)} on mesh dims {mesh.mesh_dim_names} of shape {tuple(mesh.shape)}"


# [Note: composition refusals]
# Every combination not covered by [Note: tensor-parallel parameters] raises at wrap, before
# anything is sharded, and on every rank with the same message: the verdict is computed on each
# rank from the model and the group, then agreed over the data-parallel group and the
# parameters' mesh dimensions (`agree`), so a rank whose peers refuse refuses too, instead of
# entering a collective they will never join (the SIGSEGV on two ranks and
# CollectiveError on the other two).
_RECIPE = "wrap(model, group=mesh['dp']) after parallelize_module(block, mesh['tp'], plan)"


def refusal(model: nn.Module, group: dist.ProcessGroup | DeviceMesh | None) -> str | None:
    """Why overlap cannot shard this model's DTensor parameters over `group` (as
    `data_parallel_mesh` returned it), or None when it can (or when there are none)."""
    params = _dtensor_params(model)
    if not params:
        return None
    for name, param in params:  # before the group's kind: no group makes it work
        problem = _expert_refusal(param, None)
        if problem is not None:
            return f"overlap.wrap: parameter {name!r} is a DTensor ({_describe(param)}): {problem}"
    name, first = params[0]
    where = f"parameter {name!r} is a DTensor ({_describe(first)})"
    if not isinstance(group, DeviceMesh):
        return (
            f"overlap.wrap: {where}, and `group` is {'None' if group is None else 'a ProcessGroup'}: "
            "overlap shards tensor-parallel parameters over the data-parallel dimension of their "
            f"own mesh; pass that dimension, as in {_RECIPE}"
        )
    dp_mesh = group
    for name, param in params:
        problem = _param_refusal(param, dp_mesh)
        if problem is not None:
            return f"overlap.wrap: parameter {name!r} is a DTensor ({_describe(param)}): {problem}"
    other = next(((n, p) for n, p in params if p.device_mesh != first.device_mesh), None)
    if other is not None:
        return (
            f"overlap.wrap: {where}, and parameter {other[0]!r} is one on another mesh "
            f"({_describe(other[1])}): tensor-parallel parameters on several meshes are not "
            "supported yet; place them over one tp dimension"
        )
    if dp_mesh.ndim > 2:
        return (
            f"overlap.wrap: {where}, and the data-parallel part of `group` is {dp_mesh.ndim}-D "
            f"{dp_mesh.mesh_dim_names}: overlap shards over one data-parallel dimension, or two "
            f"(replicate, shard: HSDP x TP), as in {_RECIPE}"
        )
    return None


# Expert parallelism ([Note: expert parallelism] in experts.py) is recognized in `wrap` before
# this module sees the model: a DTensor parameter on dimensions of the mesh passed as `group` is an
# expert one. What reaches `_expert_refusal` is expert parallelism given another group: the
# dp_mod_ep dimension alone (the dense gradients would not be reduced over ep: with it bypassed,
# one SGD step on a (2, 2) mesh left the ep ranks' dense weights different, without an error), all
# of dp flattened (the ep ranks inside it), or no group. It is refused by the dimension's name
# (torchtitan's "ep", "dp_shard_in_ep", anything naming experts) and, whatever the names, by a
# parameter mesh that is a part of the data-parallel ranks (tensor parallelism is orthogonal to
# dp: the two groups share this rank only); the message says which group to pass instead.
_EXPERT_DIM_WORDS = ("ep", "expert", "experts", "moe")
_EXPERT_INSTEAD = (
    "for expert parallelism pass the whole data-parallel mesh, both its dimensions, as in "
    "wrap(model, group=init_device_mesh(device, (dp // ep, ep), mesh_dim_names=('dp_mod_ep', 'ep'))) "
    "([Note: expert parallelism] in overlap/engine/experts.py); or keep the experts "
    "data-parallel (plain stacked parameters) and wrap over all of dp"
)


def names_experts(dim_name: str) -> bool:
    """Whether a mesh dimension's name says experts: "ep", "dp_shard_in_ep", "experts", "moe"."""
    return bool(set(dim_name.lower().split("_")) & set(_EXPERT_DIM_WORDS))


def _expert_refusal(param: DTensor, dp_mesh: DeviceMesh | None) -> str | None:
    """Why `param` looks expert-parallel ([Note: expert parallelism]), or None: by its mesh
    dimensions' names, and with `dp_mesh`, by its mesh being a part of the data-parallel ranks."""
    names = param.device_mesh.mesh_dim_names or ()
    named = [n for n in names if names_experts(n)]
    if named:
        return (
            f"expert parallelism (mesh dimension {named[0]!r}) over this group is not supported: "
            f"the dense parameters' gradients would not be reduced over {named[0]!r}, or the "
            f"experts would be sharded over ranks that hold other experts; {_EXPERT_INSTEAD}"
        )
    if dp_mesh is None:
        return None
    own = set(param.device_mesh.mesh.flatten().tolist())  # once, at wrap; the mesh tensor lives on the CPU
    if len(own) > 1 and own < set(dp_mesh.mesh.flatten().tolist()):
        return (
            f"its mesh dimensions {names} hold other ranks of the data-parallel group, as expert "
            "parallelism over data-parallel ranks does, which is not supported over this group "
            "(tensor parallelism must be orthogonal to data parallelism: the two groups share one "
            f"rank); {_EXPERT_INSTEAD}"
        )
    return None


def compiled_refusal(model: nn.Module, parallelism: str, instead: str) -> str | None:
    """Why a compiled module of `model` is refused beside `parallelism`, or None without one."""
    compiled = next((n for n, m in model.named_modules() if is_compiled(m)), None)
    if compiled is None:
        return None
    return (
        f"module {compiled or '<root>'!r} is compiled (torch.compile / module.compile()): not "
        f"verified with {parallelism} yet; {instead}"
    )


def is_compiled(module: nn.Module) -> bool:
    """`module.compile()` sets `_compiled_call_impl`; `torch.compile(module)` wraps it in a module
    holding the original as `_orig_mod`."""
    return getattr(module, "_compiled_call_impl", None) is not None or getattr(module, "_orig_mod", None) is not None


def _param_refusal(param: DTensor, dp_mesh: DeviceMesh) -> str | None:
    from torch.distributed.tensor import Replicate, Shard  # loaded: `param` is a DTensor

    mesh, placements = param.device_mesh, param.placements
    if mesh.mesh_dim_names is None or dp_mesh.mesh_dim_names is None:
        return (
            "overlap needs named mesh dimensions to tell data from tensor parallelism; build the "
            "mesh with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    shared = set(mesh.mesh_dim_names) & set(dp_mesh.mesh_dim_names)
    if shared:
        return (
            f"it is already distributed over the data-parallel dimension {sorted(shared)} that "
            "overlap shards over (fully_shard or distribute_tensor on it?); give overlap the plain "
            "or tensor-parallel parameter and let it shard over dp"
        )
    if mesh.ndim != 1:
        return (
            f"only 1-D tensor parallelism is supported, not a {mesh.ndim}-D placement; place it over one tp dimension"
        )
    (placement,) = placements
    if type(placement) not in (Shard, Replicate):
        return (
            f"placement {placement} is not supported (only Shard(d) and Replicate()); "
            "redistribute the parameter to Shard or Replicate before wrap"
        )
    if param.dim() == 0:
        return "a 0-dim tensor-parallel parameter is not supported; make it a plain tensor"
    if isinstance(placement, Shard) and param.shape[placement.dim] % mesh.size() != 0:
        return (
            f"dim {placement.dim} of size {param.shape[placement.dim]} is sharded unevenly over "
            f"{mesh.size()} tp ranks, which overlap does not support; pad it to a multiple"
        )
    problem = _expert_refusal(param, dp_mesh)
    if problem is not None:
        return problem
    try:
        torch_compat.concatenate([dp_mesh, mesh], "TP")
    except RuntimeError as error:
        return (
            f"its mesh and the data-parallel mesh {dp_mesh.mesh_dim_names} do not form one mesh "
            f"({error}); take both from the same init_device_mesh, as in {_RECIPE}"
        )
    return None


class Composer:
    """Builds each DTensor parameter's `TensorParallel` for one `dp_mesh` (one concatenated mesh
    per tp mesh)."""

    def __init__(self, dp_mesh: DeviceMesh) -> None:
        self.dp_mesh = dp_mesh
        self._meshes: dict[DeviceMesh, DeviceMesh] = {}  # tp mesh (by value) -> the (dp, tp) mesh

    def __call__(self, param: torch.Tensor) -> TensorParallel | None:
        if not is_dtensor(param):
            return None
        from torch.distributed.tensor import Replicate, Shard  # [Note: import cost] in lazy_torch.py

        spec = param._spec
        spmd_mesh = self._meshes.get(spec.mesh)
        if spmd_mesh is None:
            spmd_mesh = self._meshes[spec.mesh] = torch_compat.concatenate([self.dp_mesh, spec.mesh], "TP / EP")
        split = spec.num_shards_map[0]
        dp_placement = torch_compat.strided_shard(0, split, "TP / EP") if split > 1 else Shard(0)
        replicas = (Replicate(),) * (self.dp_mesh.ndim - 1)  # HSDP x TP: (replicate, shard, tp)
        placements = (*replicas, dp_placement, *spec.placements)
        sharded = torch_compat.dtensor_spec(spmd_mesh, placements, spec.tensor_meta)
        return TensorParallel(spec, sharded)

    def job_group(self) -> dist.ProcessGroup | None:
        """The data- and tensor-parallel ranks together (the (dp, tp) mesh flattened), None without
        tensor parallelism. Collective over them at the first call: at wrap, on every rank."""
        if not self._meshes:
            return None
        (spmd_mesh,) = self._meshes.values()
        return torch_compat.flatten(spmd_mesh, "TP").get_group()

    def tensor_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel group of the parameters (one tp mesh), None without any."""
        assert len(self._meshes) <= 1, f"rank {dist.get_rank()}: parameters on several tp meshes {list(self._meshes)}"
        return next((tp.get_group() for tp in self._meshes), None)


def agree(
    problem: str | None, model: nn.Module, group: dist.ProcessGroup | DeviceMesh | None, device: torch.device
) -> None:
    """Raise `problem` on every rank, or a disagreement on every rank whose peers differ
    ([Note: composition refusals]); nothing when every rank has none. Runs before
    `resolve_groups`, which may itself enter collectives that only an agreed group can pair.

    The verdict's hash is gathered over `group` (each dimension of a mesh), then the hash of
    what was gathered over each dimension of the first DTensor parameter's mesh: as in a
    hierarchical all-reduce, every rank of the (dp, tp) grid sees every rank's verdict folded
    in, so all take the same branch."""
    params = _dtensor_params(model)
    if not params:
        return  # no DTensor: nothing was refused, nothing new to agree on
    if isinstance(group, DeviceMesh):
        stages = [group.get_group(dim) for dim in range(group.ndim)]
    else:
        stages = [group if group is not None else dist.group.WORLD]
    mesh = params[0][1].device_mesh
    if mesh.get_coordinate() is not None:
        stages += [mesh.get_group(dim) for dim in range(mesh.ndim)]
    summary = order_hash((problem or "",))
    seen = []
    for stage in stages:
        hashes = comm.all_gather_int(summary, stage, device)  # type: ignore[arg-type]
        seen.append(hashes)
        summary = order_hash(tuple(hashes))
    if all(len(set(h)) == 1 for h in seen):
        if problem is not None:
            raise ValueError(problem)
        return
    raise ValueError(
        "overlap.wrap: ranks disagree on whether this tensor-parallel model can be wrapped "
        f"(verdict hashes {seen}); on rank {dist.get_rank()}: {problem or 'supported'}. Build the "
        "same model, mesh and config on every rank."
    )
