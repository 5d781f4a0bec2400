"""HSDP's sums across replicas through shared memory, when every rank of the replicate group is
on this host: the all-reduce strategy beside shm.py's all-gather and reduce-scatter.

[Note: shared-memory all-reduce]
The replicate group gets segments of its own (`shm.ShmSegments` over that group, sized like the
shard group's), so its collectives are numbered apart from the shard group's: each group's
ranks issue theirs in one order ([Note: collective order] in engine/schedule.py), and a wait
completes the earlier ones of its own group only. A sum is *posted* at issue (the rank copies its
tensor into its ring) and *pulled* at the wait: every rank sums all the replicas' tensors in rank
order straight out of the rings into its tensor, in one pass. The same additions in the
same order on every rank: the replicas stay bitwise equal (gloo's ring all-reduce sums in an
order of its own, the same for two ranks). What the ring cannot hold, a mean (ReduceOp.AVG,
NCCL only), and a sum over any other group (tensor parallelism's Partial() gradients) take gloo.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from overlap import kernels
from overlap.transport import collectives as comm
from overlap.transport import shm
from overlap.transport.strategy import AllReduce, Wire


class ShmAllReduce(AllReduce):
    """Sums over `group` (the replicate group) through shared memory; `fallback` (gloo's
    all-reduce) for what the segments do not carry ([Note: shared-memory all-reduce])."""

    through_shared_memory = True

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta | None, fallback: AllReduce) -> None:
        self.group, self.timeout, self.fallback = group, timeout, fallback
        self.segments: shm.ShmSegments | None = None

    def plan(self, wire: Wire) -> None:
        """Map the replicate group's segments (collective over it: every rank plans at wrap)."""
        super().plan(wire)
        self.fallback.plan(wire)
        if self.segments is None:
            self.segments = shm.ShmSegments(self.group, shm.ring_bytes_for(wire), self.timeout)

    def flush(self) -> None:
        self.fallback.flush()

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup, average: bool = False) -> comm.CommResult:
        seg = self.segments
        nbytes = tensor.numel() * tensor.element_size()
        carries = seg is not None and nbytes > 0 and seg.fits(nbytes) and tensor.is_contiguous()
        if group is not self.group or average or not carries:
            return self.fallback(tensor, group, average)
        self.fallback.flush()  # what gloo held back goes first, as before any collective of ours
        return comm.all_reduce_flat(tensor, group, via=self)

    def all_reduce(self, tensor: torch.Tensor) -> comm.CommResult:
        """Post `tensor` (copied into this rank's ring); the wait sums every replica's, in rank
        order, into `tensor` (`comm.all_reduce_flat` with `via`)."""
        seg = self.segments
        assert seg is not None
        flat, nbytes = tensor.view(-1), tensor.numel() * tensor.element_size()
        seg.copy(seg.reserve(nbytes), flat.view(torch.uint8))

        def pull(regions: list[torch.Tensor]) -> None:
            kernels.sum_rows([region.view(tensor.dtype) for region in regions], out=flat)  # one pass

        return comm.CommResult(tensor, seg.publish(nbytes, pull), (tensor,))
