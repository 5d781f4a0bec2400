"""torchtitan's Trainer with `overlap.wrap` as its data-parallel step (torchtitan 0.3).

One line in a config function, run by torchtitan's own entry point
(`torchrun -m torchtitan.train --module my_configs --config llama3_8b_overlap ...`):

    from torchtitan.models.llama3.config_registry import llama3_8b
    from overlap.integrations.torchtitan import use_overlap

    def llama3_8b_overlap():
        return use_overlap(llama3_8b())        # OverlapConfig overrides as keywords, if any

or one import in a parallelize function of one's own, in place of torchtitan's:

    from overlap.integrations.torchtitan import apply_overlap_to_decoder as apply_fsdp_to_decoder

[Note: torchtitan's data-parallel step]
Every torchtitan 0.3 decoder (llama3, qwen3, deepseek_v3, gpt_oss, ...) is made data parallel by
one call, `torchtitan.distributed.fsdp.apply_fsdp_to_decoder`, from the model's `parallelize_fn`
(after tensor/expert parallelism, activation checkpointing and per-block compile; per pipeline
stage under pipeline parallelism). `use_overlap` replaces the config's `model_spec` by a copy whose
`parallelize_fn` runs the original with that one call redirected to `apply_overlap_to_decoder`
(the modules of torchtitan that hold it, for the duration of the call), and whose `pipelining_fn`
builds overlap's pipeline stages (gradients reduced once per step, FSDP2's arithmetic: [Note:
gradients reduced once per pipeline step] in pipelining.py; the gradients torch's shape inference
leaves on the first step are dropped, as torch drops FSDP2's). A parallelize function that calls
FSDP2's `fully_shard` anywhere else is refused after it returns.

`apply_overlap_to_decoder` takes `apply_fsdp_to_decoder`'s arguments and maps them:
- the units: each transformer block of `model.layers` (a ModuleDict) and `tok_embeddings`, as
  FSDP2's `fully_shard` calls; `norm` and `lm_head` stay in the root unit;
- `param_dtype`, `reduce_dtype`: the same fields of OverlapConfig;
- `reshard_after_forward_policy`: "always" and "never" set `reshard_after_forward`; "default" is
  FSDP2's (reshard unless pipeline parallel); only the last unit is kept gathered for backward
  (`keep_for_backward_bytes=0`), as FSDP2 keeps its root;
- the gradient divide factor: 1 (gradients summed over data-parallel ranks), as torchtitan sets on
  FSDP2: its loss is divided by the global token count;
- `ep_degree > 1` with `edp_mesh`: the (dp_mod_ep, ep) mesh of `edp_mesh` and the experts' `ep`
  mesh ([Note: expert parallelism] in engine/experts.py); the model is materialized (`to_empty`)
  before the wrap, since deferred init with expert parallelism is not supported;
- `dp_mesh_dims` (`spmd_backend` "spmd_types" / "full_dtensor"): taken when the storage mesh is
  data parallel only and every parameter a plain tensor (spmd_types without tensor, context or
  expert parallelism); refused otherwise, on every rank, naming `--parallelism.spmd_backend
  partial_dtensor`;
- `cpu_offload` is refused (overlap keeps parameters on their device); `enable_symm_mem` is ignored
  with a warning (FSDP2's CUDA symmetric memory; overlap picks its transport at wrap).
Init fits the Trainer's flow: the meta model is sharded without being initialized
(`sync_module_states=False`, a no-op `param_init_fn`); the Trainer's `to_empty` is then a no-op on
the wrapped model and its `init_weights` writes into the shards, giving FSDP2's initial values.

torchtitan is imported when these functions run, never by `import overlap`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.distributed.tensor import DTensor

import overlap
from overlap.engine import torch_compat
from overlap.integrations.pipelining import PipelineStage as _OverlapPipelineStage

SPMD_BACKEND_FIX = "--parallelism.spmd_backend partial_dtensor"


def use_overlap(config: Any, **overrides: Any) -> Any:
    """torchtitan's `Trainer.Config` `config` with overlap as its data-parallel step ([Note:
    torchtitan's data-parallel step]); `overrides` are OverlapConfig fields for every wrap."""
    overlap.OverlapConfig().replace(**overrides)  # unknown or invalid fields raise here, not mid-build
    spec = config.model_spec
    if spec is None:
        raise ValueError("use_overlap: config.model_spec is None; call it on a model's config (e.g. llama3_8b())")
    if isinstance(spec.parallelize_fn, _Parallelize):
        raise ValueError("use_overlap: this config already uses overlap (use_overlap was called on it before)")
    pipelining = spec.pipelining_fn
    config.model_spec = dataclasses.replace(
        spec,
        parallelize_fn=_Parallelize(spec.parallelize_fn, dict(overrides)),
        pipelining_fn=None if pipelining is None else _Pipelining(pipelining),
    )
    return config


