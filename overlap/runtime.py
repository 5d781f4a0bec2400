"""Execution: carries out the schedule's actions with real tensors, streams and work handles.

[Note: buffer lifetime]
A collective's buffers live in the `CommResult` it returns, and that result is stored with the
unit (gathers) or the bucket (reductions) until the matching wait action; only then are the
references dropped. On CUDA the wait first makes the compute stream wait for the comm stream's
event, so by the time the caching allocator may hand a freed block to the compute stream, the
comm stream is done with it. No `record_stream` anywhere.

[Note: streams]
CUDA: `gather_stream` runs all-gathers and their copy-out; `reduce_stream` runs reduce-scatters
and the decode/sum of what they received; `all_reduce_stream` (HSDP only) runs the sums across
replicas, so that an inter-node all-reduce never holds up the next bucket's reduce-scatter
(FSDP2 does the same). They are separate so that a reduce-scatter never queues behind a
prefetched all-gather in the same stream. All are created with high priority so their small copy
kernels are not starved by compute. Each begins its work by waiting on the
compute stream at issue time, and the unsharded storage is (re)allocated on the compute stream, so
a block the compute stream freed is never written by a comm stream before compute is done with it.
CPU (gloo): collectives run on gloo's worker threads (async work handles); the training thread
does the copies when it waits.

[Note: no host sync in the hot path]
After the first step nothing here blocks the CPU on a CUDA device: no pageable host-to-device
copies (the used flags are cached on the device per pattern), no `.item()`/`.tolist()`/
`bool(tensor)` (the used counts are read back only for a bucket in which this rank left a
parameter without gradient, the one documented exception, at the end of backward), no
`Work.wait(timeout)` on NCCL work ([Note: NCCL is not gloo] in backend.py).
tests/test_host_sync.py records every such call made from library code and expects none.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import time
import warnings
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
import torch.autograd.profiler as _profiler
from torch.profiler import record_function

_NO_LABEL = contextlib.nullcontext()

from overlap import backend, comm, kernels
from overlap.compression import Codec
from overlap.compression.feedback import FeedbackResidual, make_residual_format
from overlap.fingerprint import (
    TAG_NUMEL,
    TRAIL_MASK,
    FingerprintCheck,
    HostTags,
    Tag,
    byte_tags,
    host_byte_tags,
    signature,
    tag_view,
)
from overlap.memory import MemoryAccount, nbytes
from overlap.schedule import (
    Action,
    CheckOrder,
    Free,
    Gather,
    Reduce,
    ReleaseReduce,
    WaitGather,
    WaitReduce,
)
from overlap.stats import StatsRecorder
from overlap.timing import HostTimer, SpanTimer
from overlap.trace import TraceRecorder
from overlap.units import UnitLayout


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
    """Process-wide, once: keep freed large blocks for reuse (see [Note: CPU page faults])."""
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


def _phase(verb: str, what: str) -> contextlib.AbstractContextManager:
    """`record_function("overlap::<verb> <what>")` while a profiler records (tests, benchmarks and
    `overlap report` find phases by these labels); nothing otherwise, since entering a
    record_function costs microseconds per call and the hooks run several per unit and step."""
    if _profiler._is_profiler_enabled:  # a module global, set by every torch profiler
        return record_function(f"overlap::{verb} {what}")
    return _NO_LABEL


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
    gather: comm.CommResult | None = None  # CPU: the all-gather until its wait; CUDA: dropped at issue
    gather_event: torch.cuda.Event | None = None  # CUDA: copy-out done on the gather stream
    gather_bytes: int = 0  # accounted bytes of the gather buffers held (see _drop_gather)
    secondary: torch.Tensor | None = None  # hpZ: see [Note: secondary copy]
    encoded: torch.Tensor | None = None  # wire bytes of the shard this step: _encoded_shard
    gather_from_secondary: bool = False  # the gather in flight reads the secondary copies
    needs_secondary: bool = True  # hpZ: False for kept and root units (no backward gather)
    trainable: list[tuple[Any, nn.Parameter]] = field(init=False)  # (slot, sharded param) with grads
    copy_out_views: list[torch.Tensor] | None = None  # per slot, its span of unsharded_flat
    gather_tag: int | None = None  # the tag of the all-gather in flight ([Note: collective fingerprints])
    tag_out: torch.Tensor | None = None  # copy-out's destination for the gathered tags (CPU: checked there)
    signature: int = 0  # of the trainable pattern, in the tags
    copy_out_sizes: list[int] | None = None  # per slot, its padded span of the gathered rows
    copy_out_cols: list[int] | None = None  # per slot, the data columns of its chunk
    aliased: bool = False  # unsharded params are views of the shard ([Note: aliased units])
    copy_out_bound: tuple[Any, Any] | None = None  # (gather dtype, outs) -> bound copy-out
    host_tags: HostTags | None = None  # CPU: reads tag_out's tags ([Note: collective fingerprints])

    def __post_init__(self) -> None:
        self._plan_grads()

    def _plan_grads(self) -> None:
        """What the reduce path reads every step, derived once per gradient layout."""
        slots = self.layout.slots
        self.trainable = [(s, p) for s, p in zip(slots, self.sharded_params) if s.requires_grad]
        self.signature = signature(tuple(s.requires_grad for s in slots))
        self.grad_params = [p for s, p in zip(slots, self.unsharded_params) if s.requires_grad]
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

    def alias_shard(self) -> None:
        """Make the unsharded parameters views of the shard ([Note: aliased units])."""
        params = []
        for slot, old in zip(self.layout.slots, self.unsharded_params):
            assert slot.chunk_numel == slot.numel, f"{self.layout.label}: only one rank's layout aliases"
            view = self.shard[slot.shard_offset : slot.shard_offset + slot.numel].view(slot.shape)
            params.append(nn.Parameter(view, requires_grad=old.requires_grad))
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


def _widest(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype a bucket of units of `dtypes` is reduced in, without `reduce_dtype`: the widest
    ([Note: one dtype per unit] in units.py). A bf16 or fp16 gradient summed in fp32 and rounded
    once equals its sum in its own dtype at two ranks (the double rounding is innocuous: fp32 has
    more than 2p+2 bits), so parity with DDP, which reduces each dtype's bucket on its own, holds."""
    return functools.reduce(torch.promote_types, dtypes)


