"""Deferred initialization: shard a model built on the meta device, one unit at a time.

A model too big for one device is built under `torch.device("meta")` (shapes only) and handed to
`overlap.wrap`. Here each unit is materialized at full size, initialized, cut into this rank's
shard and dropped before the next unit is materialized, so a rank that initializes holds at most
one unit's full parameters (plus the root unit's, kept until the end of the walk) besides its
shards. With `sync_module_states` (the default) only the source rank initializes: it scatters
each unit as it finishes ([Note: sync from the source] in source_values.py), and the other ranks
materialize nothing but their shards and the buffers (which the source then broadcasts), and do
not run the init functions, so their random number generators are not advanced. A model whose
parameters are tensor-parallel DTensors is initialized otherwise: [Note: deferred init with
tensor parallelism].

[Note: init order]
Values must equal those of the eager model built with the same seed, so the random number
generator must be consumed in the same order as eager construction. Modules are initialized in
post-order (children before their parent, in registration order), which is the order in which
torch.nn's modules and most model code initialize during construction (a module's `__init__`
builds its children, each initializing itself, then initializes its own parameters:
`nn.MultiheadAttention` resets `out_proj` inside `out_proj`'s constructor, then its own
`in_proj_weight`). Each module runs `param_init_fn(module)` when given, else its
`reset_parameters()` (or `_reset_parameters()`, which `nn.MultiheadAttention` uses). A model whose
constructor initializes in another order, e.g. with `self.apply(fn)` at the end of the root's
`__init__`, passes `param_init_fn=fn` (`Module.apply` is post-order too).

[Note: deferred init with tensor parallelism]
A meta-device model whose parameters are tensor-parallel DTensors (torchtitan's order:
`parallelize_module` on the meta model, then the data-parallel wrapper, then `to_empty` and
`init_weights`) is initialized as FSDP2 initializes it: every unit is sharded first (its shard
zero, no full tensor anywhere), then every rank runs the init functions, in the order above, on
its sharded parameters, DTensors on the (dp, tp) mesh with FSDP2's placements and local shapes
([Note: tensor-parallel parameters] in compose.py). The values are therefore FSDP2's on the same
mesh with the same seed and the same init calls, whatever DTensor's random ops do: on CUDA its
OffsetBasedRNGTracker offsets each shard's draw by the shard's place in the global tensor; on
the CPU, where DTensor has no tracker, each rank draws its local shard from its own generator
(so every rank must be seeded the same, as DTensor asks). "The eager model's values" has no
meaning here (a tensor-parallel eager model's draws depend on its placement too), and there is
no whole tensor on one rank to scatter: `sync_module_states` sends the buffers from the source
as always (0-dim parameters come from rank 0 too: [Note: replicated parameters] in
replicated.py), and under HSDP each shard from the source row down its replicate column, so the
replicas start equal even where ranks were seeded otherwise; across dp and tp each rank's shard
is its own. A whole unit is never materialized, so no rank holds more than its shards. FSDP2's values are tested on the CPU
(tests/parity/test_compose_meta_compile.py); on CUDA they are FSDP2's by the same construction.

Tied parameters: eager code ties after construction (`head.weight = embed.weight`), so the
module initialized first keeps its values and the later owner's draws are thrown away. Here the
first owner in the walk initializes the shared tensor; a later owner initializes a scratch copy
(drawing the same random numbers) that is then dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from overlap.engine.lazy_torch import is_compiled_module

ParamInitFn = Callable[[nn.Module], None]


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix.removesuffix("."), module


def _init_module(module: nn.Module, param_init_fn: ParamInitFn | None, done: WeakIdKeyDictionary) -> None:
    """Run the module's init; parameters already initialized (`done`) get a scratch copy.

    `done` is weak: a unit's parameters are freed once sharded, and a later tensor may reuse
    their `id`, which must not make it look initialized. `torch.compile(module)`'s wrapper is
    skipped: the module it wraps is its child, initialized in the walk, and the wrapper's
    attributes lead there, so its `reset_parameters` would draw a second time."""
    if is_compiled_module(module):
        return
    shared = {name: p for name, p in module._parameters.items() if p is not None and p in done}
    for name, p in shared.items():
        module._parameters[name] = nn.Parameter(torch.empty_like(p), p.requires_grad)
    try:
        if param_init_fn is not None:
            param_init_fn(module)
        else:
            for name in ("reset_parameters", "_reset_parameters"):
                reset = getattr(module, name, None)
                if callable(reset):
                    reset()
                    break
    finally:
        module._parameters.update(shared)
    done.update((p, True) for p in module._parameters.values() if p is not None)


class ScratchBuffer:
    """One byte buffer reused for every unit's wrap-time temporaries: the full parameters of a
    deferred unit, the rank-major copy the source scatters. Allocating those per unit and freeing
    them leaks on CPU: glibc does not hand a freed block back for the next request of the same
    size (an aligned request asks for a little more than the hole, and small long-lived objects
    land between), so a 1.6 GB meta model measured 1.5x its size in peak RSS at 2 ranks that way,
    for 0.5x of shards. See also [Note: shards first] in sharding.py."""

    ALIGN_BYTES = 64

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bytes: torch.Tensor | None = None

    @classmethod
    def aligned(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN_BYTES) * cls.ALIGN_BYTES

    def reserve(self, nbytes: int) -> None:
        """Grow to at least `nbytes` (contents are not kept)."""
        if self._bytes is None or self._bytes.numel() < nbytes:
            self._bytes = None
            self._bytes = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def take(self, specs: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
        """Uninitialized tensors of these shapes and dtypes, laid out back to back (aligned) in
        the buffer: valid until the next `take`."""
        offsets, end = [], 0
        for shape, dtype in specs:
            offsets.append(end)
            end += self.aligned(math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
        self.reserve(end)
        assert self._bytes is not None
        out = []
        for (shape, dtype), offset in zip(specs, offsets):
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            out.append(self._bytes[offset : offset + nbytes].view(dtype).view(shape))
        return out


def _materialize(
    modules: list[nn.Module],
    device: torch.device,
    cache: dict[int, torch.Tensor],
    params: bool,
    placed: dict[int, torch.Tensor] | None = None,
) -> list[int]:
    """Give the modules' own meta buffers (and parameters, with `params`) real, uninitialized
    storage: for a parameter in `placed` (by id of the meta tensor) that tensor, else a new one.
    Returns the cache keys of the parameters it created.

    `cache` maps a meta tensor to its replacement, so a tensor tied across modules stays one
    tensor (`Module.to_empty` would give each owner its own copy).
    """
    created = []
    for module in modules:
        for name, param in module._parameters.items():
            if not params or param is None or not param.is_meta:
                continue
            if id(param) not in cache:
                real = placed.get(id(param)) if placed else None
                if real is None:
                    real = torch.empty_like(param, device=device)
                cache[id(param)] = nn.Parameter(real, requires_grad=param.requires_grad)
                created.append(id(param))
            module._parameters[name] = cache[id(param)]  # type: ignore[assignment]
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                if id(buf) not in cache:
                    cache[id(buf)] = torch.empty_like(buf, device=device)
                module._buffers[name] = cache[id(buf)]
    return created


def _forget_replaced(cache: dict[int, torch.Tensor], keys: list[int], modules: list[nn.Module]) -> None:
    """Drop the cache's reference to the unit's full parameters once `shard` replaced them. A
    parameter tied to a module outside the unit belongs to the root unit: still held by the
    unit's module, it stays cached so that its other owners get the same tensor."""
    held = {id(p) for module in modules for p in module._parameters.values() if p is not None}
    for key in keys:
        if id(cache[key]) not in held:
            del cache[key]


