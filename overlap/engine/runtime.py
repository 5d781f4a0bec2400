"""Execution: carries out the schedule's actions on a unit's tensors, through the transport.

The runtime knows units, buckets, layouts, tags and memory; which collective moves the bytes
(the transport's strategies) and where the work after it runs (its executor: a comm stream at
issue, or the training thread at the wait) are the transport's ([Note: the seam] in
overlap/transport/strategy.py), chosen once at wrap. Gathers and the dispatch are here,
reductions in reduction.py.

[Note: buffer lifetime]
A collective's buffers live in the `CommResult` it returns, and that result is held by the
runtime, in the gather's in-flight record (`GatherResult`) or the bucket's `PendingReduce`, until
the matching wait action; only then are the references dropped. On CUDA the wait first makes the compute stream wait for the comm stream's
event, so by the time the caching allocator may hand a freed block to the compute stream, the
comm stream is done with it. No `record_stream` anywhere.

[Note: no host sync in the hot path]
After the first step nothing here blocks the CPU on a CUDA device: no pageable host-to-device
copies (the used flags are cached on the device per pattern), no `.item()`/`.tolist()`/
`bool(tensor)` (the used counts are read back only for a bucket in which this rank left a
parameter without gradient, the one documented exception, at the end of backward), no
`Work.wait(timeout)` on NCCL work (it would block the CPU there: transport/backend.py).
tests/engine/test_host_sync.py records every such call made from library code and expects none.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from overlap import kernels
from overlap.compression import Codec
from overlap.compression.feedback import FeedbackResidual
from overlap.engine.actions import (
    Action,
    CheckOrder,
    Free,
    Gather,
    Reduce,
    ReleaseReduce,
    Retain,
    WaitGather,
    WaitReduce,
)
from overlap.engine.reduction import PendingReduce, Reductions, flag_cols
from overlap.engine.unit_tensors import UnitTensors
from overlap.engine.verdict import DIFFERS, agree_value, job_groups
from overlap.observe.labels import phase as _phase
from overlap.observe.memory import MemoryAccount, nbytes
from overlap.observe.stats import StatsRecorder
from overlap.observe.timing import HostTimer, SpanTimer
from overlap.observe.trace import TraceRecorder
from overlap.transport import GatherResult, Transport, UnitWire, coded
from overlap.transport import collectives as comm
from overlap.transport.executor import TagRead
from overlap.transport.fingerprint import TAG_NUMEL, Tag, tag_view
from overlap.transport.strategy import held_bytes


@dataclass
class Runtime(Reductions):
    units: list[UnitTensors]
    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    gather_dtype: torch.dtype | None  # None: each unit's own dtype
    reduce_dtype: torch.dtype | None
    stats: StatsRecorder
    transport: Transport  # how collectives are issued and completed: [Note: the seam] in transport/strategy.py
    trace: TraceRecorder | None = None
    timer: SpanTimer = field(default_factory=HostTimer)  # wrap passes make_timer(device), as to the transport
    param_codec: Codec | None = None  # None: uncompressed all-gather
    grad_codec: Codec | None = None  # None: uncompressed reduce-scatter (reduce_scatter_impl)
    residual_dtype: torch.dtype | None = None  # error feedback on when set
    residuals: dict[tuple[int, ...], FeedbackResidual] = field(default_factory=dict)
    """Error-feedback residual per bucket (its units): a row of gradient columns per peer rank."""
    replicate_group: dist.ProcessGroup | None = None
    """HSDP: reduced shards are summed across replicas here. See [Note: hybrid sharding] in groups.py."""
    tensor_group: dist.ProcessGroup | None = None
    """TP (the experts' state: ep): the order checks span it too ([Note: job-wide verdicts] in verdict.py)."""
    secondary_group: dist.ProcessGroup | None = None
    """hpZ: backward all-gathers run here, from the secondary copies ([Note: secondary copy])."""
    memory: MemoryAccount = field(default_factory=MemoryAccount)
    gradient_divide_factor: int | None = None
    """Experts: what the summed gradients are divided by ([Note: expert parallelism] in experts.py)."""
    _pending: dict[int, PendingReduce] = field(init=False, default_factory=dict)
    _pending_units: dict[int, tuple[int, ...]] = field(init=False, default_factory=dict)
    _gathers: dict[int, GatherResult] = field(init=False, default_factory=dict)  # per unit: its gather in flight
    step: int = field(init=False, default=0)  # steps begun on this rank, in the tags
    reduce_trail: int = field(init=False, default=0)  # the reductions since the last roll: [Note: reduction trail]
    last_trail: int = field(init=False, default=0)  # those of the last step that reduced, in the tags
    _flags: OrderedDict[tuple[tuple[bool, ...], torch.dtype], torch.Tensor] = field(
        init=False, default_factory=OrderedDict
    )
    _labels: dict[tuple[int, ...], str] = field(init=False, default_factory=dict)  # _span_label's
    _bound_copy_in: dict[tuple, Any] = field(init=False, default_factory=dict)  # by bucket layout
    sync_grads: bool = field(init=False, default=True)  # this backward reduces (not under no_sync)

    def __post_init__(self) -> None:
        self.num_replicas = 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)
        self.memory.add("sharded_params", sum(nbytes(u.shard) for u in self.units))
        self.fingerprints = self.transport.fingerprints()
        self._tagged = [u.tagged_shard() for u in self.units]
        # the tag's int64 slot in each tagged shard, for gathers without a cast (no view per gather)
        self._tag_slots = [
            None if t is None else tag_view(t, u.shard.numel()) for t, u in zip(self._tagged, self.units)
        ]
        self._verbs = self._make_verbs()
        if self.transport.aliases(self.param_codec is not None):
            for unit in self.units:  # [Note: aliased units]
                if (self.gather_dtype or unit.shard.dtype) == unit.shard.dtype:
                    unit.alias_shard()
        self.transport.plan([self._wire(i) for i in range(len(self.units))], self.param_codec is not None)

    @property
    def timeout(self) -> timedelta | None:
        """What a wait on a collective is bounded by (None: the process group's timeout)."""
        return self.transport.timeout

    def _wire(self, index: int) -> UnitWire:
        """Unit `index` as the transport plans it: sizes every rank shares."""
        unit = self.units[index]
        tagged = self._tagged[index]
        gather_dtype = self.gather_dtype or unit.shard.dtype
        layout = unit.layout
        reduce_itemsize = (self.reduce_dtype or unit.unsharded_flat.dtype).itemsize
        return UnitWire(
            gather_numel=(unit.shard if tagged is None else tagged).numel(),
            gather_itemsize=gather_dtype.itemsize,
            # one row: gradient chunks and used flags; codecs: fp32 at most
            reduce_row_bytes=(layout.shard_numel + flag_cols(len(layout.slots))) * max(reduce_itemsize, 4),
            same_dtype=not unit.aliased and gather_dtype == unit.shard.dtype,
        )

    @property
    def receive_floor_bytes(self) -> int:
        """What each receive of the all-gather strategy leaves room for per peer; 0: none."""
        return self.transport.all_gather.receive_floor_bytes

    def gather_nbytes(self, index: int) -> int:
        """Bytes an uncompressed all-gather of unit `index` holds while in flight (accounted as
        gather_buffers), as the transport's strategy issues it."""
        return self.transport.all_gather.nbytes(index)

    def gather_in_flight(self, index: int) -> GatherResult | None:
        """Unit `index`'s all-gather from its issue to its wait (None: none in flight)."""
        return self._gathers.get(index)

    # ------------------------------------------------------------------ dispatch
    def run(self, actions: list[Action]) -> None:
        """Carry out a batch of the schedule's actions, in order; what a strategy held back to
        coalesce is issued by the end of the batch ([Note: coalesced collectives] in
        transport/strategy.py)."""
        verbs = self._verbs
        action: Action | None = None
        try:
            for action in actions:
                verbs[type(action)](action)
            self.transport.flush()
        except comm.CollectiveError as e:  # [Note: collective failures] in transport/results.py
            what = "collectives of this batch" if action is None else self._describe(action)
            raise comm.CollectiveError(f"overlap: rank {self.rank}: the {what} {e}") from e

    def _make_verbs(self) -> dict[type, Any]:
        """Each action type's verb: one dict lookup per action (a `match` over seven class
        patterns cost microseconds per action, several actions per unit and step)."""
        return {
            Gather: lambda a: self.gather(a.unit, a.for_backward),
            WaitGather: lambda a: self.wait_gather(a.unit),
            Free: lambda a: self.free(a.unit),
            Retain: lambda a: self.retain(a.unit),
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

    # ------------------------------------------------------------------ verbs
    def gather(self, index: int, for_backward: bool = False) -> None:
        unit = self.units[index]
        if unit.aliased:
            return  # [Note: aliased units]
        dtype = self.gather_dtype or unit.shard.dtype
        from_secondary = for_backward and unit.secondary is not None
        executor, all_gather = self.transport.executor, self.transport.all_gather
        with _phase("gather", unit.layout.label):
            executor.before_gather(lambda: self._alloc_unsharded(unit))  # CUDA: [Note: streams]
            span = self.timer.start(
                "collective", "gather", unit.layout.label, executor.gather_stream, unit.unsharded_nbytes
            )
            with executor.on(executor.gather_stream):
                if from_secondary:
                    assert unit.secondary is not None
                    tag = None  # untagged ([Note: collective fingerprints])
                    result = all_gather.secondary(unit.secondary)
                elif self.param_codec is None:
                    tagged = self._tagged[index] if self.world_size > 1 else None
                    tag = None if tagged is None else self._tag(index, unit, for_backward)
                    send = unit.shard if tagged is None else tagged
                    result = all_gather(index, send, dtype, tag, self._tag_slots[index], for_backward)
                else:
                    tag = self._tag(index, unit, for_backward) if self.world_size > 1 else None
                    result = all_gather.encoded(
                        self._encoded_shard(unit, for_backward),
                        unit.shard.numel(),
                        dtype,
                        self.param_codec,
                        unit.shard.dtype,
                        tag,
                    )
                record = GatherResult(index, result, tag, from_secondary, held_bytes(result))
                self.memory.add("gather_buffers", record.nbytes)
                # CUDA: copy-out enqueued behind it now, on the gather stream ([Note: streams])
                self._gathers[index] = executor.gather_issued(record, span, self._finish_gather)
        plain = self.param_codec is None and not from_secondary
        self.stats.record_issue(
            "gather", all_gather.gathered_bytes(index, result.output) if plain else nbytes(result.output)
        )

    def _tag(self, index: int, unit: UnitTensors, for_backward: bool) -> int:
        phase = 2 if for_backward else (0 if torch.is_grad_enabled() else 1)
        return Tag(self.step, phase, index, unit.signature ^ self.last_trail).pack()

    def _check_tag(self, record: GatherResult, gathered: Any, received: torch.Tensor) -> None:
        """Compare the gathered tags with this rank's ([Note: collective fingerprints]), after
        copy-out: on the CPU on the host, at once; on CUDA from a pinned copy, two steps late."""
        if record.tag is None:
            return
        unit = self.units[record.index]
        read = TagRead(
            record.index,
            record.tag,
            f"all-gather of {unit.layout.label}",
            unit.tag_out,
            gathered,
            received,
            self.param_codec is not None,
            unit.unsharded_flat,
        )
        self.transport.executor.check_tag(self.fingerprints, read)

    def check_fingerprints(self) -> None:
        """Once per step: CUDA compares the tags copied to the host once the copies are done, a
        step late ([Note: deferred tag check]); on CPU every all-gather was checked at its wait."""
        self.fingerprints.check_pending()

    def _drop_gather(self, record: GatherResult) -> None:
        """The gather's buffers are dropped with the record ([Note: buffer lifetime]): on CUDA
        `gather_issued` keeps a record without them, the event only."""
        self.memory.sub("gather_buffers", record.nbytes)

    def wait_gather(self, index: int) -> None:
        unit = self.units[index]
        if unit.aliased:
            unit.swap_in(unit.unsharded_params)  # [Note: aliased units]
            return
        record = self._gathers.pop(index, None)
        assert record is not None, f"rank {self.rank}: unit {index} waited before gather"
        stall = self.timer.start("stall", "gather", unit.layout.label)
        with _phase("wait_gather", unit.layout.label):
            self.transport.executor.wait_gather(record, self._finish_gather)
            unit.swap_in(unit.unsharded_params)
        self.timer.stop(stall)

    def _finish_gather(self, record: GatherResult, gathered: Any) -> torch.cuda.Event | None:
        """After a unit's all-gather has arrived (CUDA: enqueued on the gather stream at issue;
        CPU: at the wait): copy out, check the tags it copied, keep the hpZ part, drop the
        buffers ([Note: buffer lifetime]). Returns the event compute waits on (CUDA)."""
        unit = self.units[record.index]
        assert record.comm is not None
        self._alloc_unsharded(unit)  # CUDA: already allocated at issue, on the compute stream
        self._copy_out(unit, gathered)  # its tags too: checked next, before any use
        event = self.transport.executor.gather_copied()  # CUDA: [Note: gather event] in streams.py
        self._check_tag(record, gathered, record.comm.output)
        self._keep_secondary(unit, gathered, record.from_secondary)
        del gathered
        self._drop_gather(record)
        return event

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
            unit.encoded = coded.encode_shard(unit.shard, self.param_codec, tag_room=self.world_size > 1)
            self.memory.add("gather_buffers", nbytes(unit.encoded))
        return unit.encoded

    def _drop_encoded(self, unit: UnitTensors) -> None:
        if unit.encoded is not None:
            self.memory.sub("gather_buffers", nbytes(unit.encoded))
            unit.encoded = None

    def _keep_secondary(self, unit: UnitTensors, gathered: torch.Tensor, from_secondary: bool) -> None:
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
        if self.secondary_group is None or not unit.needs_secondary or from_secondary or not torch.is_grad_enabled():
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

    def _copy_out(self, unit: UnitTensors, gathered: torch.Tensor | list[torch.Tensor]) -> None:
        """Rank-major gather output -> parameter-major unsharded buffer, one fused pass
        (kernels.copy_out, [Note: fused copy layout] in overlap/kernels/copy.py). `gathered` is
        one tensor, or its rows where a strategy left them where they landed (read in place)."""
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
        rows = gathered if isinstance(gathered, list) else None
        if rows is not None:
            gathered = rows[0]  # its dtype and device; the rows are read below
        numel = sum(r.numel() for r in rows) if rows is not None else gathered.numel()
        if numel != unit.layout.unsharded_numel:  # tagged: each row ends in its tag
            assert numel == unit.layout.unsharded_numel + self.world_size * TAG_NUMEL
            if unit.tag_out is None or unit.tag_out.dtype != gathered.dtype:
                # a buffer of its own, allocated once ([Note: second base] in kernels/triton_copy.py)
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
                bound = kernels.bind_copy_out(
                    gathered.dtype, gathered.device, outs, sizes, cols, self.world_size, rows=True
                )
                unit.copy_out_bound = (key, bound)

    def free(self, index: int) -> None:
        unit = self.units[index]
        if not self.sync_grads and self.reduce_dtype is not None:
            self._keep_grads(unit)  # [Note: no_sync in reduce_dtype]
        if unit.aliased:
            unit.swap_in(unit.sharded_params)  # [Note: aliased units]
            return
        with _phase("free", unit.layout.label):
            unit.swap_in(unit.sharded_params)
            storage = unit.unsharded_flat.untyped_storage()
            if storage.nbytes() > 0:
                storage.resize_(0)
                self.memory.sub("unsharded", unit.unsharded_nbytes)

    def retain(self, index: int) -> None:
        """The unit stays unsharded after a backward that does not sync ([Note: retained across
        micro-batches] in unit_state.py); its gradients move into reduce_dtype as `free` moves them."""
        if self.reduce_dtype is not None:
            self._keep_grads(self.units[index])  # [Note: no_sync in reduce_dtype]

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
        # over the shard, replicate and tp groups in turn, on every rank: all raise, none hangs
        # ([Note: job-wide verdicts] in verdict.py)
        self.transport.flush()  # what a strategy held goes first: a collective of our own follows
        groups = job_groups(self.group, self.replicate_group, self.tensor_group)
        agreed, hashes = agree_value(order_hash, groups, self.device, self.timeout)
        if agreed == DIFFERS:
            seen = f"order hashes by rank in a group of this rank: {hashes}" if hashes else "another group differs"
            raise ValueError(
                f"overlap: the {what} order of units differs across ranks (rank {self.rank} ran "
                f"units {list(order)}; {seen}). Every rank must run the same modules in the same "
                "order, or the collectives would exchange wrong data."
            )
