"""The CUDA executor: comm streams and events around the strategies' collectives (NCCL).

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
does the copies when it waits (transport/host.py).

Everything after a collective is enqueued at issue, behind it on its comm stream: `wait` on a
stream-ordered backend only makes the current stream wait ([Note: NCCL is not gloo] in
backend.py), so copy-out, the tag copy and the sum of a reduction follow it without the CPU
waiting, and the compute stream later waits on an event recorded after what it needs: copy-out
([Note: gather event]), the reduce-scatter (to reuse its input) or the sum. This is the shape
of FSDP2's `_fsdp_collectives.py`, except that copy-out runs on the gather stream, so its buffers'
last user is their own allocation stream ([Note: buffer lifetime] in engine/runtime.py).

Which collective moves the bytes is the strategies' ([Note: the seam] in strategy.py): the
backend's own, or symmetric memory (symm_mem.py); gloo's mechanisms (gloo.py) are not used on
CUDA, and `all_gather_impl="all_to_all"` raises at wrap (`check_settings`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from overlap.observe.memory import nbytes
from overlap.transport import backend
from overlap.transport import collectives as comm
from overlap.transport.executor import Executor, GatherDone, TagRead
from overlap.transport.fingerprint import FingerprintCheck, byte_tags
from overlap.transport.strategy import AllReduce, Event, GatherResult


def check_settings(semantics: backend.CommSemantics, gather_impl: str) -> None:
    """Raise ValueError for a setting CUDA tensors cannot honour."""
    if gather_impl == "all_to_all":  # its receive slack would hang NCCL
        raise ValueError(
            f"overlap.wrap: all_gather_impl='all_to_all' is a gloo mechanism; {semantics.device_type} "
            f"tensors over {semantics.backend} gather with the backend's all-gather: pass "
            "all_gather_impl='auto' or 'native'"
        )


class StreamExecutor(Executor):
    """CUDA tensors: the work after a collective on comm streams, ordered by events."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.make_streams()

    def make_streams(self) -> None:
        """[Note: streams]; a stand-in executor on the CPU (tests) replaces this."""
        self.gather_stream = torch.cuda.Stream(self.device, priority=-1)
        self.reduce_stream = torch.cuda.Stream(self.device, priority=-1)
        if self.replicated:
            self.all_reduce_stream = torch.cuda.Stream(self.device, priority=-1)

    def compute(self) -> torch.cuda.Stream:
        """The stream compute runs on (a stand-in executor on the CPU replaces it)."""
        return torch.cuda.current_stream(self.device)

    # ------------------------------------------------------------------ gathers
    def before_gather(self, alloc: Any) -> None:
        assert self.gather_stream is not None
        self.gather_stream.wait_stream(self.compute())
        alloc()  # on the compute stream, see [Note: streams]

    def gather_issued(self, record: GatherResult, span: Any, done: GatherDone) -> GatherResult:
        # the gather stream waits, not the CPU; then copy-out and the tag copy to the host, on the device
        assert record.comm is not None
        gathered = self.wait(record.comm)
        self.timer.stop(span, self.gather_stream)
        # Later gather-stream allocations are ordered after this copy-out, so `done` drops the
        # buffers now: an in-flight prefetch holds the unsharded storage only, not 2x
        # ([Note: buffer lifetime] in engine/runtime.py).
        event = done(record, gathered)
        assert event is not None, f"rank {self.rank}: no copy-out was enqueued for the gather"
        return record._replace(comm=None, event=event)

    def gather_copied(self) -> Event:
        """[Note: gather event]
        The event the compute stream waits on before using a unit's gathered parameters is
        recorded right after copy-out: what `done` enqueues after it on the gather stream (the
        tags' copy to pinned memory, a device-to-host round trip; hpZ's copy of this rank's
        parts, 1/inner of the unit) is for the host two checks later and for the backward
        gather, which runs on this same stream. Compute never waits for them. They read only
        gather-stream buffers (the received rows, `tag_out`), so no block the compute stream
        frees is read behind its back ([Note: buffer lifetime] in engine/runtime.py)."""
        assert self.gather_stream is not None
        return self.gather_stream.record_event()

    def wait_gather(self, record: GatherResult, done: GatherDone) -> None:
        assert record.event is not None, f"rank {self.rank}: unit {record.index} waited before its copy-out"
        self.compute().wait_event(record.event)

    def check_tag(self, fingerprints: FingerprintCheck, read: TagRead) -> None:
        """One non-blocking copy of the received tags to pinned memory, on the gather stream
        behind copy-out; compared on the host two checks later ([Note: deferred tag check] in
        fingerprint.py). Uncompressed: copy-out's tag destination (`read.tag_out`, world_size
        rows of TAG_NUMEL elements); compressed: the end of each byte row of `read.received`."""
        tags = byte_tags(read.received, self.world_size) if read.compressed else read.tag_out
        assert tags is not None
        # after the gather event, so never from a block compute may free meanwhile ([Note: gather event])
        assert tags.untyped_storage().data_ptr() != read.unsharded.untyped_storage().data_ptr(), (
            f"rank {self.rank}: the tags' copy to the host reads the unsharded storage behind compute's back"
        )
        fingerprints.defer(tags, self.world_size, read.mine, read.what)

    # ------------------------------------------------------------------ reductions
    def before_reduce(self) -> None:
        assert self.reduce_stream is not None
        self.reduce_stream.wait_stream(self.compute())

    def sum_over(self, tensor: torch.Tensor, group: Any, all_reduce: AllReduce) -> None:
        # On the reduce stream, behind the gradients being summed ([Note: streams]): one
        # collective with the bucket's reduction, at its priority, instead of one per parameter
        # on compute. The copy-in, on compute, waits for its event, which also follows what the
        # reduce stream held before it: the last reduce-scatter, which compute already waited
        # for at its ReleaseReduce unless max_reduce_inputs > 1. `tensor` belongs to compute,
        # which reads it after that wait, so no other stream holds it when compute frees it.
        assert self.reduce_stream is not None
        self.before_reduce()
        with self.on(self.reduce_stream):
            self.wait(all_reduce(tensor, group))
            summed = self.reduce_stream.record_event()
        self.compute().wait_event(summed)

    def reduce_issued(self, result: comm.CommResult, span: Any) -> tuple[Event, torch.Tensor | None]:
        # The reduce stream waits and sums (once: the tensor is kept, [Note: streams]).
        assert self.reduce_stream is not None
        reduced = self.wait(result)
        self.timer.stop(span, self.reduce_stream)
        return self.reduce_stream.record_event(), reduced

    def after_reduction(self, fn: Callable[[], torch.Tensor], after: Event) -> tuple[torch.Tensor, Event]:
        # on the reduce stream, behind the reduction (`after` was recorded on it); what `fn`
        # allocates belongs to the reduce stream, as the reduced shard does ([Note: streams])
        assert self.reduce_stream is not None
        with self.on(self.reduce_stream):
            out = fn()
        return out, self.reduce_stream.record_event()

    def release_reduce(self, result: comm.CommResult, event: Event) -> torch.Tensor | None:
        # compute may reuse the input once the reduce-scatter is done
        self.compute().wait_event(event)
        return None

    def all_reduce(self, issue: Any, reduced: torch.Tensor, after: Event, label: str) -> tuple[comm.CommResult, Event]:
        assert self.all_reduce_stream is not None and after is not None
        stream = self.all_reduce_stream
        stream.wait_event(after)
        with self.on(stream):
            span = self.timer.start("collective", "all_reduce", label, stream, nbytes(reduced))
            result = issue()
            self.wait(result)  # the all-reduce stream waits, in order ([Note: streams])
            self.timer.stop(span, stream)
            return result, stream.record_event()

    def finish_reduce(self, event: Event, all_reduce: comm.CommResult | None, all_reduce_event: Event) -> None:
        self.compute().wait_event(all_reduce_event if all_reduce is not None else event)
