"""The CPU transport: gloo's worker threads, host waits, and gloo's own mechanisms.

A collective runs on gloo's threads (an async work handle); the training thread waits for it
where the runtime waits (`wait_gather`, `release_reduce`, `finish_reduce`) and then does the
copies itself. What makes gloo cheaper on a CPU, all decided here from sizes every rank shares:

- small units gathered through all-to-all ([Note: all-gather through all-to-all] in
  collectives.py), and gradients reduced through it ([Note: reduce-scatter through all-to-all]);
- every all-to-all as point-to-point messages, receives posted first, sends off the training
  thread ([Note: receive before send], [Note: sends posted off the training thread] in
  pairwise.py);
- the receive slack every all-to-all leaves ([Note: receive slack] in collectives.py);
- the backward all-gather travelling in a reduction's all-to-all ([Note: fused exchange]);
- at two ranks, the gather of a pair ([Note: gather of a pair] in collectives.py);
- freed host memory kept for reuse ([Note: CPU page faults]).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from overlap.compression import Codec
from overlap.compression.feedback import FeedbackResidual
from overlap.transport import collectives as comm
from overlap.transport import coded
from overlap.transport.base import GatherDone, Transport, UnitWire
from overlap.transport.fingerprint import TAG_NUMEL, FingerprintCheck, HostTags, host_byte_tags


# [Note: CPU page faults]
# glibc serves blocks above M_MMAP_THRESHOLD (128 KiB at first, adapting up to 32 MiB) with mmap
# and returns them with munmap, and trims the heap top above M_TRIM_THRESHOLD. Every unsharded
# buffer, gather output and reduce-scatter buffer ZeRO-3 allocates is then fresh memory whose
# pages fault on first touch: W1 (12 MiB units) measured ~7 ms per copy-out on fresh pages against
# ~1.2 ms on reused ones, ~90 ms a step in all. Raising both thresholds makes freed blocks stay in
# the heap and be reused, as CUDA's caching allocator does on GPUs.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@functools.cache
def keep_freed_cpu_memory() -> bool:
    """Process-wide, once: keep freed large blocks for reuse (see [Note: CPU page faults]).
    `wrap` asks for it through engine/process_hooks.py, which lists it and can keep it out."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc (musl, macOS): nothing to tune
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    if not ok:
        warnings.warn("overlap: mallopt refused the CPU allocator settings; continuing without")
    return ok


# [Note: fused exchange]
# In backward, a unit's gradient reduction and the prefetch all-gather of a unit further on
# are issued back to back (the schedule's post_backward: Free, Reduce, Gather). When both
# go through all-to-all in the same group (CPU/gloo: reduce_scatter_impl and
# all_gather_impl resolve to all_to_all, no codec, no cast, no hpZ), they travel as one:
# row r of the send buffer is [the gradient chunk for rank r | this rank's shard], so rank r
# receives its chunk to sum and every rank's shard ([collectives.reduce_scatter_and_gather]). One
# collective instead of two per unit in backward: on two CPU cores a gloo collective costs
# ~200-300 µs of CPU whatever its size at these sizes, while the copy of a small shard into
# the send rows costs a few. The values exchanged are the same, so results are bitwise
# those of the two collectives. Every rank sees the same actions in the same order
# ([Note: collective order] in engine/schedule.py) and decides from sizes and settings they share,
# so the collectives still pair. The first step (order checks between the two) is unfused.


