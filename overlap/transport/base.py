"""The transport interface: how the runtime's collectives are issued, completed and waited for.

The runtime decides *what* moves and when (the schedule's actions: which unit, which bucket, in
which order); a transport decides *how*: which collective function, on which stream or thread,
and where the work that follows a collective runs (copy-out, the tag check, the sum of what a
reduction received). One transport is chosen once at wrap by `make_transport` (transport/
__init__.py) from the device and the backend of the group for it ([Note: NCCL is not gloo] in
backend.py):

- `StreamTransport` (streams.py): CUDA. Comm streams and events; the backend's native
  all-gather; the work after a collective is enqueued on its comm stream at issue, and a wait
  is an event wait on the compute stream.
- `HostTransport` (host.py): CPU/gloo. Collectives on gloo's threads; the work after a
  collective runs on the training thread at the wait; gloo's own mechanisms: all-gathers
  through all-to-all, the fused exchange, receive slack, the gather of a pair.

A setting a transport cannot honour raises ValueError at wrap, naming it. A new transport
(say, symmetric-memory or copy-engine collectives) subclasses `Transport`, implements the
methods marked "each transport", and is chosen in `make_transport`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from overlap.compression import Codec
from overlap.compression.feedback import FeedbackResidual
from overlap.transport import backend
from overlap.transport import collectives as comm
from overlap.transport import coded
from overlap.transport.fingerprint import FingerprintCheck


def honoured_timeout(semantics: backend.CommSemantics, timeout: timedelta | None) -> timedelta | None:
    """The timeout the transport's waits pass on (`backend.wait_timeout`); warns, once per wrap,
    when `OverlapConfig.collective_timeout_s` is set where it cannot be honoured. [Note: NCCL is
    not gloo]: on NCCL a timeout would make every wait block the CPU, so its hangs are bounded by
    the process group's timeout and its watchdog instead."""
    honoured = backend.wait_timeout(semantics, timeout)
    if timeout is not None and honoured is None:
        warnings.warn(
            f"overlap.wrap: collective_timeout_s={timeout.total_seconds():g} does not bound the "
            f"training all-gathers and reduce-scatters of {semantics.device_type} tensors over "
            f"{semantics.backend}: a wait with a timeout there would block the CPU on every "
            "collective. A hung collective ends in the process group's watchdog abort instead, "
            "after the timeout given to torch.distributed.init_process_group(timeout=...) (10 "
            "minutes by default for NCCL): set that one. collective_timeout_s still bounds the "
            "blocking waits of wrap's rank-0 sync and of the full state dict's export and load.",
            stacklevel=2,
        )
    return honoured


class UnitWire(NamedTuple):
    """What a transport knows of a unit to plan its collectives: sizes every rank shares."""

    gather_numel: int  # elements one rank sends in an uncompressed all-gather (shard, tag slot)
    gather_itemsize: int  # bytes per element on the wire (the gather dtype)
    reduce_row_bytes: int  # one row of its reduction at most: gradient chunks, used flags (codecs: fp32)
    same_dtype: bool  # gathered in the shard's dtype (no cast) and not aliased ([Note: aliased units])


GatherDone = Callable[[Any, torch.Tensor], None]
"""The runtime's work after a unit's all-gather has arrived: (unit, gathered rows) -> None
(copy-out, tag check, hpZ copy, buffers dropped; `Runtime._finish_gather`)."""


