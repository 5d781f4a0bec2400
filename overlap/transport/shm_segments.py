"""The shared-memory segments of one group's ranks on one host: each rank's header and ring, the
posts and pulls through csrc/shm.cpp, the ring's bookkeeping ([Note: shared-memory exchange] and
[Note: all-gather output in the ring] in transport/shm.py, whose strategies use these)."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from overlap.kernels import cpu
from overlap.transport import collectives as comm

_POSTED, _ABORT, _CONSUMED, _DESC = 0, 8, 16, 128  # word offsets in a header
_SLEEPERS_POSTED, _SLEEPERS_OTHER = 1, 2  # how many peers sleep on the posted word, on any other
MAX_RANKS = _DESC - _CONSUMED  # ranks of one host in a group
NUM_DESCRIPTORS = 256  # a rank posts at most this many collectives ahead of the slowest peer
HEADER_BYTES = 8192  # (_DESC + 3 * NUM_DESCRIPTORS) int64 words, rounded up to pages
MAX_OUTPUTS = 1024  # all-gather outputs in the ring at once (then they are allocated privately)
ALIGN = 64
MIN_RING_BYTES, MAX_RING_BYTES = 32 << 20, 1 << 30
# a wait spins, then yields its core, then sleeps ([Note: shared-memory waits] in csrc/shm.cpp)
SPIN_S, YIELD_S = 20e-6, 1e-3
DEFAULT_TIMEOUT = timedelta(minutes=30)  # gloo's default process-group timeout
# a reduce-scatter output this large comes from csrc/pool.cpp: glibc maps blocks of 32 MiB and up
# afresh at every allocation, whatever its thresholds ([Note: recycled outputs] in csrc/pool.cpp)
RECYCLED_BYTES = (32 << 20) - 4096
_STATUS = {1: "did not {what} within {t}", 2: "failed and aborted its exchanges", 3: "is gone (its process exited)"}


class ShmWork:
    """A posted collective until its pull is done; used as a `dist.Work` is here. `out`: an
    all-gather's output (its peers' rows are pulled into it); None: a reduce-scatter's, whose sum
    of `cols` elements of `dtype` the pull allocates (`reduced`), `divide` then applied; `pull`
    instead: any other collective's, handed every rank's bytes in place (`ShmSegments.publish`)."""

    __slots__ = ("cols", "divide", "done", "dtype", "nbytes", "out", "pull", "reduced", "segments", "seq")

    def __init__(
        self,
        segments: ShmSegments,
        seq: int,
        nbytes: int,
        out: torch.Tensor | None,
        cols: int = 0,
        dtype: torch.dtype | None = None,
        divide: comm.Divide | None = None,
        pull: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        self.segments, self.seq, self.nbytes, self.out, self.pull = segments, seq, nbytes, out, pull
        self.cols, self.dtype, self.divide = cols, dtype, divide
        self.reduced: torch.Tensor | None = None
        self.done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.done:
            self.segments.complete_through(self)
        return True

    def result(self, _: torch.Tensor) -> torch.Tensor:
        """A reduce-scatter's sum, once waited on (`CommResult.finish`)."""
        assert self.reduced is not None, f"rank {self.segments.rank}: collective {self.seq} read before its wait"
        return self.reduced

    def get_future(self) -> Any:
        raise RuntimeError("getFuture not implemented: a shared-memory exchange has no future")


