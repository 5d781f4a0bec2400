"""A unit's tensors on this rank: its flat shard, the sharded and unsharded parameters that view
it, and the buffers its copies reuse (a gather in flight is the runtime's `GatherResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from overlap.engine.units import UnitLayout
from overlap.transport.fingerprint import TAG_NUMEL, signature

# [Note: aliased units]
# Over one rank (world size 1, or HSDP with a shard group of one) with no cast, no codec and no
# forced collectives, a unit's rank-major gather output is its shard itself and the
# parameter-major unsharded layout is the same as the shard's ([Note: flat layout]: offsets
# times world_size). The unsharded parameters are then views of the shard: gathering, copy-out
# and freeing do nothing but swap the module's parameters, and no unsharded memory is held
# (DDP's cost at one rank). The optimizer's in-place updates of the shard are what the next
# forward sees, as a re-gather would give; nothing writes the shard between a forward and its
# backward. Gradients still go through the reduce path (copy-in, division, accumulation), so
# everything after it is unchanged.


@dataclass
class UnitTensors:
    """The tensors of one unit on this rank. See [Note: flat layout] in units.py."""

    layout: UnitLayout
    shard: torch.Tensor  # flat shard buffer (master dtype); sharded params' locals are views
    sharded_params: list[nn.Parameter]  # DTensor (Shard(0) on the shard dim), what the optimizer sees
    unsharded_flat: torch.Tensor  # gather dtype; storage has 0 bytes while SHARDED
    unsharded_params: list[nn.Parameter]  # views of unsharded_flat, what forward uses
    owners: list[list[tuple[nn.Module, str]]]  # per parameter, every (module, attribute) holding it
    secondary: torch.Tensor | None = None  # hpZ: see [Note: secondary copy]
    encoded: torch.Tensor | None = None  # wire bytes of the shard this step: _encoded_shard
    needs_secondary: bool = True  # hpZ: False for kept and root units (no backward gather)
    trainable: list[tuple[Any, nn.Parameter]] = field(init=False)  # (slot, sharded param) with grads
    copy_out_views: list[torch.Tensor] | None = None  # per slot, its span of unsharded_flat
    tag_out: torch.Tensor | None = None  # copy-out's destination for the gathered tags (CPU: checked there)
    signature: int = 0  # of the trainable pattern, in the tags
    copy_out_sizes: list[int] | None = None  # per slot, its padded span of the gathered rows
    copy_out_cols: list[int] | None = None  # per slot, the data columns of its chunk
    aliased: bool = False  # unsharded params are views of the shard ([Note: aliased units])
    copy_out_bound: tuple[Any, Any] | None = None  # (gather dtype, outs) -> bound copy-out
    grad_sums: list[torch.Tensor | None] | None = None  # under no_sync: [Note: no_sync in reduce_dtype]

    def __post_init__(self) -> None:
        self._plan_grads()

    def _plan_grads(self) -> None:
        """What the reduce path reads every step, derived once per gradient layout."""
        slots = self.layout.slots
        self.trainable = [(s, p) for s, p in zip(slots, self.sharded_params) if s.requires_grad]
        self.signature = signature(tuple(s.requires_grad for s in slots))
        self.grad_params = [p for s, p in zip(slots, self.unsharded_params) if s.requires_grad]
        self.grad_slots = [i for i, s in enumerate(slots) if s.requires_grad]  # their slot indices
        self.grad_spans = [s.padded_chunk_numel for s in slots if s.requires_grad]
        self.grad_cols = [s.chunk_numel for s in slots if s.requires_grad]
        # per trainable parameter: (sharded param, offset in the gradient shard, local shape and
        # contiguous stride): one as_strided per parameter and step in `Runtime._accumulate`
        self.grad_locals = [
            (p, s.grad_offset, tuple(p._local_tensor.shape), _contiguous_strides(p._local_tensor.shape))
            for s, p in self.trainable
        ]

    def tagged_shard(self) -> torch.Tensor | None:
        """The shard with the tag's room behind it (None when its buffer has none)."""
        shard = self.shard
        needed = (shard.storage_offset() + shard.numel() + TAG_NUMEL) * shard.element_size()
        if shard.untyped_storage().nbytes() < needed:
            return None
        return shard.as_strided((shard.numel() + TAG_NUMEL,), (1,))

    def set_layout(self, layout: UnitLayout) -> None:
        """A new gradient layout (requires_grad changed after wrap): same buffers, other
        trainable parameters."""
        self.layout = layout
        for slot, param in zip(layout.slots, self.unsharded_params):
            param.requires_grad_(slot.requires_grad)
        self._plan_grads()

    @property
    def unsharded_nbytes(self) -> int:
        return self.unsharded_flat.numel() * self.unsharded_flat.element_size()

    def held_bytes(self, gather_dtype: torch.dtype | None) -> int:
        """Bytes the unit holds while gathered, as the prefetch budget counts them: its unsharded
        storage (the all-gather output is the same size, alive only until copy-out), plus the
        cast of its shard into the gather dtype when there is one."""
        cast = 0
        if gather_dtype is not None and gather_dtype != self.shard.dtype:
            cast = self.shard.numel() * gather_dtype.itemsize
        return self.unsharded_nbytes + cast

    def grad_bytes(self, reduce_dtype: torch.dtype | None) -> int:
        """Bytes the unit adds to a reduce-scatter bucket (0: nothing to reduce)."""
        dtype = reduce_dtype or self.unsharded_flat.dtype
        return self.layout.grad_shard_numel * self.layout.world_size * dtype.itemsize

    def alias_shard(self) -> None:
        """Make the unsharded parameters views of the shard ([Note: aliased units])."""
        params = []
        for slot, old in zip(self.layout.slots, self.unsharded_params):
            assert slot.chunk_numel == slot.numel, f"{self.layout.label}: only one rank's layout aliases"
            view = self.shard[slot.shard_offset : slot.shard_offset + slot.numel].view(slot.shape)
            tp = slot.tensor_parallel  # [Note: tensor-parallel parameters] in compose.py
            params.append(nn.Parameter(view if tp is None else tp.unsharded(view), requires_grad=old.requires_grad))
        self.unsharded_params = params
        self.aliased = True
        self._plan_grads()

    def swap_in(self, params: list[nn.Parameter]) -> None:
        for holders, param in zip(self.owners, params):
            for module, name in holders:
                module._parameters[name] = param


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
