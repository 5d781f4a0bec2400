"""Ranks on one host exchange through shared memory: all-gathers and reduce-scatters as
collective strategies ([Note: the seam] in strategy.py), gloo's strategies for the rest.

[Note: shared-memory exchange]
Each rank maps one segment of its own and every peer's (`ShmSegments`): a header of sequence
words and descriptors, then a ring of bytes. A collective is numbered (every rank issues the
same ones in the same order, [Note: collective order] in engine/schedule.py) and *posted* at
issue: the rank writes its bytes into its ring (an all-gather its shard into its own row of the
output, allocated in the ring: [Note: all-gather output in the ring]; a reduce-scatter writes
nothing more: its rank-major input was allocated there, `ShmReduceScatter.allocate`), writes a
descriptor (number, offset, size) and raises its posted word (csrc/shm.cpp). The wait *pulls*: for every peer, wait for its posted
word ([Note: shared-memory waits] in csrc/shm.cpp), check its descriptor (another size or number
is another collective: an error, not wrong bytes), and read its bytes in place: copy its shard
into its row of the output, or sum the rows for this rank in rank order (kernels.sum_rows, as
the all-to-all reduction sums them, so results are bitwise those of gloo). Then the rank raises,
in its own header, how far it has consumed each peer's posts; a rank reuses its ring only behind
what every peer consumed and it pulled itself (a reduce-scatter reads its own row from its
ring). Works complete in issue order: a wait first completes every earlier collective, so
consumption is first-in first-out, and a rank short of ring space completes its own pending
collectives until the space frees (peers post at issue, so some collective can always complete:
no deadlock while one collective fits in the ring; a larger one takes gloo). A post and a pull
are one call into csrc/shm.cpp each (`shm_post_gather`/`shm_post`, `shm_pull_gather`/
`shm_pull_reduce`): the descriptor, the flags, the copies or the sum and the consumed words
behind one torch.ops dispatch, where the same steps as Python calls cost more than copying a
1 MiB all-gather in cache.

A post takes the lowest free offset of the ring's lower half (first fit), so whenever the ring has drained it
starts over at the beginning: the pages it writes are mapped already (no page faults after the
first steps) and often still in cache, where walking the whole ring would touch fresh pages and
cold lines at every post (1 MiB all-gathers back to back through a 256 MiB ring: 137 page faults
and 536 us a call walking it, 1 and 86 us first fit). Reading a peer's shard straight out of its process instead
(process_vm_readv, one copy instead of two) ran at a third to a half of memcpy's bandwidth on a
2-core AMD EPYC VM (4.7 against 9.8 GB/s at 32 MiB): the ring's copies are faster.

[Note: all-gather output in the ring]
`ShmAllGather.allocate` hands out the output in the rank's ring (its upper half; posts keep the
lower half, so a post never waits for an output its user holds): the post copies the shard once,
into its own row, and the descriptor points peers at that row, so each peer's row is copied once
(from the peer's output into this rank's), the same bytes moved as one memcpy of the output,
where a private output took the shard written twice (ring and row). What a post writes where
peers read it is written with streaming stores: a slot reused right after a peer read it would
otherwise cost an invalidation a line ([Note: streaming posts] in csrc/shm.cpp: 205 against 21 us
to post a 512 KiB row on a 2-core VM). The runtime reads the output
after the wait (copy-out, the tag check, hpZ's part) and then drops it ([Note: buffer lifetime] in engine/runtime.py),
but nothing relies on that: the tensor is made over the ring with a deleter (csrc/shm.cpp
`shm_output`) that clears its live word when the last view of its storage is freed, and the ring
reuses those bytes only once that word is clear and every peer consumed the post. Where the
upper half has no room (outputs still held) the output is a private tensor and the post writes
the shard twice, as before.

No segment outlives the job: each is unlinked from /dev/shm as soon as every rank has mapped it
(the mapping stays valid), so a rank killed at any later point leaves nothing behind. A wait never
hangs: it returns an error when the peer raised its abort word (a rank whose exchange failed
raises it), when the peer's process is gone, or after the collective timeout (a stopped peer).

Which ranks share a host is found from the group at wrap (`same_host`): hostname, boot id, the
/dev/shm device and the network namespace (ranks behind an emulated link are in their own) must
be equal on every rank. `OverlapConfig.shared_memory="off"` keeps the backend's collectives.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from overlap.kernels import cpu
from overlap.transport import collectives as comm
from overlap.transport.shm_segments import (
    MAX_RANKS,
    MAX_RING_BYTES,
    MIN_RING_BYTES,
    SPIN_S,
    YIELD_S,
    ShmSegments,
    ShmWork,
    _aligned,
)
from overlap.transport.strategy import AllGather, ReduceScatter, Strategy, Wire

__all__ = [
    "SPIN_S",
    "YIELD_S",
    "AllGather",
    "ShmAllGather",
    "ShmPlan",
    "ShmReduceScatter",
    "ShmSegments",
    "ShmWork",
    "host_identity",
    "ring_bytes_for",
    "ring_bytes_for_collective",
    "usable",
]


def host_identity() -> str:
    """What ranks on one host share and ranks elsewhere (or behind an emulated link) do not."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    netns = os.stat("/proc/self/ns/net").st_ino if os.path.exists("/proc/self/ns/net") else 0
    return f"{socket.gethostname()}|{boot}|{os.stat('/dev/shm').st_dev}|{netns}"


def usable_here(device: torch.device, setting: str, world_size: int) -> bool:
    """What this process alone can tell of `usable`: the setting, the device, the size, and
    /dev/shm with the compiled flag protocol (csrc/shm.cpp) here. Whether every rank shares the
    host is the collective part."""
    if _ruled_out(device, setting, world_size):
        return False
    return os.path.isdir("/dev/shm") and cpu.load_extension() is not None