class ShmSegments:
    """This rank's segment and its peers', and the order of the collectives through them
    ([Note: shared-memory exchange]). Created collectively over `group`."""

    def __init__(self, group: dist.ProcessGroup, ring_bytes: int, timeout: timedelta | None) -> None:
        self.ext = cpu.load_extension()
        assert self.ext is not None, "the shared-memory transport needs the compiled kernels"
        layout = [_POSTED, _ABORT, _CONSUMED, _DESC, _SLEEPERS_POSTED, _SLEEPERS_OTHER, NUM_DESCRIPTORS, HEADER_BYTES]
        assert list(self.ext.shm_header_layout()) == layout, "csrc/shm.cpp reads another header layout"
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.ring_bytes = ring_bytes
        self.timeout_s = (timeout or DEFAULT_TIMEOUT).total_seconds()
        self.limit = "the process group's timeout" if timeout is None else f"collective_timeout_s={self.timeout_s:g}"
        self.maps, self.words, flags = self._map(group, HEADER_BYTES + ring_bytes)
        # one-element views of every header word before the descriptors: what the C++ side reads and writes
        self.flag_words = [[f[i : i + 1] for i in range(_DESC)] for f in flags]
        # every segment whole (header, then ring): what a whole post or pull in C++ takes
        self.whole = [torch.frombuffer(m, dtype=torch.uint8) for m in self.maps]
        self.mine = self.whole[self.rank]
        self.rings = [w[HEADER_BYTES:] for w in self.whole]
        self.seq = 0  # the last collective this rank posted
        self.pulled = 0  # the last collective this rank pulled
        self.posts: deque[tuple[int, int, int]] = deque()  # (seq, start, end) not consumed by every peer
        self.pending: deque[ShmWork] = deque()  # posted, not pulled: in issue order
        self.reserved: tuple[int, int] | None = None
        self.ring_ptr = self.rings[self.rank].data_ptr()
        self.peers = [p for p in range(self.world_size) if p != self.rank]
        # posts take the ring's lower half, all-gather outputs its upper half ([Note: all-gather
        # output in the ring]): a post never waits for an output its user still holds
        self.half = ring_bytes // 2 // ALIGN * ALIGN
        # [start, end, seq (0: not posted yet), slot]: outputs not yet dropped or not yet consumed
        self.outputs: list[list[int]] = []
        live = bytearray(8 * MAX_OUTPUTS)  # live[slot]: 1 until the output's storage is freed
        self.live, self.live_words = torch.frombuffer(live, dtype=torch.int64), memoryview(live).cast("q")
        self.free_slots = list(range(MAX_OUTPUTS))
        self.failed: str | None = None
        self.spin_s, self.yield_s = SPIN_S, YIELD_S

    def _map(self, group: dist.ProcessGroup, nbytes: int) -> tuple[list[mmap.mmap], list[memoryview], list[Any]]:
        token: list[Any] = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        self.paths = paths = [f"/dev/shm/overlap-{token[0]}-{r}" for r in range(self.world_size)]
        fd = os.open(paths[self.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            own = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        try:
            pids: list[Any] = [None] * self.world_size
            dist.all_gather_object(pids, os.getpid(), group=group)  # every segment exists now
            maps = []
            for r, path in enumerate(paths):
                if r == self.rank:
                    maps.append(own)
                    continue
                with open(path, "r+b") as f:
                    maps.append(mmap.mmap(f.fileno(), nbytes))
            dist.barrier(group=group)  # every rank mapped every segment: none is needed by name
            for path in paths:  # each rank unlinks them all: gone before any rank goes on
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        finally:  # [Note: shared-memory exchange]: nothing left in /dev/shm, whatever failed
            with contextlib.suppress(FileNotFoundError):
                os.unlink(paths[self.rank])
        # a peer's pid is checked only where this rank sees the same process (one pid namespace)
        self.pids = [p if r != self.rank and os.path.exists(f"/proc/{p}") else 0 for r, p in enumerate(pids)]
        words = [memoryview(m)[:HEADER_BYTES].cast("q") for m in maps]
        flags = [torch.frombuffer(m, dtype=torch.int64, count=HEADER_BYTES // 8) for m in maps]
        return maps, words, flags

    # ------------------------------------------------------------------ posting
    def fits(self, nbytes: int) -> bool:
        """Whether one collective of `nbytes` per rank goes through the ring (the same on every rank)."""
        return _aligned(nbytes) <= self.half

    def reserve(self, nbytes: int) -> torch.Tensor:
        """Room for this rank's next post, once every peer consumed what was there."""
        start = self._room(nbytes)
        self.reserved = (start, start + _aligned(nbytes))
        return self.rings[self.rank][start : start + nbytes]

    def _room(self, nbytes: int) -> int:
        """The offset of room for this rank's next post in the ring's lower half, making room
        if it is full or every descriptor is in use."""
        assert self.reserved is None, f"rank {self.rank}: two shared-memory posts reserved at once"
        self._raise_if_failed()
        size = _aligned(nbytes)
        start = self._first_fit(size)
        while start is None or self.seq - self._consumed() >= NUM_DESCRIPTORS:
            self._make_room()
            start = self._first_fit(size)
        return start

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is the reserved room."""
        if self.reserved is None:
            return False
        return tensor.data_ptr() == self.ring_ptr + self.reserved[0]

    def output(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """An all-gather's output in the ring's upper half, where peers read this rank's row in
        place ([Note: all-gather output in the ring]); None where it has no room now."""
        size = _aligned(numel * dtype.itemsize)
        if size > self.ring_bytes - self.half or not self.free_slots:
            return None
        self._release_consumed()
        start = _fit([(s, e) for s, e, _, _ in self.outputs], size, self.half, self.ring_bytes)
        if start is None:
            return None
        slot = self.free_slots.pop()
        out = self.ext.shm_output(self.mine, start, numel, dtype, self.live, slot)
        self.outputs.append([start, start + size, 0, slot])
        return out

    def publish(self, nbytes: int, pull: Callable[[list[torch.Tensor]], None]) -> ShmWork:
        """Post the reserved room's `nbytes` as the next collective; `pull` reads every rank's."""
        assert self.reserved is not None, f"rank {self.rank}: a shared-memory post without room"
        (start, _), self.reserved = self.reserved, None
        seq = self.seq + 1
        self.ext.shm_post(self.mine, seq, start, nbytes)
        return self._posted(start, ShmWork(self, seq, nbytes, None, pull=pull))

    def _posted(self, start: int, work: ShmWork) -> ShmWork:
        """Book `work`, just posted at `start` (csrc/shm.cpp wrote its descriptor and raised the word)."""
        self.posts.append((work.seq, start, start + _aligned(work.nbytes)))
        return self._issued(work)

    def _issued(self, work: ShmWork) -> ShmWork:
        self.seq = work.seq
        self.pending.append(work)
        return work

    def _first_fit(self, size: int) -> int | None:
        """The lowest free offset of the lower half with `size` bytes of room: the ring's start
        whenever it is empty, so the same pages come back warm in cache and already mapped
        ([Note: shared-memory exchange])."""
        self._release_consumed()
        return _fit([(s, e) for _, s, e in self.posts], size, 0, self.half)

    def _consumed(self) -> int:
        """The last collective of this rank's that every peer consumed and this rank pulled (its
        own row of a reduce-scatter is read from its ring)."""
        return min(min(self.words[p][_CONSUMED + self.rank] for p in self.peers), self.pulled)

    def _release_consumed(self) -> None:
        if not self.posts and not self.outputs:
            return
        consumed = self._consumed()
        while self.posts and self.posts[0][0] <= consumed:
            self.posts.popleft()
        live = self.live_words
        for entry in [o for o in self.outputs if o[2] <= consumed and live[o[3]] == 0]:
            self.outputs.remove(entry)  # dropped by its user, read by every peer (or never posted)
            self.free_slots.append(entry[3])

    def _make_room(self) -> None:
        """Complete this rank's oldest pending collective, or wait for the slowest peer to
        consume this rank's oldest collective it has not."""
        if self.pending:
            self.complete_through(self.pending[0])
            return
        oldest = self._consumed() + 1
        for p in self.peers:
            self._wait(p, _CONSUMED + self.rank, oldest, "consume")

    # ------------------------------------------------------------------ pulling
    def complete_through(self, work: ShmWork) -> None:
        """Pull every pending collective up to `work`, in issue order."""
        while not work.done:
            self._raise_if_failed()
            self._pull(self.pending[0])
            done = self.pending.popleft()
            done.done, self.pulled = True, done.seq

    def _pull(self, work: ShmWork) -> None:
        """Wait for every peer's post of `work`, read it in place, and mark it consumed: one call
        into csrc/shm.cpp, which answers how it ended and how long it waited for the peers."""
        if work.pull is not None:
            self._pull_regions(work, work.pull)
            return
        args = (self.whole, self.rank, work.seq)
        wait = (self.pids, self.timeout_s, self.spin_s, self.yield_s)
        if work.out is not None:
            outcome = self.ext.shm_pull_gather(*args, work.out, *wait)
        else:
            work.reduced = self._sum_output(work.cols, work.dtype)
            divide = work.divide
            numel, divisor = (0, 1) if divide is None or divide.divisor == 1 else divide
            outcome = self.ext.shm_pull_reduce(*args, work.nbytes, work.reduced, *wait, numel, float(divisor))
        if outcome[0]:
            self._fail(_pull_failure(outcome, work), outcome[-1] / 1e9)

    def _sum_output(self, numel: int, dtype: torch.dtype | None) -> torch.Tensor:
        """A reduce-scatter's output: recycled from csrc/pool.cpp from `RECYCLED_BYTES` up
        ([Note: recycled outputs] there), where glibc would map fresh pages at every call."""
        assert dtype is not None
        if numel * dtype.itemsize >= RECYCLED_BYTES:
            return self.ext.pool_empty(numel, dtype)
        return torch.empty(numel, dtype=dtype)

    def _pull_regions(self, work: ShmWork, pull: Callable[[list[torch.Tensor]], None]) -> None:
        """`_pull` of a collective posted with `publish`: every rank's bytes handed to `pull`."""
        regions = []
        for p in range(self.world_size):
            if p != self.rank:
                self._wait(p, _POSTED, work.seq, "post")
            words, d = self.words[p], _DESC + 3 * (work.seq % NUM_DESCRIPTORS)
            seq, start, nbytes = words[d], words[d + 1], words[d + 2]
            if seq != work.seq or nbytes != work.nbytes:
                self._fail(_pull_failure([4, p, seq, nbytes], work))
            regions.append(self.rings[p][start : start + nbytes])
        pull(regions)
        del regions
        for p in range(self.world_size):
            if p != self.rank:
                self._post(_CONSUMED + p, work.seq)

    def _post(self, offset: int, value: int) -> None:
        """Raise this rank's word at `offset` to `value`, waking whoever sleeps on it."""
        mine = self.flag_words[self.rank]
        self.ext.shm_post_flag(mine[offset], value, mine[_sleepers(offset)])

    def _wait(self, peer: int, offset: int, target: int, what: str) -> None:
        """Wait for `peer`'s word at `offset` to reach `target` ([Note: shared-memory waits] in csrc/shm.cpp)."""
        theirs = self.flag_words[peer]
        start = time.monotonic()
        status = self.ext.shm_wait_flag(
            theirs[offset],
            target,
            theirs[_ABORT],
            self.pids[peer],
            self.timeout_s,
            theirs[_sleepers(offset)],
            self.spin_s,
            self.yield_s,
        )
        if status:
            why = _STATUS[status].format(what=what, t=f"{self.timeout_s:g}s")
            self._fail(
                f"rank {peer} of the group {why} (waiting for it to {what} collective {target})",
                time.monotonic() - start,
            )

    def _fail(self, message: str, waited_s: float = 0.0) -> None:
        """Raise, after raising this rank's abort word: every peer's wait on it ends at once."""
        self.failed = message
        self._post(_ABORT, 1)
        self._raise_if_failed(waited_s)

    def _raise_if_failed(self, waited: float = 0.0) -> None:
        """The error every collective raises once one failed: in the shape of `comm.wait`'s."""
        if self.failed is not None:
            raise comm.CollectiveError(
                f"failed after {waited:.1f}s ({self.limit}): a peer rank "
                f"died, is stuck or issued a different collective; shared-memory exchange: {self.failed}"
            )

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.ext.shm_copy_bytes(dst, src)

    # ------------------------------------------------------------------ the two collectives
    def all_gather(self, send: torch.Tensor, out: torch.Tensor) -> comm.CommResult:
        """Post `send`, written into this rank's row of `out` in the same pass; the wait copies
        every peer's into its row (`comm.all_gather_flat` with `via`)."""
        send = send.contiguous()
        nbytes = send.numel() * send.element_size()
        entry = self._output_of(out)
        if entry is None:
            start = self._room(nbytes)
        else:  # its row of the output is the post
            while self.seq - self._consumed() >= NUM_DESCRIPTORS:
                self._make_room()
            start = entry[0] + self.rank * nbytes
        seq = self.seq + 1
        self.ext.shm_post_gather(self.mine, seq, start, out, self.rank, send)
        work = ShmWork(self, seq, nbytes, out)
        if entry is None:
            return comm.CommResult(out, self._posted(start, work), (send,))
        entry[2] = seq
        return comm.CommResult(out, self._issued(work), (send,))

    def _output_of(self, out: torch.Tensor) -> list[int] | None:
        """The booking of `out` if it is an unposted `output()`."""
        if not self.outputs:
            return None
        ptr = out.data_ptr() - self.ring_ptr
        return next((o for o in self.outputs if o[0] == ptr and o[2] == 0), None)

    def reduce_scatter(self, full: torch.Tensor, divide: comm.Divide | None) -> comm.CommResult:
        """Post the rank-major `full` (in the reserved room, or copied there); the wait sums this
        rank's row of every rank's, in rank order, then `divide` (`comm.reduce_scatter_flat`)."""
        nbytes = full.numel() * full.element_size()
        if not self.holds(full):
            self.copy(self.reserve(nbytes), _bytes(full))
        assert self.reserved is not None
        (start, _), self.reserved = self.reserved, None
        seq, cols = self.seq + 1, full.numel() // self.world_size
        self.ext.shm_post(self.mine, seq, start, nbytes)
        work = self._posted(start, ShmWork(self, seq, nbytes, None, cols, full.dtype, divide))
        return comm.CommResult(full, work, (full,), work.result, nbytes=nbytes + cols * full.element_size())

    def cancel(self) -> None:
        """Give back the reserved room unposted."""
        self.reserved = None


def _pull_failure(outcome: list[int], work: ShmWork) -> str:
    """What a failed pull's outcome (csrc/shm.cpp: status, peer, then its descriptor) says."""
    status, peer = outcome[0], outcome[1]
    if status == 4:
        return (
            f"rank {peer} of the group posted another collective as number {work.seq} "
            f"({outcome[3]} bytes against this rank's {work.nbytes}): the ranks issue different collectives"
        )
    t = f"{work.segments.timeout_s:g}s"
    return f"rank {peer} of the group {_STATUS[status].format(what='post', t=t)} (waiting for it to post collective {work.seq})"


def _sleepers(offset: int) -> int:
    """The header word counting the peers asleep on the word at `offset`."""
    return _SLEEPERS_POSTED if offset == _POSTED else _SLEEPERS_OTHER


def _fit(taken: list[tuple[int, int]], size: int, lo: int, hi: int) -> int | None:
    """The lowest offset in [lo, hi) with `size` bytes free of every (start, end) in `taken`."""
    start = lo
    for s, e in sorted(taken):
        if start + size <= s:
            break
        start = max(start, e)
    return start if start + size <= hi else None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)