class HostTransport(Transport):
    """CPU tensors over gloo: host waits, all-to-all gathers, fused exchange, slack, pair gather."""

    slack: comm.RecvSlack | None = None  # [Note: receive slack]
    pair: bool = False  # [Note: gather of a pair]

    def plan(self, units: list[UnitWire], compressed_params: bool) -> None:
        super().plan(units, compressed_params)
        self.gather_impls = [self._resolve_gather_impl(i) for i in range(len(units))]
        self.fusable = [self._can_fuse(i) for i in range(len(units))]
        self.slack = self._receive_slack()
        # [Note: gather of a pair] in collectives.py: two ranks, uncompressed, impl "auto"
        self.pair = (
            self.world_size == 2
            and self.gather_impl == "auto"
            and not compressed_params
            and self.secondary_group is None
            and not comm.runs_locally(self.world_size)
        )

    def _part_bytes(self, index: int) -> int:
        return self.units[index].gather_numel * self.units[index].gather_itemsize

    def _resolve_gather_impl(self, index: int) -> comm.GatherImpl:
        """Unit `index`'s uncompressed all-gather ([Note: all-gather through all-to-all] in
        collectives.py), decided from sizes every rank shares."""
        if self.gather_impl != "auto":
            return self.gather_impl  # type: ignore[return-value]
        return self.semantics.auto_gather_impl(self.world_size * self._part_bytes(index))  # type: ignore[return-value]

    def _receive_slack(self) -> comm.RecvSlack | None:
        """What every all-to-all leaves room for ([Note: receive slack] in collectives.py): the
        largest message of a small exchange, an all-to-all gather or a unit's reduction, or both
        at once where they fuse. From the layouts (every parameter trainable: an upper bound), so
        every rank computes the same."""
        small = [i for i, impl in enumerate(self.gather_impls) if impl == "all_to_all"]
        if comm.runs_locally(self.world_size) or not small:
            return None
        most_gather = max(self._part_bytes(i) for i in small)
        most_reduce = max(self.units[i].reduce_row_bytes for i in small)
        fuse = any(self.fusable)
        floor = most_gather + most_reduce if fuse else max(most_gather, most_reduce)
        return comm.RecvSlack(dist.get_rank(self.group), -(-floor // 64) * 64)

    def _can_fuse(self, index: int) -> bool:
        """Whether a backward all-gather of unit `index` may ride in a reduction's all-to-all
        ([Note: fused exchange]): more than one rank, no cast, no hpZ (and, checked at each
        reduction, no codec)."""
        return (
            self.gather_impls[index] == "all_to_all"
            and self.reduce_impl == "all_to_all"
            and self.secondary_group is None
            and self.units[index].same_dtype
            and not comm.runs_locally(self.world_size)
        )

    # ------------------------------------------------------------------ gathers
    def before_gather(self, alloc: Any) -> None:
        pass  # the unsharded storage is allocated at the wait, before copy-out

    def all_gather(
        self, index: int, send: torch.Tensor, dtype: torch.dtype, tag: int | None, tag_slot: torch.Tensor | None
    ) -> comm.CommResult:
        if self.pair:
            return comm.all_gather_pair(send, self.group, self.rank, dtype, tag, tag_slot, self.slack)
        return comm.all_gather_flat(
            send, self.group, self.world_size, dtype, tag, tag_slot, self.gather_impls[index], self.slack
        )

    def gather_issued(self, unit: Any, span: Any, done: GatherDone) -> None:
        self.timer.stop(span, work=unit.gather.work)

    def wait_gather(self, unit: Any, done: GatherDone) -> None:
        gathered = self.wait(unit.gather)
        self.timer.waited(unit.gather.work)
        done(unit, gathered)

    def check_tag(
        self, fingerprints: FingerprintCheck, unit: Any, gathered: Any, received: torch.Tensor, what: str, compressed: bool
    ) -> None:
        """After copy-out, from the tags it copied (`HostTags`), or from `gathered` where they
        cannot be read in place. A compressed gather's tags end its byte rows (`received`)."""
        if compressed:
            fingerprints.check_host(host_byte_tags(received, self.world_size), unit.gather_tag, what)
            return
        tags = unit.tag_out
        if unit.host_tags is not None and unit.host_tags.trailers is tags:
            fingerprints.check_host(unit.host_tags, unit.gather_tag, what)
        elif tags is not None and HostTags.fits(tags, self.world_size):
            unit.host_tags = HostTags(tags, self.world_size)
            fingerprints.check_host(unit.host_tags, unit.gather_tag, what)
        else:
            if isinstance(gathered, list):  # [Note: gather of a pair]: each row ends in its tag
                gathered = torch.cat([row[-TAG_NUMEL:] for row in gathered])
            fingerprints.check(gathered, self.world_size, unit.gather_tag, what)

    def gather_nbytes(self, index: int) -> int:
        """Natively the output and the shard sent; through all-to-all the send copies and the
        receive buffer with its slack ([Note: receive slack] in collectives.py)."""
        part = self._part_bytes(index)
        if self.pair:  # the shard sent and the peer's part received ([Note: gather of a pair])
            return part + max(part, self.receive_floor_bytes)
        if comm.runs_locally(self.world_size) or self.gather_impls[index] == "native":
            return (self.world_size + 1) * part
        floor = self.receive_floor_bytes
        return self.world_size * part + part + (self.world_size - 1) * max(part, floor)

    def gathered_bytes(self, index: int, received: torch.Tensor) -> int:
        if self.pair:  # the peer's part only was received; both rows count, as a native gather's
            return self.world_size * self._part_bytes(index)
        return super().gathered_bytes(index, received)

    @property
    def receive_floor_bytes(self) -> int:
        return 0 if self.slack is None else self.slack.floor_bytes

    # ------------------------------------------------------------------ reductions
    def before_reduce(self) -> None:
        pass

    def reduce_scatter(self, full: torch.Tensor, divide: comm.Divide | None, average: bool = False) -> comm.CommResult:
        assert not average, "gloo has no ReduceOp.AVG: the host transport divides (averages() is False)"
        return comm.reduce_scatter_flat(full.view(-1), self.group, self.world_size, self.reduce_impl, self.slack, divide)

    def reduce_scatter_encoded(
        self, full: torch.Tensor, flags: torch.Tensor, codec: Codec, residual: FeedbackResidual | None
    ) -> comm.CommResult:
        return coded.reduce_scatter_encoded(full, flags, self.group, self.world_size, codec, residual, self.slack)

    def reduce_issued(self, result: comm.CommResult, span: Any) -> tuple[torch.cuda.Event | None, torch.Tensor | None]:
        self.timer.stop(span, work=result.work)
        return None, None

    def after_reduction(self, fn: Callable[[], torch.Tensor], after: torch.cuda.Event | None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        return fn(), None  # the training thread, now

    def release_reduce(self, result: comm.CommResult, event: torch.cuda.Event | None) -> torch.Tensor | None:
        # wait for the work; sum (or decode) what all-to-all received
        reduced = self.wait(result)
        self.timer.waited(result.work)
        return reduced

    def all_reduce(
        self, reduced: torch.Tensor, after: torch.cuda.Event | None, label: str, average: bool = False
    ) -> tuple[comm.CommResult, torch.cuda.Event | None]:
        assert self.replicate_group is not None and not average
        span = self.timer.start("collective", "all_reduce", label, None, reduced.numel() * reduced.element_size())
        result = comm.all_reduce_flat(reduced, self.replicate_group)
        self.timer.stop(span, work=result.work)
        return result, None

    def finish_reduce(
        self, event: torch.cuda.Event | None, all_reduce: comm.CommResult | None, all_reduce_event: torch.cuda.Event | None
    ) -> None:
        if all_reduce is not None:
            self.wait(all_reduce)
            self.timer.waited(all_reduce.work)

    # ------------------------------------------------------------------ the fused exchange
    def can_fuse(self, index: int) -> bool:
        return self.fusable[index]

    def fits_with(self, reduce_cols: int, index: int, dtype: torch.dtype) -> bool:
        """Whether a reduction of `reduce_cols` per row and unit `index`'s shard fit in the
        receive slack together ([Note: receive slack] in collectives.py); decided from sizes
        every rank shares."""
        assert self.slack is not None
        numel = reduce_cols + self.units[index].gather_numel
        return numel * dtype.itemsize <= self.slack.floor_bytes

    def reduce_scatter_and_gather(
        self, full: torch.Tensor, reduce_cols: int, divide: comm.Divide | None
    ) -> tuple[comm.CommResult, comm.CommResult]:
        return comm.reduce_scatter_and_gather(full, reduce_cols, self.group, self.slack, divide)