def apply_overlap_to_decoder(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    pp_enabled: bool,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
    ep_degree: int = 1,
    edp_mesh: DeviceMesh | None = None,
    dp_mesh_dims: Any = None,
    edp_mesh_dims: Any = None,
    enable_symm_mem: bool = False,
    **overrides: Any,
) -> nn.Module:
    """`torchtitan.distributed.fsdp.apply_fsdp_to_decoder`'s signature, wrapping `model` (a
    torchtitan `Decoder`, or one pipeline stage of it) by `overlap.wrap` instead of FSDP2; see
    [Note: torchtitan's data-parallel step] for what maps to what. `overrides` are OverlapConfig
    fields and win over the mapped ones. Every refusal depends only on the config and the model's
    structure, which every rank shares: each rank raises the same error."""
    where = f"apply_overlap_to_decoder({type(model).__name__})"
    group = _data_parallel_group(model, dp_mesh, dp_mesh_dims, edp_mesh_dims, where)
    if cpu_offload:
        raise ValueError(f"{where}: CPU offload (--training.enable_cpu_offload) is not supported by overlap")
    if enable_symm_mem:
        warnings.warn(
            f"{where}: enable_symm_mem (--parallelism.enable_fsdp_symm_mem) is FSDP2's CUDA symmetric "
            "memory and is ignored: overlap picks its transport at wrap",
            stacklevel=2,
        )
    if ep_degree > 1:
        if edp_mesh is None:
            raise ValueError(f"{where}: ep_degree={ep_degree} needs edp_mesh, the experts' data-parallel mesh")
        group = _expert_parallel_group(model, edp_mesh, where)
    settings: dict[str, Any] = {
        "unit_policy": _UnitPolicy(_unit_modules(model)),
        "param_dtype": param_dtype,
        "reduce_dtype": reduce_dtype,
        **_reshard_settings(reshard_after_forward_policy, pp_enabled),
        "gradient_divide_factor": 1.0,
        "sync_module_states": False,
    }
    settings.update(overrides)
    deferred = any(p.is_meta for p in model.parameters())
    if deferred and ep_degree > 1:  # see the note: the experts' state needs a materialized model
        model.to_empty(device=dp_mesh.device_type)
        deferred = False
    overlap.wrap(model, group=group, param_init_fn=_leave_uninitialized if deferred else None, **settings)
    return model


def _leave_uninitialized(module: nn.Module) -> None:
    """The wrap's init of a meta model: none. The Trainer's `init_weights` initializes the shards."""