def _ruled_out(device: torch.device, setting: str, world_size: int) -> bool:
    return setting == "off" or device.type != "cpu" or not 1 < world_size <= MAX_RANKS


def usable(group: dist.ProcessGroup, device: torch.device, setting: str) -> bool:
    """Whether the shared-memory strategies apply to `device`'s tensors over `group`: every rank
    on this host ([Note: shared-memory exchange]) with the compiled flag protocol (csrc/shm.cpp).
    Collective over `group` unless the setting, the device or the size rules it out."""
    world_size = dist.get_world_size(group)
    if _ruled_out(device, setting, world_size):  # every rank alike: no collective
        return False
    mine = host_identity() if usable_here(device, setting, world_size) else ""
    identities: list[Any] = [None] * world_size
    dist.all_gather_object(identities, mine, group=group)
    return mine != "" and len(set(identities)) == 1


def ring_bytes_for(wire: Wire) -> int:
    """Room for several of the largest posts (a unit's rank-major gradients) and all-gather
    outputs (a unit's shards, every rank's), each kind in its half of the ring."""
    largest = max(
        (wire.world_size * max(u.gather_numel * u.gather_itemsize, u.reduce_row_bytes) for u in wire.units), default=0
    )
    return ring_bytes_for_collective(largest)


def ring_bytes_for_collective(nbytes: int) -> int:
    """The ring for collectives whose all-gather output or reduce-scatter input is at most
    `nbytes` (every rank's part): room for several in each half (`ring_bytes_for`)."""
    return min(max(8 * _aligned(nbytes), MIN_RING_BYTES), MAX_RING_BYTES)


class ShmPlan:
    """The segments, created collectively when the strategies are planned (at wrap)."""

    def __init__(self, timeout: timedelta | None) -> None:
        self.timeout = timeout
        self.segments: ShmSegments | None = None

    def plan(self, wire: Wire) -> ShmSegments:
        if self.segments is None:
            self.segments = ShmSegments(wire.group, ring_bytes_for(wire), self.timeout)
        return self.segments


class _OnSegments(Strategy):
    """A strategy through the segments, with `fallback` (gloo's) for what they do not carry."""

    fallback: Any
    through_shared_memory = True

    def __init__(self, plan: ShmPlan, fallback: Any) -> None:
        self.shared, self.fallback = plan, fallback
        self.segments: ShmSegments | None = None

    def plan(self, wire: Wire) -> None:
        super().plan(wire)
        self.fallback.plan(wire)
        self.segments = self.shared.plan(wire)

    def flush(self) -> None:
        self.fallback.flush()


class ShmAllGather(_OnSegments, AllGather):
    """All-gathers through shared memory; gloo's for what the ring cannot hold. The output is
    allocated in this rank's ring where it has room ([Note: all-gather output in the ring])."""

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        seg = self.segments
        out = seg.output(numel, dtype) if seg is not None and device.type == "cpu" else None
        return super().allocate(numel, dtype, device) if out is None else out

    def __call__(
        self,
        index: int,
        send: torch.Tensor,
        dtype: torch.dtype,
        tag: int | None,
        tag_slot: torch.Tensor | None,
        for_backward: bool,
    ) -> comm.CommResult:
        seg = self.segments
        assert seg is not None
        nbytes = send.numel() * dtype.itemsize
        if not seg.fits(nbytes):
            return self.fallback(index, send, dtype, tag, tag_slot, for_backward)
        self.fallback.flush()
        w = self.wire
        out = self.allocate(w.world_size * send.numel(), dtype, send.device)
        return comm.all_gather_flat(send, w.group, w.world_size, dtype, tag, tag_slot, "native", None, out=out, via=seg)

    def encoded(self, *args: Any) -> comm.CommResult:
        return self.fallback.encoded(*args)

    def secondary(self, secondary: torch.Tensor) -> comm.CommResult:
        return self.fallback.secondary(secondary)


class ShmReduceScatter(_OnSegments, ReduceScatter):
    """Reduce-scatters through shared memory: the rank-major input is allocated in this rank's
    ring, and each rank sums its rows from every ring in place ([Note: shared-memory exchange])."""

    def allocate(self, num_rows: int, num_cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        seg = self.segments
        assert seg is not None
        nbytes = num_rows * num_cols * dtype.itemsize
        if not seg.fits(nbytes) or seg.reserved is not None:
            return super().allocate(num_rows, num_cols, dtype, device)
        self.fallback.flush()
        return seg.reserve(nbytes).view(dtype).view(num_rows, num_cols)

    def __call__(self, full: torch.Tensor, divide: comm.Divide | None, average: bool = False) -> comm.CommResult:
        assert not average, "no ReduceOp.AVG through shared memory: the runtime divides (averages() is False)"
        seg, n = self.segments, self.wire.world_size
        assert seg is not None
        if not seg.holds(full) and not seg.fits(full.numel() * full.element_size()):
            return self.fallback(full, divide)
        return comm.reduce_scatter_flat(full.view(-1), self.wire.group, n, "native", None, divide, via=seg)

    def encoded(self, full: torch.Tensor, flags: torch.Tensor, codec: Any, residual: Any) -> comm.CommResult:
        seg = self.segments
        assert seg is not None
        if seg.holds(full):  # a codec's exchange: the input leaves the ring, unposted
            full = full.clone()
            seg.cancel()
        return self.fallback.encoded(full, flags, codec, residual)

    @property
    def divides(self) -> bool:
        return True

    def averages(self, dtype: torch.dtype) -> bool:
        return False