@dataclass
class PendingReduce:
    """A bucket from its reduce-scatter to the end of backward ([Note: reduce buffers] in
    schedule.py): first with its input alive (`result`), then released, with only the reduced
    shard (`reduced`, 1/N of the input) and, under HSDP, its all-reduce across replicas."""

    result: comm.CommResult | None  # the reduce-scatter while its input is alive
    event: torch.cuda.Event | None  # CUDA: the reduce stream after the reduce-scatter and its sum
    all_used: bool  # this rank produced a gradient for every trainable parameter of the bucket
    input_bytes: int  # accounted bytes of the input buffers (released with `result`)
    reduced: torch.Tensor | None = None  # [summed gradients | used counts]
    averaged: bool = False  # the reduction's sum already divided its gradients ([Note: one pass for the sum])
    all_reduce: comm.CommResult | None = None  # HSDP: the sum of `reduced` across replicas
    all_reduce_event: torch.cuda.Event | None = None  # CUDA: the all-reduce stream after it


@dataclass
class Runtime:
    units: list[UnitTensors]
    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    gather_dtype: torch.dtype | None  # None: each unit's own dtype
    reduce_dtype: torch.dtype | None
    stats: StatsRecorder
    timeout: timedelta | None = None
    trace: TraceRecorder | None = None
    timer: SpanTimer = field(default_factory=HostTimer)  # wrap passes make_timer(device)
    reduce_impl: comm.ReduceImpl = "native"
    gather_impl: str = "native"  # OverlapConfig.all_gather_impl: "auto", "native" or "all_to_all"
    param_codec: Codec | None = None  # None: uncompressed all-gather
    grad_codec: Codec | None = None  # None: uncompressed reduce-scatter (reduce_impl)
    residual_dtype: torch.dtype | None = None  # error feedback on when set
    residuals: dict[tuple[int, ...], FeedbackResidual] = field(default_factory=dict)
    """Error-feedback residual per bucket (its units): a row of gradient columns per peer rank."""
    replicate_group: dist.ProcessGroup | None = None
    """HSDP: reduced shards are summed across replicas here. See [Note: hybrid sharding] in wrap.py."""
    secondary_group: dist.ProcessGroup | None = None
    """hpZ: backward all-gathers run here, from the secondary copies ([Note: secondary copy])."""
    memory: MemoryAccount = field(default_factory=MemoryAccount)
    gather_stream: torch.cuda.Stream | None = field(init=False, default=None)
    reduce_stream: torch.cuda.Stream | None = field(init=False, default=None)
    all_reduce_stream: torch.cuda.Stream | None = field(init=False, default=None)
    _pending: dict[int, PendingReduce] = field(init=False, default_factory=dict)
    _pending_units: dict[int, tuple[int, ...]] = field(init=False, default_factory=dict)
    step: int = field(init=False, default=0)  # steps begun on this rank, in the tags
    reduce_trail: int = field(init=False, default=0)  # the reductions since the last roll: [Note: reduction trail]
    last_trail: int = field(init=False, default=0)  # those of the last step that reduced, in the tags
    _flags: dict[tuple[tuple[bool, ...], torch.dtype], torch.Tensor] = field(init=False, default_factory=dict)
    _labels: dict[tuple[int, ...], str] = field(init=False, default_factory=dict)  # _span_label's
    _bound_copy_in: dict[tuple, Any] = field(init=False, default_factory=dict)  # by bucket layout

    def __post_init__(self) -> None:
        self.num_replicas = 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)
        self.semantics = backend.semantics(self.group, self.device)
        # [Note: NCCL is not gloo]: on NCCL a timeout would make every wait block the CPU; its
        # hangs are bounded by the process group's timeout and its watchdog instead.
        self.timeout = backend.wait_timeout(self.semantics, self.timeout)
        if self.device.type == "cuda":  # [Note: streams]
            self.gather_stream = torch.cuda.Stream(self.device, priority=-1)
            self.reduce_stream = torch.cuda.Stream(self.device, priority=-1)
            if self.replicate_group is not None:
                self.all_reduce_stream = torch.cuda.Stream(self.device, priority=-1)
        self.memory.add("sharded_params", sum(nbytes(u.shard) for u in self.units))
        self.fingerprints = FingerprintCheck(self.rank, self.device)
        self._tagged = [u.tagged_shard() for u in self.units]
        # the tag's int64 slot in each tagged shard, for gathers without a cast (no view per gather)
        self._tag_slots = [None if t is None else tag_view(t, u.shard.numel()) for t, u in zip(self._tagged, self.units)]
        self._verbs = self._make_verbs()
        if comm.runs_locally(self.world_size) and self.param_codec is None:
            for unit in self.units:  # [Note: aliased units]
                if (self.gather_dtype or unit.shard.dtype) == unit.shard.dtype:
                    unit.alias_shard()
        self._gather_impl = [self._resolve_gather_impl(i) for i in range(len(self.units))]
        self._fusable = [self._can_fuse(i) for i in range(len(self.units))]
        self._slack = self._receive_slack()
        # [Note: gather of a pair] in comm.py: two ranks on the CPU, uncompressed, impl "auto"
        self._pair = (
            self.world_size == 2
            and self.gather_impl == "auto"
            and self.gather_stream is None
            and self.param_codec is None
            and self.secondary_group is None
            and not comm.runs_locally(self.world_size)
        )

    def _resolve_gather_impl(self, index: int) -> comm.GatherImpl:
        """Unit `index`'s uncompressed all-gather ([Note: all-gather through all-to-all] in
        comm.py), decided from sizes every rank shares."""
        if self.gather_impl != "auto":
            return self.gather_impl  # type: ignore[return-value]
        return self.semantics.auto_gather_impl(self.world_size * self._gather_part_bytes(index))  # type: ignore[return-value]

    def _gather_numel(self, index: int) -> int:
        """Elements one rank sends in an uncompressed all-gather of unit `index`: its shard,
        with the tag slot when tags are on ([Note: collective fingerprints])."""
        tagged = self._tagged[index]
        return (self.units[index].shard if tagged is None else tagged).numel()

    def _gather_part_bytes(self, index: int) -> int:
        unit = self.units[index]
        return self._gather_numel(index) * (self.gather_dtype or unit.shard.dtype).itemsize

    def _receive_slack(self) -> comm.RecvSlack | None:
        """What every all-to-all leaves room for ([Note: receive slack] in comm.py): the largest
        message of a small exchange, an all-to-all gather or a unit's reduction, or both at
        once where they fuse. From the layouts (every parameter trainable: an upper bound), so
        every rank computes the same."""
        small = [i for i, impl in enumerate(self._gather_impl) if impl == "all_to_all"]
        if comm.runs_locally(self.world_size) or not small:
            return None
        def reduce_bytes(i: int) -> int:  # one row: gradient chunks and used flags
            layout = self.units[i].layout
            itemsize = (self.reduce_dtype or self.units[i].unsharded_flat.dtype).itemsize
            return (layout.shard_numel + len(layout.slots)) * max(itemsize, 4)  # codecs: fp32 at most

        most_gather = max(self._gather_part_bytes(i) for i in small)
        most_reduce = max(reduce_bytes(i) for i in small)
        fuse = any(self._fusable)
        floor = most_gather + most_reduce if fuse else max(most_gather, most_reduce)
        return comm.RecvSlack(dist.get_rank(self.group), -(-floor // 64) * 64)

    def _can_fuse(self, index: int) -> bool:
        """Whether a backward all-gather of unit `index` may ride in a reduction's all-to-all
        ([Note: fused exchange]): CPU, more than one rank, no cast, no hpZ (and, checked at
        each reduction, no codec)."""
        unit = self.units[index]
        return (
            self._gather_impl[index] == "all_to_all"
            and self.reduce_impl == "all_to_all"
            and self.gather_stream is None
            and self.secondary_group is None
            and not unit.aliased
            and not comm.runs_locally(self.world_size)
            and (self.gather_dtype or unit.shard.dtype) == unit.shard.dtype
        )

    # ------------------------------------------------------------------ dispatch
    def run(self, actions: list[Action]) -> None:
        verbs = self._verbs
        skip = -1  # the index of a Gather already issued with the Reduce before it
        for k, action in enumerate(actions):
            if k == skip:
                continue
            try:
                if type(action) is Reduce and k + 1 < len(actions):
                    fused = self._fused_gather(action, actions[k + 1])
                    if fused is not None:
                        self.reduce(action.bucket, action.units, fused)
                        skip = k + 1
                        continue
                verbs[type(action)](action)
            except comm.CollectiveError as e:  # [Note: collective failures] in comm.py
                raise comm.CollectiveError(f"overlap: rank {self.rank}: the {self._describe(action)} {e}") from e

    # [Note: fused exchange]
    # In backward, a unit's gradient reduction and the prefetch all-gather of a unit further on
    # are issued back to back (the schedule's post_backward: Free, Reduce, Gather). When both
    # go through all-to-all in the same group (CPU/gloo: reduce_scatter_impl and
    # all_gather_impl resolve to all_to_all, no codec, no cast, no hpZ), they travel as one:
    # row r of the send buffer is [the gradient chunk for rank r | this rank's shard], so rank r
    # receives its chunk to sum and every rank's shard ([comm.reduce_scatter_and_gather]). One
    # collective instead of two per unit in backward: on two CPU cores a gloo collective costs
    # ~200-300 µs of CPU whatever its size at these sizes, while the copy of a small shard into
    # the send rows costs a few. The values exchanged are the same, so results are bitwise
    # those of the two collectives. Every rank sees the same actions in the same order
    # ([Note: collective order] in schedule.py) and decides from sizes and settings they share,
    # so the collectives still pair. The first step (order checks between the two) is unfused.

    def _fused_gather(self, reduce: Reduce, following: Action) -> Gather | None:
        """`following`, if it is a Gather that may travel with `reduce` ([Note: fused exchange])."""
        if type(following) is not Gather or not following.for_backward or not self._fusable[following.unit]:
            return None
        if self.param_codec is not None or self.grad_codec is not None:
            return None
        dtype = self.reduce_dtype or _widest(self.units[i].unsharded_flat.dtype for i in reduce.units)
        return following if dtype == self.units[following.unit].shard.dtype else None

    def _make_verbs(self) -> dict[type, Any]:
        """Each action type's verb: one dict lookup per action (a `match` over seven class
        patterns cost microseconds per action, several actions per unit and step)."""
        return {
            Gather: lambda a: self.gather(a.unit, a.for_backward),
            WaitGather: lambda a: self.wait_gather(a.unit),
            Free: lambda a: self.free(a.unit),
            Reduce: lambda a: self.reduce(a.bucket, a.units),
            ReleaseReduce: lambda a: self.release_reduce(a.bucket),
            WaitReduce: lambda a: self.wait_reduce(a.bucket, a.units),
            CheckOrder: lambda a: self.check_order(a.what, a.order_hash, a.order),
        }

    def _describe(self, action: Action) -> str:
        match action:
            case Gather(unit) | WaitGather(unit) | Free(unit):
                return f"all-gather of {self.units[unit].layout.label}"
            case Reduce(bucket, units) | ReleaseReduce(bucket, units) | WaitReduce(bucket, units):
                return f"gradient reduction of {self._bucket_label(bucket, units)}"
            case CheckOrder(what, _, _):
                return f"{what} order check (an all-gather of hashes)"
        return repr(action)

    def _stream(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ verbs
    def gather(self, index: int, for_backward: bool = False) -> None:
        unit = self.units[index]
        if unit.aliased:
            return  # [Note: aliased units]
        dtype = self.gather_dtype or unit.shard.dtype
        unit.gather_from_secondary = for_backward and unit.secondary is not None
        with _phase("gather", unit.layout.label):
            if self.gather_stream is not None:
                self.gather_stream.wait_stream(torch.cuda.current_stream(self.device))
                self._alloc_unsharded(unit)  # on the compute stream, see [Note: streams]
            span = self.timer.start("collective", "gather", unit.layout.label, self.gather_stream, unit.unsharded_nbytes)
            with self._stream(self.gather_stream):
                if unit.gather_from_secondary:
                    assert self.secondary_group is not None and unit.secondary is not None
                    outer = self.world_size // dist.get_world_size(self.secondary_group)
                    unit.gather_tag = None  # untagged ([Note: collective fingerprints])
                    unit.gather = comm.all_gather_secondary(unit.secondary, self.secondary_group, outer)
                elif self.param_codec is None:
                    tagged = self._tagged[index] if self.world_size > 1 else None
                    unit.gather_tag = None if tagged is None else self._tag(index, unit, for_backward)
                    send = unit.shard if tagged is None else tagged
                    if self._pair:
                        unit.gather = comm.all_gather_pair(
                            send, self.group, self.rank, dtype, unit.gather_tag, self._tag_slots[index], self._slack
                        )
                    else:
                        unit.gather = comm.all_gather_flat(
                            send, self.group, self.world_size, dtype, unit.gather_tag, self._tag_slots[index],
                            self._gather_impl[index], self._slack,
                        )
                else:
                    unit.gather_tag = self._tag(index, unit, for_backward) if self.world_size > 1 else None
                    unit.gather = comm.all_gather_encoded(
                        self._encoded_shard(unit, for_backward), unit.shard.numel(), self.group, self.world_size,
                        dtype, self.param_codec, unit.shard.dtype, unit.gather_tag,
                    )
                result = unit.gather
                unit.gather_bytes = nbytes(result.output, *result.inputs)
                self.memory.add("gather_buffers", unit.gather_bytes)
                if self.gather_stream is not None:
                    # the gather stream waits, not the CPU
                    gathered = comm.wait(result, self.timeout)
                    self.timer.stop(span, self.gather_stream)
                    self._check_tag(unit, gathered, result.output)  # on the device, before the event below
                    self._keep_secondary(unit, gathered)
                    self._copy_out(unit, gathered)
                    unit.gather_event = self.gather_stream.record_event()
                    # Later gather-stream allocations are ordered after this copy-out, so the
                    # buffers can go now: an in-flight prefetch holds the unsharded storage
                    # only, not 2x ([Note: buffer lifetime]).
                    del gathered
                    self._drop_gather(unit)
                else:
                    self.timer.stop(span, work=result.work)
        received = result.output
        gathered = self.world_size * self._gather_part_bytes(index) if self._pair else received.numel() * received.element_size()
        self.stats.record_issue("gather", gathered)

    def _tag(self, index: int, unit: UnitTensors, for_backward: bool) -> int:
        phase = 2 if for_backward else (0 if torch.is_grad_enabled() else 1)
        return Tag(self.step, phase, index, unit.signature ^ self.last_trail).pack()

    def _check_tag(self, unit: UnitTensors, gathered: torch.Tensor, received: torch.Tensor) -> None:
        """CUDA: before copy-out, on the device. CPU: after copy-out, from the tags it copied
        (`HostTags`), or from `gathered` where they cannot be read in place. A compressed
        gather's tags end its byte rows (`received`, before decoding)."""
        if unit.gather_tag is None:
            return
        what = f"all-gather of {unit.layout.label}"
        if self.param_codec is not None:
            if self.gather_stream is None:
                self.fingerprints.check_host(host_byte_tags(received, self.world_size), unit.gather_tag, what)
            else:
                self.fingerprints.check_values(byte_tags(received, self.world_size), unit.gather_tag, what)
            return
        tags = unit.tag_out
        if unit.host_tags is not None and unit.host_tags.trailers is tags:
            self.fingerprints.check_host(unit.host_tags, unit.gather_tag, what)
        elif self.gather_stream is None and tags is not None and HostTags.fits(tags, self.world_size):
            unit.host_tags = HostTags(tags, self.world_size)
            self.fingerprints.check_host(unit.host_tags, unit.gather_tag, what)
        else:
            if isinstance(gathered, list):  # [Note: gather of a pair]: each row ends in its tag
                gathered = torch.cat([row[-TAG_NUMEL:] for row in gathered])
            self.fingerprints.check(gathered, self.world_size, unit.gather_tag, what)

    def check_fingerprints(self) -> None:
        """Once per step: CUDA reports a step late what the device compared ([Note: collective
        fingerprints]); on CPU every all-gather was checked at its wait."""
        self.fingerprints.check_pending()

    def _drop_gather(self, unit: UnitTensors) -> None:
        unit.gather = None  # [Note: buffer lifetime]
        self.memory.sub("gather_buffers", unit.gather_bytes)
        unit.gather_bytes = 0

    def wait_gather(self, index: int) -> None:
        unit = self.units[index]
        if unit.aliased:
            unit.swap_in(unit.unsharded_params)  # [Note: aliased units]
            return
        assert unit.gather is not None or unit.gather_event is not None, (
            f"rank {self.rank}: unit {index} waited before gather"
        )
        stall = self.timer.start("stall", "gather", unit.layout.label)
        with _phase("wait_gather", unit.layout.label):
            if unit.gather_event is not None:
                torch.cuda.current_stream(self.device).wait_event(unit.gather_event)
                unit.gather_event = None
            else:
                assert unit.gather is not None
                gathered = comm.wait(unit.gather, self.timeout)
                self.timer.waited(unit.gather.work)
                self._alloc_unsharded(unit)
                self._copy_out(unit, gathered)  # its tags too: checked next, before any use
                self._check_tag(unit, gathered, unit.gather.output)
                self._keep_secondary(unit, gathered)
                del gathered
                self._drop_gather(unit)
            unit.swap_in(unit.unsharded_params)
        self.timer.stop(stall)

    def _encoded_shard(self, unit: UnitTensors, for_backward: bool) -> torch.Tensor:
        """The unit's shard encoded for a compressed all-gather. A forward gather encodes it
        and keeps the bytes; the backward gather of the same step resends them (the shard only
        changes at the optimizer step, after backward). The bytes are dropped once the unit's
        gradients are reduced, so the next step's forward encodes the updated shard. (Tensor
        version counters cannot tell: the DTensor views the optimizer writes through do not
        share the flat shard's counter.)"""
        assert self.param_codec is not None
        if not for_backward or unit.encoded is None:
            self._drop_encoded(unit)
            unit.encoded = comm.encode_shard(unit.shard, self.param_codec, tag_room=self.world_size > 1)
            self.memory.add("gather_buffers", nbytes(unit.encoded))
        return unit.encoded

    def _drop_encoded(self, unit: UnitTensors) -> None:
        if unit.encoded is not None:
            self.memory.sub("gather_buffers", nbytes(unit.encoded))
            unit.encoded = None

    def _keep_secondary(self, unit: UnitTensors, gathered: torch.Tensor) -> None:
        """hpZ: after a forward gather, keep the parts this rank serves to its inner group.

        [Note: secondary copy]
        With W = outer * inner ranks, global rank g = o * inner + i holds part g of the unit.
        Inner rank i keeps parts {o * inner + i : o} (outer parts, 1/inner of the unit, in the
        gather dtype, decoded when the forward gather was compressed). A backward all-gather over
        the inner group then returns [parts of inner rank 0 | inner rank 1 | ...], i.e. the parts
        in (inner, outer) order; comm.all_gather_secondary turns that back into rank-major order.
        Only gathers made with grad enabled keep it (a no_grad forward has no backward), units
        kept from forward to backward and the root's take none (they are not gathered for
        backward: [Note: units kept for backward] in schedule.py), and the copy is dropped when
        the unit's gradients have been reduced: the optimizer step changes the parameters, so
        the next step's forward takes a fresh one.
        """
        if (
            self.secondary_group is None
            or not unit.needs_secondary
            or unit.gather_from_secondary
            or not torch.is_grad_enabled()
        ):
            return
        inner = dist.get_world_size(self.secondary_group)
        parts = gathered.view(self.world_size // inner, inner, -1)
        self._drop_secondary(unit)
        unit.secondary = parts[:, dist.get_rank(self.secondary_group)].reshape(-1).clone()
        self.memory.add("secondary", nbytes(unit.secondary))

    def _drop_secondary(self, unit: UnitTensors) -> None:
        if unit.secondary is not None:
            self.memory.sub("secondary", nbytes(unit.secondary))
            unit.secondary = None

    def _alloc_unsharded(self, unit: UnitTensors) -> None:
        storage = unit.unsharded_flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(unit.unsharded_nbytes)
            self.memory.add("unsharded", unit.unsharded_nbytes)

    def _copy_out(self, unit: UnitTensors, gathered: torch.Tensor) -> None:
        """Rank-major gather output -> parameter-major unsharded buffer, one fused pass
        (kernels.copy_out, [Note: fused copy layout] in overlap/kernels/copy.py)."""
        if unit.copy_out_views is None:  # views stay valid across storage resizes: built once
            n = self.world_size
            slots = unit.layout.slots
            unit.copy_out_views = [
                unit.unsharded_flat[s.unsharded_offset : s.unsharded_offset + n * s.chunk_numel] for s in slots
            ]
            # each rank's chunk is padded to CHUNK_ALIGN_NUMEL in the gathered rows (units.py)
            unit.copy_out_sizes = [n * s.padded_chunk_numel for s in slots]
            unit.copy_out_cols = [s.chunk_numel for s in slots]
        outs, sizes, cols = unit.copy_out_views, unit.copy_out_sizes, unit.copy_out_cols
        rows = gathered if isinstance(gathered, list) else None  # [Note: gather of a pair]
        if rows is not None:
            gathered = rows[0]  # its dtype and device; the rows are read below
        numel = sum(r.numel() for r in rows) if rows is not None else gathered.numel()
        if numel != unit.layout.unsharded_numel:  # tagged: each row ends in its tag
            assert numel == unit.layout.unsharded_numel + self.world_size * TAG_NUMEL
            if unit.tag_out is None or unit.tag_out.dtype != gathered.dtype:
                unit.tag_out = torch.empty(self.world_size * TAG_NUMEL, dtype=gathered.dtype, device=gathered.device)
            outs, sizes, cols = [*outs, unit.tag_out], [*sizes, self.world_size * TAG_NUMEL], [*cols, TAG_NUMEL]
        # The unsharded params alias this storage and autograd may hold them from forward: a
        # refill must not bump their version counter (the data is the same as before the free).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(unit.unsharded_flat):
            key = (gathered.dtype, len(outs), rows is not None)
            if unit.copy_out_bound is not None and unit.copy_out_bound[0] == key:
                # [Note: bound copies] in kernels/copy.py
                unit.copy_out_bound[1](rows if rows is not None else gathered.contiguous())
            elif rows is None:  # a layout not seen yet: checked once, then bound
                kernels.copy_out(gathered, outs, sizes=sizes, data_cols=cols, num_rows=self.world_size)
                bound = kernels.bind_copy_out(gathered.dtype, gathered.device, outs, sizes, cols, self.world_size)
                unit.copy_out_bound = (key, bound)
            else:  # checked on the concatenated rows once, then bound to read the rows in place
                kernels.copy_out(torch.cat(rows), outs, sizes=sizes, data_cols=cols, num_rows=self.world_size)
                bound = kernels.bind_copy_out(gathered.dtype, gathered.device, outs, sizes, cols, self.world_size, rows=True)
                unit.copy_out_bound = (key, bound)

    def free(self, index: int) -> None:
        unit = self.units[index]
        if unit.aliased:
            unit.swap_in(unit.sharded_params)  # [Note: aliased units]
            return
        with _phase("free", unit.layout.label):
            unit.swap_in(unit.sharded_params)
            storage = unit.unsharded_flat.untyped_storage()
            if storage.nbytes() > 0:
                storage.resize_(0)
                self.memory.sub("unsharded", unit.unsharded_nbytes)

    def reduce(self, bucket: int, indices: tuple[int, ...], fused: Gather | None = None) -> None:
        """Copy the bucket's unsharded gradients into one rank-major buffer; reduce-scatter it.
        With `fused`, that unit's backward all-gather travels in the same all-to-all
        ([Note: fused exchange]).

        [Note: used flags] After the gradient columns, each trainable parameter adds one column
        holding 1 where this rank produced a gradient for it, else 0. Every row of that column
        has the same value, so after the reduce-scatter each rank holds the number of ranks
        that used the parameter. A parameter no rank used keeps `.grad` None, as DDP
        (find_unused_parameters=True) leaves it, instead of getting zeros that an optimizer
        with weight decay or momentum would act on. The flags tensor for a pattern is built
        once and cached on the device; the counts are read back only when this rank left some
        parameter of the bucket without gradient (otherwise every count is >= 1).
        """
        self.reduce_trail = hash((self.reduce_trail, indices)) & TRAIL_MASK  # [Note: reduction trail]
        n = self.world_size
        dtype = self.reduce_dtype or _widest(self.units[i].unsharded_flat.dtype for i in indices)
        with _phase("reduce", f"bucket{bucket}"):
            # One fused pass (kernels.copy_in): gradients cast to the reduce dtype, padded, a
            # missing gradient as zeros, into the rank-major buffer ([Note: flat layout]).
            srcs: list[torch.Tensor | None] = []
            spans: list[int] = []  # per gradient, its padded span of each rank-major row
            data_cols: list[int] = []  # per gradient, the columns of each row holding data
            for index in indices:
                unit = self.units[index]
                for param in unit.grad_params:
                    srcs.append(param.grad)
                    param.grad = None
                spans += unit.grad_spans
                data_cols += unit.grad_cols
            used = tuple(g is not None for g in srcs)
            flags = self._flags_for(used, dtype)
            width_grads = sum(spans)
            sizes = [n * span for span in spans]
            if self.grad_codec is None:  # flags ride in the same buffer
                srcs, sizes, data_cols = [*srcs, flags], [*sizes, flags.numel()], [*data_cols, len(used)]
            reduce_cols = sum(sizes) // n
            deferred = None  # a gather too large to ride along: issued right after, on its own
            if fused is not None and not self._fits_slack(reduce_cols, fused.unit, dtype):
                deferred, fused = fused, None
            if fused is not None:  # the shard's columns, filled below
                shard_send = self._fused_shard(fused.unit)
                srcs, sizes, data_cols = [*srcs, None], [*sizes, n * shard_send.numel()], [*data_cols, 0]
            total_cols = sum(sizes) // n
            full = torch.empty(n, total_cols, dtype=dtype, device=self.device)
            self._copy_in(indices, used, srcs, full, sizes, data_cols)
            del srcs
            if fused is not None:
                full[:, reduce_cols:].copy_(shard_send.expand(n, shard_send.numel()))
            event, reduced = None, None
            if self.reduce_stream is not None:
                self.reduce_stream.wait_stream(torch.cuda.current_stream(self.device))
            span = self.timer.start("collective", "reduce", self._span_label(indices), self.reduce_stream, nbytes(full))
            # [Note: one pass for the sum] Through all-to-all, the received chunks are summed
            # here, and the average (sum, then divide, as wait_reduce does otherwise) is taken in
            # the same pass (kernels.sum_rows); not under HSDP, which divides after its all-reduce.
            divide = comm.Divide(width_grads, n) if self.replicate_group is None and n > 1 else None
            averaged = divide is not None and (fused is not None or (self.grad_codec is None and comm.divides(self.reduce_impl, n)))
            with self._stream(self.reduce_stream):
                if fused is not None:
                    result, gather = comm.reduce_scatter_and_gather(full, reduce_cols, self.group, self._slack, divide)
                elif self.grad_codec is None:
                    result = comm.reduce_scatter_flat(full.view(-1), self.group, n, self.reduce_impl, self._slack, divide)
                else:  # gradient rows contiguous for the encoder; flags exact, beside them
                    residual = self._residual(indices, width_grads)
                    result = comm.reduce_scatter_encoded(
                        full, flags.view(n, -1), self.group, n, self.grad_codec, residual, self._slack
                    )
                del full
                if self.reduce_stream is not None:
                    # The reduce stream waits and sums (once: the tensor is kept, [Note: streams]).
                    reduced = comm.wait(result, self.timeout)
                    self.timer.stop(span, self.reduce_stream)
                    event = self.reduce_stream.record_event()
                else:
                    self.timer.stop(span, work=result.work)
        input_bytes = nbytes(*result.inputs) + (nbytes(result.output) if result.finish is not None else 0)
        gather_bytes = 0
        if fused is not None:  # the shard's columns (sent and received) are the gather's buffers
            gather_bytes = input_bytes * (total_cols - reduce_cols) // total_cols
            input_bytes -= gather_bytes
            self._fused_gather_issued(fused.unit, gather, gather_bytes)
        self.memory.add("reduce_inputs", input_bytes)
        pending = PendingReduce(result, event, all(used), input_bytes, averaged=averaged)
        self._pending[bucket] = pending
        self._pending_units[bucket] = indices
        sent = result.inputs[0]
        num_bytes = sent.numel() * sent.element_size() - gather_bytes // 2
        self.stats.record_issue("reduce", num_bytes)
        if reduced is not None:
            self._reduced(bucket, indices, pending, reduced)
        if deferred is not None:
            self.gather(deferred.unit, deferred.for_backward)

    @property
    def receive_floor_bytes(self) -> int:
        """What each all-to-all leaves room for per peer ([Note: receive slack] in comm.py); 0: none."""
        return 0 if self._slack is None else self._slack.floor_bytes

    def gather_nbytes(self, index: int) -> int:
        """Bytes an uncompressed all-gather of unit `index` holds while in flight (accounted as
        gather_buffers): natively the output and the shard sent; through all-to-all the send
        copies and the receive buffer with its slack ([Note: receive slack] in comm.py)."""
        part = self._gather_part_bytes(index)
        if self._pair:  # the shard sent and the peer's part received ([Note: gather of a pair])
            return part + max(part, self.receive_floor_bytes)
        if comm.runs_locally(self.world_size) or self._gather_impl[index] == "native":
            return (self.world_size + 1) * part
        floor = self.receive_floor_bytes
        return self.world_size * part + part + (self.world_size - 1) * max(part, floor)

    def _fits_slack(self, reduce_cols: int, index: int, dtype: torch.dtype) -> bool:
        """Whether a reduction of `reduce_cols` per row and unit `index`'s shard fit in the
        receive slack together ([Note: receive slack] in comm.py); decided from sizes every rank
        shares."""
        assert self._slack is not None
        numel = reduce_cols + self._gather_numel(index)
        return numel * dtype.itemsize <= self._slack.floor_bytes

    def _fused_shard(self, index: int) -> torch.Tensor:
        """What unit `index`'s fused backward all-gather sends: its shard, tagged when the tags
        are on ([Note: collective fingerprints]), the tag written now ([Note: fused exchange])."""
        unit = self.units[index]
        tagged = self._tagged[index]
        unit.gather_from_secondary = False
        unit.gather_tag = None if tagged is None else self._tag(index, unit, True)
        if tagged is None:
            return unit.shard
        slot = self._tag_slots[index]
        assert slot is not None and unit.gather_tag is not None
        slot.fill_(unit.gather_tag)
        return tagged

    def _fused_gather_issued(self, index: int, gather: comm.CommResult, gather_bytes: int) -> None:
        """Unit `index`'s all-gather is in flight inside a reduction's all-to-all: from here on
        it is waited, checked and copied out as any CPU all-gather (`wait_gather`)."""
        unit = self.units[index]
        unit.gather = gather
        unit.gather_bytes = gather_bytes
        self.memory.add("gather_buffers", gather_bytes)
        self.stats.record_issue("gather", gather_bytes // 2)

    def _copy_in(
        self,
        indices: tuple[int, ...],
        used: tuple[bool, ...],
        srcs: list[torch.Tensor | None],
        full: torch.Tensor,
        sizes: list[int],
        data_cols: list[int],
    ) -> None:
        """kernels.copy_in, checked once per bucket layout and then bound ([Note: bound copies]
        in kernels/copy.py)."""
        if not all(s is None or s.is_contiguous() for s in srcs):
            srcs = [s if s is None else s.contiguous() for s in srcs]
        key = (indices, used, len(sizes), full.dtype, *(s.dtype for s in srcs if s is not None))
        bound = self._bound_copy_in.get(key)
        if bound is not None and bound[0] == sizes and bound[1] == data_cols:  # layouts may change
            bound[2](srcs, full)
            return
        kernels.copy_in(srcs, full, sizes=sizes, data_cols=data_cols, num_rows=self.world_size)
        fn = kernels.bind_copy_in(set(key[3:]), full.device, sizes, data_cols, self.world_size)
        self._bound_copy_in[key] = (sizes, data_cols, fn)

    def _flags_for(self, used: tuple[bool, ...], dtype: torch.dtype) -> torch.Tensor:
        """The used-flag columns for every row ([Note: used flags]), cached on the device per
        pattern: built from host data once, never again in steady state."""
        key = (used, dtype)
        flags = self._flags.get(key)
        if flags is None:
            flags = torch.tensor(used, dtype=dtype).repeat(self.world_size).to(self.device)
            self._flags[key] = flags
        return flags

    def release_reduce(self, bucket: int) -> None:
        """Done with the bucket's reduce-scatter input ([Note: reduce buffers] in schedule.py)."""
        pending = self._pending[bucket]
        if pending.result is None:
            return
        with _phase("release_reduce", f"bucket{bucket}"):
            if pending.event is not None:  # CUDA: compute may reuse the input once the RS is done
                torch.cuda.current_stream(self.device).wait_event(pending.event)
                reduced = None
            else:  # CPU: wait for the work; sum (or decode) what all-to-all received
                reduced = comm.wait(pending.result, self.timeout)
                self.timer.waited(pending.result.work)
            pending.result = None
            self.memory.sub("reduce_inputs", pending.input_bytes)
        if reduced is not None:
            self._reduced(bucket, self._pending_units[bucket], pending, reduced)

    def _reduced(self, bucket: int, indices: tuple[int, ...], pending: PendingReduce, reduced: torch.Tensor) -> None:
        """The bucket's reduced shard exists (or is enqueued): keep it; HSDP: sum it across
        replicas ([Note: hybrid sharding] in wrap.py), on CUDA on its own stream behind the
        reduce-scatter's event, on CPU right away (in bucket order on every rank)."""
        pending.reduced = reduced
        self.memory.add("reduce_outputs", nbytes(reduced))
        if self.replicate_group is None:
            return
        if self.all_reduce_stream is not None:
            assert pending.event is not None
            self.all_reduce_stream.wait_event(pending.event)
        with self._stream(self.all_reduce_stream):
            pending.all_reduce = self._all_reduce(bucket, indices, reduced)
            if self.all_reduce_stream is not None:
                pending.all_reduce_event = self.all_reduce_stream.record_event()

    def _all_reduce(self, bucket: int, indices: tuple[int, ...], reduced: torch.Tensor) -> comm.CommResult:
        """HSDP: issue the sum of a reduced shard across replicas ([Note: hybrid sharding])."""
        assert self.replicate_group is not None
        num_bytes = nbytes(reduced)
        stream = self.all_reduce_stream
        span = self.timer.start("collective", "all_reduce", self._span_label(indices), stream, num_bytes)
        with _phase("all_reduce", f"bucket{bucket}"):
            result = comm.all_reduce_flat(reduced, self.replicate_group)
            if stream is not None:  # the all-reduce stream waits, in order ([Note: streams])
                comm.wait(result, self.timeout)
                self.timer.stop(span, stream)
            else:
                self.timer.stop(span, work=result.work)
        self.stats.record_issue("all_reduce", num_bytes)
        return result

    def forget_residuals(self, unit: int) -> None:
        """Drop the error-feedback residuals of every bucket holding `unit` (its gradient layout
        changed: the residual's columns no longer match). They restart from zero."""
        for indices in [k for k in self.residuals if unit in k]:
            self.memory.sub("residuals", self.residuals.pop(indices).nbytes)

    def _residual(self, indices: tuple[int, ...], width: int) -> FeedbackResidual | None:
        """This bucket's error-feedback residual (zeros the first time), or None when off.

        Keyed by the bucket's units: the schedule forms the same buckets every step. One loaded
        from a checkpoint of another gradient layout restarts from zero, with a warning."""
        if self.residual_dtype is None:
            return None
        assert self.grad_codec is not None, f"rank {self.rank}: error feedback without a gradient codec"
        residual = self.residuals.get(indices)
        if residual is not None and residual.numel != width:
            warnings.warn(
                f"overlap: the error-feedback residual of units {indices} has {residual.numel} "
                f"columns, their gradients {width} (a checkpoint of another layout?): it restarts from zero",
                stacklevel=2,
            )
            self.forget_residuals(indices[0])
            residual = None
        if residual is None:
            fmt = make_residual_format(self.residual_dtype, self.grad_codec)
            residual = FeedbackResidual.zeros(fmt, self.rank, self.world_size, width, self.device)
            self.residuals[indices] = residual
            self.memory.add("residuals", residual.nbytes)
        return residual

    def wait_reduce(self, bucket: int, indices: tuple[int, ...]) -> None:
        pending = self._pending[bucket]
        stall = self.timer.start("stall", "reduce", self._span_label(indices))
        with _phase("wait_reduce", f"bucket{bucket}"):
            self.release_reduce(bucket)
            del self._pending[bucket]
            del self._pending_units[bucket]
            if pending.all_reduce is not None:
                if pending.all_reduce_event is not None:
                    torch.cuda.current_stream(self.device).wait_event(pending.all_reduce_event)
                else:
                    comm.wait(pending.all_reduce, self.timeout)
                    self.timer.waited(pending.all_reduce.work)
            elif pending.event is not None:
                torch.cuda.current_stream(self.device).wait_event(pending.event)
        reduced = pending.reduced
        assert reduced is not None, f"rank {self.rank}: bucket {bucket} has no reduced shard"
        self.timer.stop(stall)
        units = [self.units[i] for i in indices]
        for unit in units:
            self._drop_secondary(unit)  # [Note: secondary copy]
            self._drop_encoded(unit)  # see _encoded_shard
        grad_numel = sum(u.layout.grad_shard_numel for u in units)
        self.memory.sub("reduce_outputs", nbytes(reduced))
        with torch.no_grad():
            grads = reduced[:grad_numel]
            # [Note: used flags]: every count is >= 1 when this rank used every parameter; the
            # host reads them (a device sync on CUDA) only when it did not.
            num_flags = reduced.numel() - grad_numel
            used = [1.0] * num_flags if pending.all_used else reduced[grad_numel:].tolist()
            # Sum, then divide: at world size 2 this equals DDP's (g/2 + g/2) bitwise.
            if self.world_size * self.num_replicas > 1 and not pending.averaged:
                grads.div_(self.world_size * self.num_replicas)
            offset = grads.storage_offset()
            for unit in units:
                num_trainable = len(unit.grad_locals)
                self._accumulate(unit, grads, offset, used[:num_trainable])
                used = used[num_trainable:]
                offset += unit.layout.grad_shard_numel

    def begin_step(self) -> None:
        """A step starts: recount the gradient shards the optimizer holds (it may have freed
        them) and start new high-water marks ([Note: memory accounting] in memory.py)."""
        grad_bytes = 0
        for unit in self.units:
            for slot, param in zip(unit.layout.slots, unit.sharded_params):
                if param.grad is not None:
                    grad_bytes += slot.chunk_numel * param.element_size()
        self.memory.set("grad_shards", grad_bytes)
        self.memory.reset_peak()
        self.step += 1
        if self.reduce_trail:  # the last step reduced: its trail goes into this step's tags
            self.last_trail, self.reduce_trail = self.reduce_trail, 0

    def _accumulate(self, unit: UnitTensors, reduced: torch.Tensor, offset: int, used: list[float]) -> None:
        """Add a unit's reduced gradient shard (at storage `offset` of `reduced`) into its sharded
        parameters' `.grad`."""
        for (param, grad_offset, shape, stride), num_users in zip(unit.grad_locals, used):
            if num_users == 0:
                continue  # [Note: used flags]
            local = reduced.as_strided(shape, stride, offset + grad_offset)
            if local.dtype != param.dtype:
                local = local.to(param.dtype)
            if param.grad is None:
                # The parameter's own spec (mesh, placements, global shape and stride, dtype):
                # the DTensor is built directly, without from_local's autograd function and
                # argument checks (microseconds per parameter and step).
                param.grad = DTensor(local, param._spec, requires_grad=False)  # type: ignore[call-arg]
            else:
                param.grad._local_tensor.add_(local)

    def _span_label(self, indices: tuple[int, ...]) -> str:
        """A bucket by its units: the same every step (bucket numbers are not), so a
        collective's time is compared with its own history (Monitor)."""
        label = self._labels.get(indices)
        if label is None:
            names = ",".join(self.units[i].layout.label.split(" ")[0] for i in indices)
            label = self._labels[indices] = f"bucket [{names}]"
        return label

    def _bucket_label(self, bucket: int, indices: tuple[int, ...]) -> str:
        names = ",".join(self.units[i].layout.label.split(" ")[0] for i in indices)
        return f"bucket{bucket} [{names}]"

    def check_order(self, what: str, order_hash: int, order: tuple[int, ...]) -> None:
        hashes = comm.all_gather_int(order_hash, self.group, self.device, self.timeout)
        if self.replicate_group is not None:  # both checks on every rank: all raise, none hangs
            across = comm.all_gather_int(order_hash, self.replicate_group, self.device, self.timeout)
            hashes = hashes if len(set(hashes)) != 1 else across
        if len(set(hashes)) != 1:
            raise ValueError(
                f"overlap: the {what} order of units differs across ranks (rank {self.rank} ran "
                f"units {list(order)}; order hashes by rank: {hashes}). Every rank must run the "
                "same modules in the same order, or the collectives would exchange wrong data."
            )
