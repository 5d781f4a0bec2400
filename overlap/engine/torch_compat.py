"""The private torch APIs the engine uses, each behind one function, and a probe of all of them.

[Note: private torch APIs]
Hybrid sharding on a 2-D mesh (HSDP, hpZ), tensor parallelism (TP) and expert parallelism
(EP) build meshes and DTensors the way FSDP2 does, through torch APIs that are not public: the
DeviceMesh methods `_concatenate`, `_flatten` and `_get_root_mesh`, the `_StridedShard`
placement, `DTensorSpec` and `TensorMeta`, `compute_local_shape_and_global_offset` and the
`DTensor(local, spec, requires_grad=...)` constructor. Their call sites go through the functions
here (the constructor's in compose.py; reduction.py and local_step.py call it directly, and the
engine reads DTensor's `_local_tensor` and `_spec` attributes, which `probe` checks), so one module
holds what the engine assumes of torch, and a torch that lacks an API fails at wrap with
`UnsupportedTorchError` naming the torch version, the API and the feature that needs it, not with
an AttributeError deep inside a mesh method.

The call shapes used here are those of torch 2.11, 2.13 and 2.14, identical in the three (read
from each release's sources; 2.13 is the one the tests run on): `DeviceMesh._concatenate(list)`
(static), `mesh._flatten(mesh_dim_name=None, backend_override=None)`, `mesh._get_root_mesh()`,
`_StridedShard(dim, *, split_factor)` (2.13 also takes `sf=`), `DTensorSpec(mesh, placements,
tensor_meta=...)` with `num_shards_map`, `TensorMeta(shape, stride, dtype)`,
`compute_local_shape_and_global_offset(global_shape, mesh, placements)`. What changed between
them is inside DeviceMesh (by 2.13 `_concatenate` builds the mesh on another layout type, and
`_flatten` returns the copy the root mesh keeps): `_concatenate` still raises RuntimeError for
meshes of different roots, which `refusal` in compose.py relies on. `SUPPORTED_TORCH` is the range in
pyproject.toml; `probe()` checks every shape without a process group, for an environment record.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

SUPPORTED_TORCH = ">=2.11,<2.15"  # the dependency in pyproject.toml: keep the two equal

Feature = Literal["HSDP", "TP", "EP", "TP / EP"]  # what needs the API, for the error
_FEATURES: dict[Feature, str] = {
    "HSDP": "hybrid sharding on a 2-D mesh (HSDP / hpZ)",
    "TP": "tensor parallelism",
    "EP": "expert parallelism",
    "TP / EP": "tensor or expert parallelism",
}

_MESH = "torch.distributed.device_mesh"
_SPEC = "torch.distributed.tensor._dtensor_spec"
_PLACEMENTS = "torch.distributed.tensor.placement_types"
_UTILS = "torch.distributed.tensor._utils"
_TENSOR = "torch.distributed.tensor"


class UnsupportedTorchError(ImportError):
    """The installed torch lacks a private API the engine needs, or spells it another way."""


@functools.cache
def _attr(module: str, name: str) -> Any:
    """`module.name`, looked up once (the DTensor constructor runs at every forward)."""
    return getattr(importlib.import_module(module), name)


def _has_params(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    inspect.signature(fn).bind(*args, **kwargs)  # TypeError where the call shape differs


def _expect(holds: bool, what: str) -> None:
    if not holds:
        raise TypeError(what)


def _check_concatenate() -> None:
    mesh_class = _attr(_MESH, "DeviceMesh")
    _expect(isinstance(inspect.getattr_static(mesh_class, "_concatenate"), staticmethod), "not a staticmethod")
    _has_params(mesh_class._concatenate, [])


def _check_flatten() -> None:
    _has_params(_attr(_MESH, "DeviceMesh")._flatten, None)


def _check_root_mesh() -> None:
    _has_params(_attr(_MESH, "DeviceMesh")._get_root_mesh, None)


def _check_strided_shard() -> None:
    placement = _attr(_PLACEMENTS, "_StridedShard")(0, split_factor=2)
    _expect((placement.dim, placement.split_factor) == (0, 2), f"made {placement!r}")


def _check_spec() -> None:
    spec_class = _attr(_SPEC, "DTensorSpec")
    fields = [f.name for f in dataclasses.fields(spec_class)]
    _expect(fields[:3] == ["mesh", "placements", "tensor_meta"], f"fields {fields}")
    _expect(isinstance(inspect.getattr_static(spec_class, "num_shards_map"), property), "no num_shards_map")


def _check_meta() -> None:
    fields = _attr(_SPEC, "TensorMeta")._fields
    _expect(fields == ("shape", "stride", "dtype"), f"fields {fields}")


def _check_local_shape() -> None:
    _has_params(_attr(_UTILS, "compute_local_shape_and_global_offset"), (2,), None, ())


def _check_dtensor() -> None:
    dtensor = _attr(_TENSOR, "DTensor")
    # 2.11-2.14 make `DTensor.__new__` the C constructor (cls, local, spec, *, requires_grad),
    # which has no signature to read; anything else must bind that call
    if dtensor.__new__ is not getattr(torch.Tensor, "_dtensor__new__", None):
        _has_params(dtensor.__new__, dtensor, torch.empty(0), None, requires_grad=False)
    missing = {"_local_tensor", "_spec"} - set(inspect.get_annotations(dtensor))
    _expect(not missing, f"no {sorted(missing)} attribute")


# API -> the check of its call shape: `probe` runs them all; each function below runs the one it
# needs, once per process.
_CHECKS: dict[str, Callable[[], None]] = {
    "DeviceMesh._concatenate": _check_concatenate,
    "DeviceMesh._flatten": _check_flatten,
    "DeviceMesh._get_root_mesh": _check_root_mesh,
    "_StridedShard(split_factor=)": _check_strided_shard,
    "DTensorSpec": _check_spec,
    "TensorMeta": _check_meta,
    "compute_local_shape_and_global_offset": _check_local_shape,
    "DTensor(local, spec, requires_grad=)": _check_dtensor,
}

# Private torch APIs used elsewhere in overlap, outside distributed (their call sites spell them
# directly): recorded by `probe` by name only.
_OTHERS = (
    "torch._foreach_norm",
    "torch._foreach_mul_",
    "torch._amp_foreach_non_finite_check_and_unscale_",
    "torch.autograd._unsafe_preserve_version_counter",
    "torch.utils._pytree.tree_flatten",
    "torch._dynamo.eval_frame.OptimizedModule",
    "torch.cuda._get_nvml_device_index",
)


@functools.cache
def _problem(api: str) -> str | None:
    """Why `api` cannot be used as the engine calls it on this torch, or None."""
    try:
        _CHECKS[api]()
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _require(api: str, feature: Feature) -> None:
    problem = _problem(api)
    if problem is not None:
        raise UnsupportedTorchError(
            f"overlap: {_FEATURES[feature]} ({feature}) needs torch's private {api}, which torch "
            f"{torch.__version__} lacks or spells another way ({problem}); overlap supports torch "
            f"{SUPPORTED_TORCH} (pyproject.toml): install a torch in that range, or leave "
            f"{feature} out"
        )


def probe() -> dict[str, str]:
    """Every private torch API overlap uses: "ok", or why it is missing ("missing: ..."). Needs
    no process group and never raises: for an environment record."""
    record = {api: "ok" if _problem(api) is None else f"missing: {_problem(api)}" for api in _CHECKS}
    for path in _OTHERS:
        module, _, name = path.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
            record[path] = "ok"
        except (ImportError, AttributeError) as error:
            record[path] = f"missing: {type(error).__name__}: {error}"
    return record


# ------------------------------------------------------------------- one function per API


def concatenate(meshes: list[Any], feature: Feature) -> Any:
    """The mesh of `meshes`' dimensions side by side (all slices of one root mesh); RuntimeError
    where they are not (different roots, overlapping dimensions)."""
    _require("DeviceMesh._concatenate", feature)
    return _attr(_MESH, "DeviceMesh")._concatenate(meshes)


def flatten(mesh: Any, feature: Feature) -> Any:
    """`mesh`'s dimensions as one (a 1-D mesh of the same root, its group made together with
    those of the other slices: collective over the root's ranks at the first call)."""
    _require("DeviceMesh._flatten", feature)
    return mesh._flatten()