def materialize_and_shard(
    model: nn.Module,
    unit_of_module: Callable[[str], int | None],
    unit_params: list[list[tuple[str, str]]],
    root_unit: int | None,
    device: torch.device,
    param_init_fn: ParamInitFn | None,
    shard: Callable[[int], object],
    init_params: bool = True,
) -> list[object]:
    """Materialize, initialize and shard every unit, walking modules per [Note: init order].

    `unit_of_module(fqn)` names the unit a module's own parameters belong to (None: the root
    unit, index `root_unit`); `unit_params[u]` holds one (module FQN, attribute) owner of each
    parameter of unit u; `shard(unit)` cuts that unit's now-real parameters into this rank's
    shard and replaces them in the model. Returns `shard`'s results by unit index.

    A unit's full parameters live in one ScratchBuffer, reused by the next unit once `shard`
    has replaced them; the root unit's, needed until the end, get their own storage.
    `init_params=False` (a rank that receives its shards from the source): parameters stay on
    the meta device for `shard` to replace, no init function runs, buffers get uninitialized
    storage; `shard` is still called in the same order as on the source, so collectives pair.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    metas = [
        [modules[fqn]._parameters[attr] for fqn, attr in owners] if u != root_unit else []
        for u, owners in enumerate(unit_params)
    ]
    scratch = ScratchBuffer(device)
    if init_params and any(metas):
        scratch.reserve(max(sum(ScratchBuffer.aligned(p.nbytes) for p in ps) for ps in metas))
    cache: dict[int, torch.Tensor] = {}
    initialized = WeakIdKeyDictionary()
    done: list[object] = [None] * len(unit_params)
    walk = list(_post_order(model))
    modules_of: dict[int | None, list[nn.Module]] = {}
    for fqn, module in walk:
        modules_of.setdefault(unit_of_module(fqn), []).append(module)
    # the root unit lives until the end
    _materialize(modules_of.get(None, []), device, cache, params=init_params)
    created: dict[int, list[int]] = {}
    remaining = {u: len(mods) for u, mods in modules_of.items() if u is not None}
    for fqn, module in walk:
        unit = unit_of_module(fqn)
        if unit is not None and unit not in created:
            placed = None
            if init_params:
                views = scratch.take([(p.shape, p.dtype) for p in metas[unit]])
                placed = {id(meta): view for meta, view in zip(metas[unit], views)}
            created[unit] = _materialize(modules_of[unit], device, cache, init_params, placed)
        if init_params:
            with torch.no_grad():
                _init_module(module, param_init_fn, initialized)
        if unit is not None:
            remaining[unit] -= 1
            if remaining[unit] == 0:
                done[unit] = shard(unit)
                _forget_replaced(cache, created[unit], modules_of[unit])
    for unit, result in enumerate(done):
        if result is None:
            done[unit] = shard(unit)  # the root unit, and units with no modules of their own
    return done


def initialize_sharded(model: nn.Module, device: torch.device, param_init_fn: ParamInitFn | None) -> None:
    """Initialize a meta-device model whose units are already sharded, on the shards ([Note:
    deferred init with tensor parallelism]): what is still on the meta device (buffers, 0-dim
    parameters) gets uninitialized storage on `device` first, then every module runs its init,
    in post-order ([Note: init order])."""
    walk = [module for _, module in _post_order(model)]
    _materialize(walk, device, {}, params=True)
    initialized = WeakIdKeyDictionary()
    with torch.no_grad():
        for module in walk:
            _init_module(module, param_init_fn, initialized)