class _UnitPolicy:
    """The modules FSDP2's `apply_fsdp_to_decoder` gives a `fully_shard` of their own (the same
    qualified name on every rank, which the wrap's same-config check compares)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.ids = {id(m) for m in modules}

    def __call__(self, module: nn.Module) -> bool:
        return id(module) in self.ids


def _unit_modules(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise ValueError(
            f"apply_overlap_to_decoder: {type(model).__name__} has no `layers` ModuleDict/ModuleList of "
            "transformer blocks (a torchtitan Decoder has)"
        )
    blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    embeddings = getattr(model, "tok_embeddings", None)
    if embeddings is not None and not getattr(model, "enable_weight_tying", False):
        blocks.insert(0, embeddings)  # tied to lm_head: both stay in the root unit, as FSDP2 groups them
    return blocks


def _reshard_settings(policy: str, pp_enabled: bool) -> dict[str, Any]:
    if policy not in ("default", "always", "never"):
        raise ValueError(f"reshard_after_forward_policy must be 'default', 'always' or 'never', got {policy!r}")
    reshard = {"always": True, "never": False, "default": not pp_enabled}[policy]
    return {"reshard_after_forward": reshard, "keep_for_backward_bytes": 0}


def _data_parallel_group(model: nn.Module, dp_mesh: DeviceMesh, dims: Any, edp_dims: Any, where: str) -> DeviceMesh:
    """`dp_mesh`, or the data-parallel part of a full_dtensor / spmd_types storage mesh where
    overlap can take it; raises otherwise."""
    if dims is None and edp_dims is None:
        return dp_mesh
    names = tuple(dp_mesh.mesh_dim_names or ())
    data_parallel = {n for d in (dims.shard, dims.replicate) for n in ((d,) if isinstance(d, str) else d or ())}
    other = [n for n in names if n not in data_parallel]
    dtensor = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
    problem = None
    if edp_dims is not None:
        problem = "expert parallelism"
    elif other:
        problem = f"the storage mesh {names}, whose dims {other} are not data parallel"
    elif not isinstance(dims.shard, str) or dims.shard not in names:
        problem = f"a shard dimension {dims.shard!r} that is not one dimension of {names}"
    elif dtensor is not None:
        problem = f"parameter {dtensor!r} is a DTensor on the full SPMD mesh (spmd_backend full_dtensor)"
    if problem is not None:
        raise ValueError(
            f"{where}: the SPMD parameters of spmd_backend 'spmd_types' / 'full_dtensor' are supported "
            f"with data parallelism only, not with {problem}; use {SPMD_BACKEND_FIX} (DTensor tensor "
            "and expert parallelism, which overlap composes with)"
        )
    return dp_mesh


def _expert_parallel_group(model: nn.Module, edp_mesh: DeviceMesh, where: str) -> DeviceMesh:
    """The (dp_replicate?, efsdp, ep) mesh: `edp_mesh` beside the experts' own ep mesh."""
    meshes = {
        p.device_mesh.mesh_dim_names: p.device_mesh
        for p in model.parameters()
        if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
    }
    if len(meshes) != 1:
        raise ValueError(
            f"{where}: expert parallelism needs the experts as DTensors on one `ep` mesh, found meshes "
            f"{sorted(meshes, key=str)}"
        )
    (ep_mesh,) = meshes.values()
    return torch_compat.concatenate([edp_mesh, ep_mesh], "EP")


@contextlib.contextmanager
def _redirected(name: str, original: Any, replacement: Any) -> Iterator[None]:
    """Every loaded torchtitan module's attribute `name` that is `original` is `replacement`
    while inside."""
    patched = [
        m
        for key, m in list(sys.modules.items())
        if (key == "torchtitan" or key.startswith("torchtitan.")) and getattr(m, name, None) is original
    ]
    for module in patched:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module in patched:
            setattr(module, name, original)


@dataclasses.dataclass(frozen=True)
class _Parallelize:
    """A model's `parallelize_fn` with its data-parallel step done by overlap."""

    fn: Callable[..., nn.Module]
    overrides: dict[str, Any]

    def __call__(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        from torchtitan.distributed import fsdp

        apply = functools.partial(apply_overlap_to_decoder, **self.overrides)
        with _redirected("apply_fsdp_to_decoder", fsdp.apply_fsdp_to_decoder, apply):
            model = self.fn(model, **kwargs)
        _refuse_fsdp(model, self.fn)
        return model


def _refuse_fsdp(model: nn.Module, fn: Callable[..., Any]) -> None:
    from torch.distributed.fsdp import FSDPModule

    fsdp = next((n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule)), None)
    if fsdp is not None:
        raise ValueError(
            f"use_overlap: {getattr(fn, '__qualname__', fn)} applied FSDP2 itself (module {fsdp!r} is an "
            "FSDPModule); overlap replaces apply_fsdp_to_decoder only: call apply_overlap_to_decoder "
            "there instead of fully_shard"
        )


@dataclasses.dataclass(frozen=True)
class _Pipelining:
    """A model's `pipelining_fn` building overlap's pipeline stages."""

    fn: Callable[..., Any]

    def __call__(self, model: nn.Module, **kwargs: Any) -> Any:
        from torchtitan.distributed import pipeline_parallel

        with _redirected("PipelineStage", pipeline_parallel.PipelineStage, _PipelineStage):
            return self.fn(model, **kwargs)


class _PipelineStage(_OverlapPipelineStage):
    """overlap's stage, built before its module is wrapped: torchtitan splits the model into
    stages first and parallelizes each stage's module afterwards (the same module object)."""

    def __init__(self, submodule: Any, *args: Any, **kwargs: Any) -> None:
        _TorchPipelineStage.__init__(self, submodule, *args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        # The schedule's first step infers shapes by a real forward and backward of one
        # micro-batch; torchtitan's chunked loss runs its chunks' backwards in it, which leave the
        # head's gradients behind. torch drops them for FSDP2's modules only: drop ours too.
        super()._post_metadata_inference_cleanup()
        self.submod.zero_grad(set_to_none=True)


__all__ = ["SPMD_BACKEND_FIX", "apply_overlap_to_decoder", "use_overlap"]