def root_mesh(mesh: Any, feature: Feature) -> Any:
    """The mesh `mesh` was sliced from (itself when it is whole)."""
    _require("DeviceMesh._get_root_mesh", feature)
    return mesh._get_root_mesh()


def strided_shard(dim: int, split_factor: int, feature: Feature) -> Any:
    """FSDP2's placement for rows cut from rows another mesh dimension already cut
    ([Note: tensor-parallel parameters] in compose.py)."""
    _require("_StridedShard(split_factor=)", feature)
    return _attr(_PLACEMENTS, "_StridedShard")(dim, split_factor=split_factor)


def tensor_meta(shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> Any:
    """A DTensor's global shape, stride and dtype, as DTensorSpec holds them."""
    _require("TensorMeta", "TP / EP")
    return _attr(_SPEC, "TensorMeta")(shape, stride, dtype)


def dtensor_spec(mesh: Any, placements: Sequence[Any], meta: Any) -> Any:
    """The spec of a DTensor on `mesh` with `placements` and global metadata `meta`."""
    _require("DTensorSpec", "TP / EP")
    return _attr(_SPEC, "DTensorSpec")(mesh, tuple(placements), tensor_meta=meta)


def local_shape(global_shape: torch.Size, mesh: Any, placements: Sequence[Any]) -> torch.Size:
    """The shape of this rank's local tensor of a DTensor of `global_shape` on `mesh`."""
    _require("compute_local_shape_and_global_offset", "TP / EP")
    shape, _ = _attr(_UTILS, "compute_local_shape_and_global_offset")(global_shape, mesh, placements)
    return torch.Size(shape)


def dtensor(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor over `local` with `spec`, without autograd history or communication (FSDP2's
    `_from_local_no_grad`)."""
    _require("DTensor(local, spec, requires_grad=)", "TP / EP")
    return _attr(_TENSOR, "DTensor")(local, spec, requires_grad=False)


def symmetric_memory() -> Any:
    """`torch.distributed._symmetric_memory` (CUDA builds): the pool and rendezvous the
    symmetric-memory all-gather allocates its outputs with (overlap/transport/symm_mem.py, which
    the engine hands this accessor: the transport reaches no private torch module itself)."""
    return importlib.import_module("torch.distributed._symmetric_memory")
