"""Collective strategies: which collective moves a unit's bytes, and where its output lives.

[Note: the seam]
A transport is two things, as FSDP2's `AllGather`/`ReduceScatter` beside its streams:
- an *executor* (`executor.py`; `HostExecutor` in host.py, `StreamExecutor` in streams.py):
  where the work after a collective runs (a comm stream at issue, or the training thread at
  the wait) and how compute waits for it;
- three *strategies* (this module): an `AllGather`, a `ReduceScatter` and an `AllReduce`, each
  with `allocate(...)` (where its buffer lives) and a call that issues it and returns a
  `CommResult`. The native ones here call the backend's collective; gloo's own mechanisms are
  the gloo strategies (gloo.py), ranks on one host use shared memory (shm.py), CUDA may use
  symmetric memory (symm_mem.py).
The runtime drives a `Transport` (base.py) holding one executor and one of each strategy; it
names no mechanism. A strategy decides from sizes every rank shares (`Wire`), so every rank
issues the same collectives in the same order. `Transport.set_custom_all_gather` (and its
siblings) replaces one part before the first step, as FSDP2's `set_custom_all_gather` does.

[Note: coalesced collectives]
A strategy may hold a collective back and issue it with the next one it is asked for, as one
(NCCL's group calls, FSDP2's coalescing): the gloo strategies send a backward all-gather in the
all-to-all of the reduction just before it ([Note: fused exchange] in gloo.py). What is held
is issued at the latest when the runtime ends a batch of actions (`Transport.flush`), when any
other collective is asked for, or when its result is waited on; every rank holds and issues the
same collectives, so they still pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import torch
import torch.distributed as dist

from overlap.compression import Codec
from overlap.compression.feedback import FeedbackResidual
from overlap.transport import backend, coded
from overlap.transport import collectives as comm

Event: TypeAlias = "torch.cuda.Event | None"
"""Where a collective's result is ready on CUDA (an event on its stream); None on the host."""


class UnitWire(NamedTuple):
    """What a transport knows of a unit to plan its collectives: sizes every rank shares."""

    gather_numel: int  # elements one rank sends in an uncompressed all-gather (shard, tag slot)
    gather_itemsize: int  # bytes per element on the wire (the gather dtype)
    reduce_row_bytes: int  # one row of its reduction at most: gradient chunks, used flags (codecs: fp32)
    same_dtype: bool  # gathered in the shard's dtype (no cast) and not aliased ([Note: aliased units])


@dataclass(frozen=True)
class Wire:
    """What every strategy plans from, the same on every rank."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    semantics: backend.CommSemantics
    gather_impl: str  # OverlapConfig.all_gather_impl
    reduce_impl: comm.ReduceImpl  # resolved from OverlapConfig.reduce_scatter_impl
    secondary_group: dist.ProcessGroup | None
    units: tuple[UnitWire, ...] = ()
    compressed_params: bool = False

    def part_bytes(self, index: int) -> int:
        """Bytes one rank sends in unit `index`'s uncompressed all-gather."""
        return self.units[index].gather_numel * self.units[index].gather_itemsize


class GatherResult(NamedTuple):
    """A unit's all-gather in flight, from its issue to its wait (FSDP2's `AllGatherResult`):
    held by the runtime, never written into the unit."""

    index: int  # the unit
    comm: comm.CommResult | None  # the collective until the wait (CUDA: None once copy-out is enqueued)
    tag: int | None  # the tag it carries ([Note: collective fingerprints]); None: untagged
    from_secondary: bool  # hpZ: read from the secondary copies ([Note: secondary copy])
    nbytes: int  # bytes its buffers hold, accounted as gather_buffers
    event: Event = None  # CUDA: copy-out done on the gather stream ([Note: gather event])


def held_bytes(result: comm.CommResult) -> int:
    """Bytes a collective's buffers hold while in flight."""
    if result.nbytes is not None:
        return result.nbytes
    return sum(t.numel() * t.element_size() for t in (result.output, *result.inputs))


class Strategy:
    """What every strategy shares: the wire it was planned for."""

    wire: Wire
    through_shared_memory = False
    """Whether the strategy exchanges through shared memory (overlap/transport/shm.py): its
    collectives are copies on the training thread, which the step model prices as host work."""

    def plan(self, wire: Wire) -> None:
        """Decide once, from sizes every rank shares (a strategy may add)."""
        self.wire = wire

    def flush(self) -> None:
        """Issue what this strategy held back ([Note: coalesced collectives]); most hold nothing."""


