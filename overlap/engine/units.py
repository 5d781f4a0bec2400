"""Which modules form a unit, and how a unit's parameters lie in its flat buffers.

A *unit* is the granularity of communication: one all-gather brings all of its parameters, one
reduce-scatter (or a share of a bucket) sends all of its gradients. This module only decides
grouping and layout; it holds no tensors of its own.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from overlap.engine.compose import TensorParallel

# [Note: flat layout]
# Every parameter is padded on dim 0 to `rows_per_rank * world_size` rows and cut into
# `world_size` equal chunks of `rows_per_rank` rows (torch.chunk semantics, as DTensor Shard(0)
# uses: rank r owns rows [r*c, min((r+1)*c, dim0)), the last ranks may own fewer or none).
# A chunk holds `chunk_numel = rows_per_rank * row_numel` elements and occupies
# `padded_chunk_numel` elements of the buffers: chunk_numel rounded up to `align_numel` (16 as
# wrap uses it: 16 elements are 16 bytes or more in every dtype), so that every chunk starts
# 16-byte aligned whatever the other parameters' sizes ([Note: copy alignment] in
# kernels/triton_copy.py). A unit's *shard buffer* on rank r is the concatenation of its
# parameters' padded chunks r:
#     shard = [p0 chunk r, pad | p1 chunk r, pad | ...]            (shard_numel elements)
# The all-gather output is rank-major: [shard of rank 0 | shard of rank 1 | ...], viewed as
# (world_size, shard_numel). The *unsharded buffer* is parameter-major: each parameter's padded
# full tensor (world_size * chunk_numel elements, at `unsharded_offset`, followed by unused
# space up to world_size * padded_chunk_numel), so that parameter i's column block of the
# rank-major view, (world_size, padded_chunk_numel_i), holds in each row its chunk followed by
# the pad: copy-out and gradient copy-in are one `kernels.copy_out` / `copy_in` pass with
# `sizes = world_size * padded_chunk_numel` and `data_cols = chunk_numel` ([Note: fused copy
# layout] in kernels/copy.py). Without padding (align_numel=1, chunk_numel == padded) copy-out
# is one `split_with_sizes_copy` along dim 1 and copy-in one `torch.cat` along dim 1.
CHUNK_ALIGN_NUMEL = 16


@dataclass(frozen=True)
class ParamInfo:
    """A parameter as `wrap` found it, before layout."""

    fqn: str  # first name in the wrapped model, e.g. "layers.3.attn.in_proj_weight"
    owners: tuple[tuple[str, str], ...]  # every (module FQN, attribute) holding it (ties: >1)
    shape: torch.Size
    requires_grad: bool
    dtype: torch.dtype | None = None  # None: not known (layouts built from shapes alone)
    # a tensor-parallel DTensor: `shape` is its local tensor's ([Note: tensor-parallel parameters] in compose.py)
    tensor_parallel: TensorParallel | None = None


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its unit's flat buffers."""

    fqn: str
    owners: tuple[tuple[str, str], ...]  # (module FQN, attribute) pairs to swap it into
    shape: torch.Size  # original (unsharded) shape
    requires_grad: bool
    rows_per_rank: int  # dim-0 rows of every rank's chunk (the last ranks' chunks are padded)
    chunk_numel: int  # rows_per_rank * prod(shape[1:])
    padded_chunk_numel: int  # chunk_numel rounded up to the layout's alignment: its buffer span
    shard_offset: int  # offset of this parameter's chunk in the shard buffer
    unsharded_offset: int  # offset of the padded full tensor in the unsharded buffer
    grad_offset: int  # offset of its chunk in the gradient shard; -1 when frozen
    tensor_parallel: TensorParallel | None = None  # see ParamInfo

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_rows(self, rank: int) -> int:
        """Rows of the real (unpadded) parameter that `rank` owns."""
        dim0 = self.shape[0] if len(self.shape) > 0 else 1
        return max(0, min(self.rows_per_rank, dim0 - rank * self.rows_per_rank))


