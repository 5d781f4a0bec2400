"""The CPU executor: collectives run on the backend's threads, the work after them on the
training thread when the runtime waits ([Note: the seam] in strategy.py).

A collective is an async work handle (gloo's worker threads, or a shared-memory exchange); the
training thread waits for it where the runtime waits (`wait_gather`, `release_reduce`,
`finish_reduce`) and then does the copies itself. Freed host memory is kept for reuse
([Note: CPU page faults]). Which collectives move the bytes is the strategies' (gloo.py, shm.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from overlap.transport import collectives as comm
from overlap.transport.executor import Executor, GatherDone, TagRead
from overlap.transport.fingerprint import TAG_NUMEL, FingerprintCheck, HostTags, host_byte_tags
from overlap.transport.strategy import Event, GatherResult

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
        warnings.warn("overlap: mallopt refused the CPU allocator settings; continuing without", stacklevel=2)
    return ok


class HostExecutor(Executor):
    """CPU tensors: host waits; the work after a collective runs on the training thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._host_tags: dict[int, HostTags] = {}  # per unit: reads copy-out's tag buffer in place

    # ------------------------------------------------------------------ gathers
    def before_gather(self, alloc: Any) -> None:
        pass  # the unsharded storage is allocated at the wait, before copy-out

    def gather_issued(self, record: GatherResult, span: Any, done: GatherDone) -> GatherResult:
        assert record.comm is not None
        self.timer.stop(span, work=record.comm.work)
        return record

    def wait_gather(self, record: GatherResult, done: GatherDone) -> None:
        assert record.comm is not None, f"rank {self.rank}: unit {record.index} waited twice"
        gathered = self.wait(record.comm)
        self.timer.waited(record.comm.work)
        done(record, gathered)

    def check_tag(self, fingerprints: FingerprintCheck, read: TagRead) -> None:
        """After copy-out, from the tags it copied (`HostTags`), or from the gathered rows where
        they cannot be read in place. A compressed gather's tags end its byte rows."""
        if read.compressed:
            fingerprints.check_host(host_byte_tags(read.received, self.world_size), read.mine, read.what)
            return
        tags, cached = read.tag_out, self._host_tags.get(read.index)
        if cached is not None and cached.trailers is tags:
            fingerprints.check_host(cached, read.mine, read.what)
        elif tags is not None and HostTags.fits(tags, self.world_size):
            self._host_tags[read.index] = cached = HostTags(tags, self.world_size)
            fingerprints.check_host(cached, read.mine, read.what)
        else:
            gathered = read.gathered
            if isinstance(gathered, list):  # rows left where they landed: each ends in its tag
                gathered = torch.cat([row[-TAG_NUMEL:] for row in gathered])
            fingerprints.check(gathered, self.world_size, read.mine, read.what)

    # ------------------------------------------------------------------ reductions
    def before_reduce(self) -> None:
        pass

    def reduce_issued(self, result: comm.CommResult, span: Any) -> tuple[Event, torch.Tensor | None]:
        self.timer.stop(span, work=result.work)
        return None, None

    def after_reduction(self, fn: Callable[[], torch.Tensor], after: Event) -> tuple[torch.Tensor, Event]:
        return fn(), None  # the training thread, now

    def release_reduce(self, result: comm.CommResult, event: Event) -> torch.Tensor | None:
        # wait for the work; sum (or decode) what an exchange received
        reduced = self.wait(result)
        self.timer.waited(result.work)
        return reduced

    def all_reduce(
        self, issue: Callable[[], comm.CommResult], reduced: torch.Tensor, after: Event, label: str
    ) -> tuple[comm.CommResult, Event]:
        span = self.timer.start("collective", "all_reduce", label, None, reduced.numel() * reduced.element_size())
        result = issue()
        self.timer.stop(span, work=result.work)
        return result, None

    def finish_reduce(self, event: Event, all_reduce: comm.CommResult | None, all_reduce_event: Event) -> None:
        if all_reduce is not None:
            self.wait(all_reduce)
            self.timer.waited(all_reduce.work)