class AllGather(Strategy):
    """A unit's all-gather: the backend's, into a buffer from `allocate`."""

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The gather's output: `numel` elements, rank-major."""
        return torch.empty(numel, dtype=dtype, device=device)

    def __call__(
        self,
        index: int,
        send: torch.Tensor,
        dtype: torch.dtype,
        tag: int | None,
        tag_slot: torch.Tensor | None,
        for_backward: bool,
    ) -> comm.CommResult:
        """Unit `index`'s uncompressed all-gather of `send` (cast to `dtype`, tagged:
        `collectives.all_gather_flat`). `wait` gives the rank-major rows: one tensor, or the
        list of rows where a strategy leaves them where they landed."""
        w = self.wire
        out = self.allocate(w.world_size * send.numel(), dtype, send.device)
        return comm.all_gather_flat(send, w.group, w.world_size, dtype, tag, tag_slot, "native", None, out=out)

    def encoded(
        self,
        encoded: torch.Tensor,
        numel: int,
        dtype: torch.dtype,
        codec: Codec,
        shard_dtype: torch.dtype,
        tag: int | None,
    ) -> comm.CommResult:
        """A compressed all-gather (coded.all_gather_encoded)."""
        self.flush()
        w = self.wire
        return coded.all_gather_encoded(encoded, numel, w.group, w.world_size, dtype, codec, shard_dtype, tag)

    def secondary(self, secondary: torch.Tensor) -> comm.CommResult:
        """hpZ: a backward all-gather from the secondary copies ([Note: secondary copy])."""
        self.flush()
        w = self.wire
        assert w.secondary_group is not None
        outer = w.world_size // dist.get_world_size(w.secondary_group)
        return comm.all_gather_secondary(secondary, w.secondary_group, outer)

    def nbytes(self, index: int) -> int:
        """Bytes an uncompressed all-gather of unit `index` holds in flight: output and shard."""
        return (self.wire.world_size + 1) * self.wire.part_bytes(index)

    def gathered_bytes(self, index: int, received: torch.Tensor) -> int:
        """Bytes an all-gather delivered, for the stats."""
        return received.numel() * received.element_size()

    @property
    def receive_floor_bytes(self) -> int:
        """What each receive leaves room for per peer ([Note: receive slack]); 0: none."""
        return 0


class ReduceScatter(Strategy):
    """A bucket's reduce-scatter: the backend's, of a rank-major buffer from `allocate`."""

    def allocate(self, num_rows: int, num_cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The rank-major input the copy-in fills: row r is rank r's chunk."""
        return torch.empty(num_rows, num_cols, dtype=dtype, device=device)

    def __call__(self, full: torch.Tensor, divide: comm.Divide | None, average: bool = False) -> comm.CommResult:
        """Reduce-scatter the rank-major `full` (collectives.reduce_scatter_flat)."""
        w = self.wire
        return comm.reduce_scatter_flat(full.view(-1), w.group, w.world_size, w.reduce_impl, None, divide, average)

    def encoded(
        self, full: torch.Tensor, flags: torch.Tensor, codec: Codec, residual: FeedbackResidual | None
    ) -> comm.CommResult:
        """A compressed reduce-scatter (coded.reduce_scatter_encoded)."""
        self.flush()
        w = self.wire
        return coded.reduce_scatter_encoded(full, flags, w.group, w.world_size, codec, residual, None)

    @property
    def divides(self) -> bool:
        """Whether the call applies its `divide` itself ([Note: one pass for the sum])."""
        return comm.divides(self.wire.reduce_impl, self.wire.world_size)

    def averages(self, dtype: torch.dtype) -> bool:
        """Whether the call can return the mean of `dtype` gradients itself (`average=True`,
        [Note: dividing the sum] in engine/reduction.py): NCCL's ReduceOp.AVG, fp32 and bf16
        (fp16 is pre- and post-divided instead)."""
        native = self.wire.semantics.native_average and self.wire.reduce_impl == "native"
        return native and dtype in (torch.float32, torch.bfloat16)


class AllReduce(Strategy):
    """A sum over a group (HSDP across replicas; tensor parallelism's Partial() gradients)."""

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup, average: bool = False) -> comm.CommResult:
        return comm.all_reduce_flat(tensor, group, average)


def native_strategies() -> tuple[AllGather, ReduceScatter, AllReduce]:
    """The backend's own collectives."""
    return AllGather(), ReduceScatter(), AllReduce()


__all__ = ["AllGather", "AllReduce", "GatherResult", "ReduceScatter", "Strategy", "UnitWire", "Wire", "held_bytes"]
