"""Executors: where the work after a collective runs, and how compute waits for it.

One of the two halves of a transport ([Note: the seam] in strategy.py). `StreamExecutor`
(streams.py, CUDA) enqueues the work after a collective on comm streams at issue and makes the
compute stream wait on events; `HostExecutor` (host.py, CPU) runs it on the training thread
when the runtime waits. Neither chooses a collective: the strategies do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from overlap.transport import collectives as comm
from overlap.transport.fingerprint import FingerprintCheck
from overlap.transport.strategy import AllReduce, Event, GatherResult

GatherDone = Callable[[GatherResult, Any], "Event"]
"""The runtime's work after a unit's all-gather has arrived: (record, gathered rows) -> the
event recorded right after copy-out (`Executor.gather_copied`: CUDA) or None (copy-out, tag
check, hpZ copy, buffers dropped; `Runtime._finish_gather`)."""


class TagRead(NamedTuple):
    """Where a gather's tags are, for `Executor.check_tag` ([Note: collective fingerprints])."""

    index: int  # the unit
    mine: int  # this rank's tag
    what: str  # the gather, for the error
    tag_out: torch.Tensor | None  # copy-out's destination for the tags (uncompressed)
    gathered: Any  # the gathered rows (a tensor, or the rows where they landed)
    received: torch.Tensor  # what the collective received (compressed: tags end its byte rows)
    compressed: bool
    unsharded: torch.Tensor  # the unit's unsharded storage, which no tag read may touch


class Executor:
    """Where the work after a collective runs. The runtime calls, in order: for a gather
    `before_gather`, the strategy, `gather_issued`, later `wait_gather`; for a reduction
    `before_reduce`, the strategy, `reduce_issued`, `release_reduce`, `finish_reduce`."""

    gather_stream: torch.cuda.Stream | None = None  # the stream gathers are issued on (None: host)
    reduce_stream: torch.cuda.Stream | None = None  # the stream reductions are issued on (None: host)
    all_reduce_stream: torch.cuda.Stream | None = None  # HSDP: the stream of the sums across replicas

    def __init__(
        self, rank: int, world_size: int, device: torch.device, timer: Any, timeout: timedelta | None, replicated: bool
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timer = timer  # observe/timing.py: spans from events (CUDA) or work handles (host)
        self.timeout = timeout
        self.replicated = replicated  # HSDP: sums across replicas follow the reductions

    def on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        """Issue on `stream` (None: the current one)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def wait(self, result: comm.CommResult) -> Any:
        return comm.wait(result, self.timeout)

    # ------------------------------------------------------------------ gathers
    def before_gather(self, alloc: Callable[[], None]) -> None:
        """Before a gather is issued; `alloc` allocates the unit's unsharded storage."""
        raise NotImplementedError

    def gather_issued(self, record: GatherResult, span: Any, done: GatherDone) -> GatherResult:
        """`record` was just issued (inside `on(gather_stream)`): what the runtime keeps until
        `wait_gather`."""
        raise NotImplementedError

    def wait_gather(self, record: GatherResult, done: GatherDone) -> None:
        """Make the unit's gathered parameters usable on the compute stream or thread."""
        raise NotImplementedError

    def gather_copied(self) -> Event:
        """`done` has just copied the gathered rows out: what compute will wait for (CUDA)."""
        return None

    def check_tag(self, fingerprints: FingerprintCheck, read: TagRead) -> None:
        """Compare the gathered tags with `read.mine` ([Note: collective fingerprints])."""
        raise NotImplementedError

    # ------------------------------------------------------------------ reductions
    def before_reduce(self) -> None:
        """Before a reduction is issued."""
        raise NotImplementedError

    def reduce_issued(self, result: comm.CommResult, span: Any) -> tuple[Event, torch.Tensor | None]:
        """A reduction was just issued (inside `on(reduce_stream)`): (event, reduced shard)
        where the executor already has them, else (None, None)."""
        raise NotImplementedError

    def after_reduction(self, fn: Callable[[], torch.Tensor], after: Event) -> tuple[torch.Tensor, Event]:
        """Run `fn` (the work on a reduced shard: its division, its cast) behind `after`, where
        reductions run: (its result, the event after it)."""
        raise NotImplementedError

    def release_reduce(self, result: comm.CommResult, event: Event) -> torch.Tensor | None:
        """The compute side is done with the reduction's input: the reduced shard where the
        executor only gets it now (host), else None."""
        raise NotImplementedError

    def all_reduce(
        self, issue: Callable[[], comm.CommResult], reduced: torch.Tensor, after: Event, label: str
    ) -> tuple[comm.CommResult, Event]:
        """HSDP: issue `issue` (the sum of `reduced` across replicas, [Note: hybrid sharding])
        behind `after`: (its result, the event after it)."""
        raise NotImplementedError

    def finish_reduce(self, event: Event, all_reduce: comm.CommResult | None, all_reduce_event: Event) -> None:
        """Make a reduced (and HSDP-summed) shard usable on the compute stream or thread."""
        raise NotImplementedError

    def sum_over(self, tensor: torch.Tensor, group: dist.ProcessGroup, all_reduce: AllReduce) -> None:
        """Sum `tensor` in place over `group` (tensor parallelism's Partial() gradients, before
        the copy-in reads them, `compose.grad_data`); here the training thread waits for it."""
        self.wait(all_reduce(tensor, group))