@dataclass(frozen=True)
class UnitLayout:
    """The parameters of one unit and the sizes of its flat buffers (per rank)."""

    index: int
    label: str  # e.g. "unit3 (layers.3)" for messages and profiler ranges
    module_fqns: tuple[str, ...]  # the modules whose forward belongs to this unit
    slots: tuple[ParamSlot, ...]
    world_size: int

    @property
    def shard_numel(self) -> int:
        return sum(s.padded_chunk_numel for s in self.slots)

    @property
    def unsharded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def chunk_sizes(self) -> list[int]:
        """Column widths of the parameters' blocks in the rank-major (world_size, shard_numel)
        view: padded_chunk_numel each ([Note: flat layout])."""
        return [s.padded_chunk_numel for s in self.slots]

    @property
    def grad_slots(self) -> tuple[ParamSlot, ...]:
        """The trainable parameters: only their gradients are reduce-scattered."""
        return tuple(s for s in self.slots if s.requires_grad)

    @property
    def grad_shard_numel(self) -> int:
        return sum(s.padded_chunk_numel for s in self.grad_slots)


def make_layout(
    index: int, label: str, module_fqns: tuple[str, ...], params: list[ParamInfo], world_size: int, align_numel: int = 1
) -> UnitLayout:
    """Lay out `params` per [Note: flat layout], each chunk padded to a multiple of
    `align_numel` elements (wrap passes CHUNK_ALIGN_NUMEL; 1 packs the chunks back to back)."""
    if align_numel < 1:
        raise ValueError(f"overlap.engine.units.make_layout: align_numel must be >= 1, got {align_numel}")
    slots = []
    shard_off = grad_off = 0
    for info in params:
        shape = info.shape
        dim0 = shape[0] if len(shape) > 0 else 1
        rows = math.ceil(dim0 / world_size)
        row_numel = math.prod(shape[1:])
        chunk = rows * row_numel
        padded = -(-chunk // align_numel) * align_numel
        slots.append(
            ParamSlot(
                fqn=info.fqn,
                owners=info.owners,
                shape=shape,
                requires_grad=info.requires_grad,
                rows_per_rank=rows,
                chunk_numel=chunk,
                padded_chunk_numel=padded,
                shard_offset=shard_off,
                unsharded_offset=shard_off * world_size,
                grad_offset=grad_off if info.requires_grad else -1,
                tensor_parallel=info.tensor_parallel,
            )
        )
        shard_off += padded
        grad_off += padded if info.requires_grad else 0
    return UnitLayout(index, label, module_fqns, tuple(slots), world_size)


# [Note: one dtype per unit]
# A unit's buffers have one dtype, so that its all-gather, copy-out, gradient copy-in, codecs,
# error-feedback residuals, rank-0 scatter, full state dict and checkpoint all stay one typed
# pass. A group of modules whose parameters have several dtypes (fp32 norms beside bf16 weights
# in one block) becomes one unit per dtype, in the order each dtype first appears among its
# parameters: the parts share the modules, and wrap's hooks gather, free and reduce all of a
# module's parts together (one collective per dtype). The schedule sees ordinary units: each part
# counts on its own in the prefetch budget, and consecutive parts may share a reduce-scatter
# bucket, which the runtime reduces in the widest of its dtypes (runtime._widest). The root's
# first part is the schedule's root; its other parts are gathered when the root's forward starts
# and, like the root, kept until their backward (they count in the prefetch budget: the schedule
# knows one root). Everything per unit (checkpoints, full state dicts, the rank-0 scatter,
# deferred init, which materializes a module group and then shards each of its parts) is
# unchanged.
def split_by_dtype(params: list[ParamInfo]) -> list[list[ParamInfo]]:
    """`params` cut into one list per dtype (order kept within each; dtypes in order of first
    appearance): see [Note: one dtype per unit]. One list when they share a dtype."""
    parts: dict[torch.dtype | None, list[ParamInfo]] = {}
    for info in params:
        parts.setdefault(info.dtype, []).append(info)
    return list(parts.values())


def with_trainable(layout: UnitLayout, trainable: tuple[bool, ...]) -> UnitLayout:
    """`layout` with the parameters' `requires_grad` set to `trainable` (one per slot): the
    gradient offsets are recomputed, the shard and unsharded layouts do not move
    ([Note: requires_grad after wrap] in state.py)."""
    assert len(trainable) == len(layout.slots)
    slots, grad_off = [], 0
    for slot, flag in zip(layout.slots, trainable):
        slots.append(dataclasses.replace(slot, requires_grad=flag, grad_offset=grad_off if flag else -1))
        grad_off += slot.padded_chunk_numel if flag else 0
    return dataclasses.replace(layout, slots=tuple(slots))


BLOCK_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
"""Where "auto" looks for repeated blocks: `model.layers` of most transformers is one of these
(a ModuleDict in torchtitan, keyed by layer number)."""

MOST_PARAMS_SHARE = 0.5
"""A unit holding more than this share of a model's parameters, repeated blocks among them, is
warned about (`warn_lopsided_units`)."""


def repeated_blocks(root: nn.Module) -> dict[str, nn.Module]:
    """The repeated blocks of `root` by FQN, in registration order: the children of a ModuleList,
    ModuleDict or Sequential whose class occurs at least twice among its children, and which
    hold parameters."""
    blocks: dict[str, nn.Module] = {}
    for fqn, module in root.named_modules():
        if not isinstance(module, BLOCK_CONTAINERS):
            continue
        counts = Counter(type(child) for child in module.children())
        for name, child in module.named_children():
            if counts[type(child)] >= 2 and any(True for _ in child.parameters()):
                blocks[f"{fqn}.{name}" if fqn else name] = child
    return blocks


def find_unit_modules(
    root: nn.Module, policy: str | frozenset[type[nn.Module]] | Callable[[nn.Module], bool]
) -> list[str]:
    """FQNs of the modules that become units, outermost first, in registration order.

    A module nested inside another chosen module is not a unit of its own (one level of units:
    every parameter belongs to exactly one unit, which keeps the collective sequence simple).
    """
    if policy == "auto":
        chosen_ids = {id(block) for block in repeated_blocks(root).values()}

        def is_unit(m: nn.Module) -> bool:
            return id(m) in chosen_ids

    elif isinstance(policy, frozenset):

        def is_unit(m: nn.Module) -> bool:
            return isinstance(m, tuple(policy))

    else:
        is_unit = policy  # type: ignore[assignment]

    fqns: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if is_unit(child):
                fqns.append(fqn)
            else:
                visit(child, fqn + ".")

    visit(root, "")
    return fqns


def group_units(unit_fqns: list[str], numels: dict[str, int], min_unit_numel: int) -> list[tuple[str, ...]]:
    """Merge consecutive unit modules until each group holds at least `min_unit_numel` elements.

    A trailing group below the threshold joins its predecessor, so no small tail unit remains.
    """
    groups: list[list[str]] = []
    current: list[str] = []
    current_numel = 0
    for fqn in unit_fqns:
        current.append(fqn)
        current_numel += numels[fqn]
        if current_numel >= min_unit_numel:
            groups.append(current)
            current, current_numel = [], 0
    if current:
        if groups and min_unit_numel > 0:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return [tuple(g) for g in groups]


def warn_lopsided_units(root: nn.Module, layouts: list[UnitLayout]) -> None:
    """Warn when one unit (its parts of every dtype together) holds most of the model's
    parameters and at least two repeated blocks: they are gathered together, so ZeRO-3 saves
    little memory, silently. This happens when `unit_policy` names no class the blocks have,
    when the blocks sit where "auto" does not look, or when `min_unit_numel` merges them."""
    by_modules: dict[tuple[str, ...], list[UnitLayout]] = {}
    for layout in layouts:
        by_modules.setdefault(layout.module_fqns, []).append(layout)
    total = sum(layout.numel for layout in layouts)
    if total == 0 or len(by_modules) == 0:
        return
    members, parts = max(by_modules.items(), key=lambda item: sum(layout.numel for layout in item[1]))
    numel = sum(layout.numel for layout in parts)
    if numel <= MOST_PARAMS_SHARE * total:
        return
    owners = {module for layout in parts for slot in layout.slots for module, _ in slot.owners}
    blocks = repeated_blocks(root)
    # the outermost blocks (experts inside a layer are the layer's), and not those inside one of
    # the unit's own modules: a unit that is one block holding repeated parts is as it should be
    outer = [b for b in blocks if not any(b.startswith(o + ".") for o in blocks)]
    outer = [b for b in outer if members == ("",) or not any(b.startswith(m + ".") for m in members)]
    inside = [fqn for fqn in outer if any(o == fqn or o.startswith(fqn + ".") for o in owners)]
    if len(inside) < 2:
        return
    name = "the root (parameters outside every unit)" if members == ("",) else " + ".join(members)
    shown = ", ".join(inside[:3]) + (f" and {len(inside) - 3} more" if len(inside) > 3 else "")
    warnings.warn(
        f"overlap.wrap: one unit, {name}, holds {numel / total:.0%} of the model's parameters "
        f"({numel:,} of {total:,} elements) and {len(inside)} repeated blocks ({shown}): they are "
        "gathered together, so sharding saves little memory. Give each block a unit of its own: "
        f"unit_policy={{{type(blocks[inside[0]]).__name__}}} (or a callable), and min_unit_numel "
        "no larger than a block",
        stacklevel=5,  # wrap's caller
    )
