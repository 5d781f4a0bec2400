"""`overlap bench comm --transport shm`: a case through the shared-memory transport, called as the
engine's strategies call it, its per-call clock, the memcpy floor timed beside it, and the
default group's segments it runs in ([Note: comm bench over shared memory] in
overlap/tools/bench/comm.py)."""

from __future__ import annotations

import mmap
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from overlap.kernels import cpu
from overlap.tools.bench.comm_cases import CommCase, _loop_us
from overlap.tools.worlds.launch import DEFAULT_TIMEOUT_S
from overlap.transport import collectives as comm
from overlap.transport import shm
from overlap.transport.host import keep_freed_cpu_memory
from overlap.transport.shm_segments import MAX_RANKS, ShmSegments


def shm_all_gather(segments: ShmSegments, send: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
    """One all-gather of `send` as `ShmAllGather` runs it: into an output allocated in this
    rank's ring (`ShmSegments.output`, [Note: all-gather output in the ring] in transport/shm.py),
    or into `spare` (private, `spare.numel()` elements) where the ring has no room now. Returns
    the output after the wait; drop it then, as the runtime does (the ring reuses those bytes
    once it is freed)."""
    out = segments.output(spare.numel(), spare.dtype)
    return comm.wait(segments.all_gather(send, spare if out is None else out))


def shm_stage(segments: ShmSegments, full: torch.Tensor) -> torch.Tensor:
    """A reduce-scatter's copy-in: the rank-major `full` written into the room reserved for this
    rank's next post (`ShmReduceScatter.allocate` puts the engine's input there)."""
    room = segments.reserve(full.numel() * full.element_size()).view(full.dtype).view(full.shape)
    room.copy_(full)
    return room


def shm_reduce_scatter(segments: ShmSegments, room: torch.Tensor) -> torch.Tensor:
    """One reduce-scatter of `room` (`shm_stage`'s): posted, then the wait sums this rank's row
    of every rank's ring in rank order; returns the sum (`CommResult.finish`)."""
    return comm.wait(segments.reduce_scatter(room.view(-1), None))


class ShmCase(NamedTuple):
    """`case`'s collective through `segments` ([Note: comm bench over shared memory]): it sends
    `case.inp`; an all-gather's `case.out` is its output where the ring has no room."""

    case: CommCase
    segments: ShmSegments

    def stage(self) -> torch.Tensor:
        """What a call takes, made before its clock starts: a reduce-scatter's copy-in."""
        if self.case.op == "reduce_scatter":
            return shm_stage(self.segments, self.case.inp)
        return self.case.inp

    def launch(self, staged: torch.Tensor) -> torch.Tensor:
        """Issue and wait; the output."""
        if self.case.op == "all_gather":
            return shm_all_gather(self.segments, staged, self.case.out)
        return shm_reduce_scatter(self.segments, staged)

    def call(self) -> torch.Tensor:
        return self.launch(self.stage())


def _shm_calls_us(via: ShmCase, iters: int, warmup: int) -> float:
    """Microseconds per call, each clocked from its issue to the end of its wait, the output
    dropped inside the clock and the copy-in outside it."""
    for _ in range(warmup):
        via.call()
    dist.barrier()
    spent = 0.0
    for _ in range(iters):
        staged = via.stage()
        start = time.perf_counter()
        via.launch(staged)
        spent += time.perf_counter() - start
    return spent / iters * 1e6


def _copy_floor_us(segments: ShmSegments, num_bytes: int, iters: int, warmup: int) -> float:
    """Microseconds per memcpy of `num_bytes` between two private buffers kept across calls
    (csrc/shm.cpp's, `ShmSegments.copy`), every rank at once: the floor of a shared-memory case."""
    src, dst = torch.ones(num_bytes, dtype=torch.uint8), torch.zeros(num_bytes, dtype=torch.uint8)
    return _loop_us(lambda: segments.copy(dst, src), iters, max(warmup, 1), torch.device("cpu"))


def open_segments(max_bytes: int, device: torch.device) -> ShmSegments:
    """The default group's segments, with a ring for collectives of up to `max_bytes` (collective
    over the group); ValueError on every rank where the ranks cannot share memory."""
    group = dist.group.WORLD
    assert group is not None, "open_segments: no default process group"
    if not shm.usable(group, device, "auto"):  # collective: every rank gets the same answer
        n = dist.get_world_size(group)
        why = (
            f"the ranks use {device.type} tensors, and it carries CPU tensors only"
            if device.type != "cpu"
            else f"it needs 2 to {MAX_RANKS} ranks, not {n}"
            if not 1 < n <= MAX_RANKS
            else "it needs the compiled kernels (csrc/shm.cpp), which did not build here"
            if cpu.load_extension() is None
            else "the ranks are not all on this host (hostname, boot id, /dev/shm and network namespace must match)"
        )
        raise ValueError(f"overlap bench comm --transport shm: shared memory is not usable: {why}")
    keep_freed_cpu_memory()  # as `wrap` sets it: a reduce-scatter's sum reuses freed blocks
    ring_bytes = shm.ring_bytes_for_collective(max_bytes)  # as the engine sizes it for such a unit
    segments = ShmSegments(group, ring_bytes, timedelta(seconds=DEFAULT_TIMEOUT_S))
    _map_every_page(segments)
    return segments


def _map_every_page(segments: ShmSegments) -> None:
    """Fault in every page of every rank's ring on this rank before the sweep, outside any
    clock: in training the ring's pages are mapped after the first steps, where a case's first
    calls would otherwise land on fresh pages (at 64 MiB a few calls a case, the default budget's,
    spend more in page faults than in copies). This rank writes its own ring and reads a byte of
    every page of its peers'."""
    page = mmap.PAGESIZE
    for rank, ring in enumerate(segments.rings):
        if rank == segments.rank:
            ring.zero_()
        else:
            ring[::page].sum()
    dist.barrier()