class Transport:
    """Base of the transports: what every one shares (group, timeout, the per-unit plan)."""

    gather_stream: torch.cuda.Stream | None = None  # the stream gathers are issued on (None: host)
    reduce_stream: torch.cuda.Stream | None = None  # the stream reductions are issued on (None: host)
    all_reduce_stream: torch.cuda.Stream | None = None  # HSDP: the stream of the sums across replicas

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        semantics: backend.CommSemantics,
        timer: Any,
        timeout: timedelta | None,
        reduce_impl: str,
        gather_impl: str,
        replicate_group: dist.ProcessGroup | None = None,
        secondary_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.check_settings(semantics, gather_impl)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.semantics = semantics
        self.timer = timer  # observe/timing.py: spans from events (CUDA) or work handles (host)
        self.timeout = honoured_timeout(semantics, timeout)
        self.reduce_impl: comm.ReduceImpl = (
            reduce_impl if reduce_impl != "auto" else semantics.auto_reduce_impl()  # type: ignore[assignment]
        )  # [Note: reduce-scatter through all-to-all] in collectives.py
        self.gather_impl = gather_impl  # OverlapConfig.all_gather_impl
        self.replicate_group = replicate_group
        self.secondary_group = secondary_group
        self.units: list[UnitWire] = []

    # ------------------------------------------------------------------ setup
    @classmethod
    def check_settings(cls, semantics: backend.CommSemantics, gather_impl: str) -> None:
        """Raise ValueError, naming the setting, for one this transport cannot honour."""

    def plan(self, units: list[UnitWire], compressed_params: bool) -> None:
        """Decide per unit, once, from sizes every rank shares (each transport may add)."""
        self.units = units

    def aliases(self, compressed_params: bool) -> bool:
        """Whether units gathered without a cast may be views of their shards ([Note: aliased
        units] in engine/unit_tensors.py): over one rank, without a codec or forced collectives."""
        return comm.runs_locally(self.world_size) and not compressed_params

    def fingerprints(self) -> FingerprintCheck:
        return FingerprintCheck(self.rank, self.device)

    def on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        """Issue on `stream` (None: the current one)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def wait(self, result: comm.CommResult) -> torch.Tensor:
        return comm.wait(result, self.timeout)

    # ------------------------------------------------------------------ gathers
    def before_gather(self, alloc: Callable[[], None]) -> None:
        """Before a gather is issued; `alloc` allocates the unit's unsharded storage. Each transport."""
        raise NotImplementedError

    def all_gather(
        self, index: int, send: torch.Tensor, dtype: torch.dtype, tag: int | None, tag_slot: torch.Tensor | None
    ) -> comm.CommResult:
        """Unit `index`'s uncompressed all-gather of `send` (collectives.all_gather_flat). Each transport."""
        raise NotImplementedError

    def all_gather_encoded(
        self, encoded: torch.Tensor, numel: int, dtype: torch.dtype, codec: Codec, shard_dtype: torch.dtype, tag: int | None
    ) -> comm.CommResult:
        return coded.all_gather_encoded(encoded, numel, self.group, self.world_size, dtype, codec, shard_dtype, tag)

    def all_gather_secondary(self, secondary: torch.Tensor) -> comm.CommResult:
        """hpZ: a backward all-gather from the secondary copies ([Note: secondary copy])."""
        assert self.secondary_group is not None
        outer = self.world_size // dist.get_world_size(self.secondary_group)
        return comm.all_gather_secondary(secondary, self.secondary_group, outer)

    def gather_issued(self, unit: Any, span: Any, done: GatherDone) -> None:
        """`unit.gather` was just issued (inside `on(gather_stream)`). Each transport."""
        raise NotImplementedError

    def wait_gather(self, unit: Any, done: GatherDone) -> None:
        """Make the unit's gathered parameters usable on the compute stream or thread. Each transport."""
        raise NotImplementedError

    def gather_copied(self, unit: Any) -> None:
        """`done` has just copied the unit's gathered rows out; what it enqueues next (the tag
        copy, hpZ's copy) no compute waits for ([Note: gather event] in streams.py)."""

    def check_tag(
        self, fingerprints: FingerprintCheck, unit: Any, gathered: Any, received: torch.Tensor, what: str, compressed: bool
    ) -> None:
        """Compare the gathered tags with `unit.gather_tag` ([Note: collective fingerprints]). Each transport."""
        raise NotImplementedError

    def gather_nbytes(self, index: int) -> int:
        """Bytes an uncompressed all-gather of unit `index` holds while in flight: the output
        and the shard sent."""
        part = self.units[index].gather_numel * self.units[index].gather_itemsize
        return (self.world_size + 1) * part

    def gathered_bytes(self, index: int, received: torch.Tensor) -> int:
        """Bytes an all-gather delivered, for the stats."""
        return received.numel() * received.element_size()

    @property
    def receive_floor_bytes(self) -> int:
        """What each all-to-all leaves room for per peer ([Note: receive slack]); 0: none."""
        return 0

    # ------------------------------------------------------------------ reductions
    @property
    def reduce_divides(self) -> bool:
        """Whether `reduce_scatter` applies its `divide` itself ([Note: one pass for the sum])."""
        return comm.divides(self.reduce_impl, self.world_size)

    def after_reduction(self, fn: Callable[[], torch.Tensor], after: torch.cuda.Event | None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Run `fn` (the work on a reduced shard: its division, its cast) behind `after`, where
        reductions run: (its result, the event after it). Each transport."""
        raise NotImplementedError

    def sum_over(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Sum `tensor` in place over `group` (tensor parallelism's Partial() gradients, before
        the copy-in reads them, `compose.grad_data`); here the training thread waits for it."""
        self.wait(comm.all_reduce_flat(tensor, group))

    def averages(self, dtype: torch.dtype) -> bool:
        """Whether `reduce_scatter` and `all_reduce` can return the mean of `dtype` gradients
        themselves (`average=True`, [Note: dividing the sum] in engine/reduction.py). None do by default."""
        return False

    def before_reduce(self) -> None:
        """Before a reduction is issued. Each transport."""
        raise NotImplementedError

    def reduce_scatter(self, full: torch.Tensor, divide: comm.Divide | None, average: bool = False) -> comm.CommResult:
        """Reduce-scatter the rank-major `full` (collectives.reduce_scatter_flat)."""
        return comm.reduce_scatter_flat(full.view(-1), self.group, self.world_size, self.reduce_impl, None, divide, average)

    def reduce_scatter_encoded(
        self, full: torch.Tensor, flags: torch.Tensor, codec: Codec, residual: FeedbackResidual | None
    ) -> comm.CommResult:
        return coded.reduce_scatter_encoded(full, flags, self.group, self.world_size, codec, residual, None)

    def reduce_issued(self, result: comm.CommResult, span: Any) -> tuple[torch.cuda.Event | None, torch.Tensor | None]:
        """A reduction was just issued (inside `on(reduce_stream)`): (event, reduced shard) where
        the transport already has them, else (None, None). Each transport."""
        raise NotImplementedError

    def release_reduce(self, result: comm.CommResult, event: torch.cuda.Event | None) -> torch.Tensor | None:
        """The compute side is done with the reduction's input: the reduced shard where the
        transport only gets it now (host), else None. Each transport."""
        raise NotImplementedError

    def all_reduce(
        self, reduced: torch.Tensor, after: torch.cuda.Event | None, label: str, average: bool = False
    ) -> tuple[comm.CommResult, torch.cuda.Event | None]:
        """HSDP: sum (`average`: average) a reduced shard across replicas ([Note: hybrid sharding]).
        Each transport."""
        raise NotImplementedError

    def finish_reduce(
        self, event: torch.cuda.Event | None, all_reduce: comm.CommResult | None, all_reduce_event: torch.cuda.Event | None
    ) -> None:
        """Make a reduced (and HSDP-summed) shard usable on the compute stream or thread. Each transport."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the fused exchange
    def can_fuse(self, index: int) -> bool:
        """Whether unit `index`'s backward all-gather may travel with a reduction ([Note: fused
        exchange] in transport/host.py). Only the host transport fuses."""
        return False

    def fits_with(self, reduce_cols: int, index: int, dtype: torch.dtype) -> bool:
        return False

    def reduce_scatter_and_gather(
        self, full: torch.Tensor, reduce_cols: int, divide: comm.Divide | None
    ) -> tuple[comm.CommResult, comm.CommResult]:
        raise NotImplementedError(f"{type(self).__name__} does not fuse exchanges")
