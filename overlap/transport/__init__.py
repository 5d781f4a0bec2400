"""How bytes move between ranks: collectives as pure functions, and transports made of an
executor and collective strategies ([Note: the seam] in strategy.py).

`backend` decides what a process group's collectives mean for a device; `collectives` issues
them (pure functions), on gloo through `pairwise` (an all-to-all as point-to-point messages,
receives first), and `coded` those that go through a codec; `fingerprint` is the tag every
all-gather carries and its check. `strategy` holds the strategy interfaces and the backend's
native collectives, `gloo` gloo's own mechanisms as strategies, `shm` the all-gather and
reduce-scatter of ranks on one host through shared memory, `shm_all_reduce` HSDP's sums across
replicas on one host the same way; `executor` is where the work after a collective runs,
`streams` (CUDA) and `host` (CPU) its two kinds; `base` is the `Transport` the runtime drives,
one chosen at wrap by `make_transport`. The engine imports this package, never the reverse.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from overlap.transport import backend, shm
from overlap.transport.base import Transport, honoured_timeout, make_wire
from overlap.transport.executor import Executor
from overlap.transport.gloo import gloo_strategies
from overlap.transport.host import HostExecutor
from overlap.transport.shm_all_reduce import ShmAllReduce
from overlap.transport.strategy import AllGather, AllReduce, GatherResult, ReduceScatter, UnitWire, native_strategies
from overlap.transport.streams import StreamExecutor
from overlap.transport.streams import check_settings as _check_stream_settings
from overlap.transport.symm_mem import SymmMemAllGather


def make_transport(
    group: dist.ProcessGroup,
    device: torch.device,
    timer: Any,
    timeout: timedelta | None,
    reduce_impl: str,
    gather_impl: str,
    replicate_group: dist.ProcessGroup | None = None,
    secondary_group: dist.ProcessGroup | None = None,
    shared_memory: str = "auto",
    symmetric_memory: Callable[[], Any] | None = None,
) -> Transport:
    """The transport for `device`'s tensors over `group`, chosen once at wrap: CUDA tensors
    through comm streams and events and the backend's collectives; CPU tensors through host
    waits, and shared memory where every rank of `group` is on this host (`shared_memory`,
    [Note: shared-memory exchange] in shm.py), else gloo's own mechanisms. `symmetric_memory`:
    when given (torch's symmetric-memory module's accessor), CUDA all-gathers into symmetric
    memory (symm_mem.py). Raises ValueError for
    a setting it cannot honour. Collective over `group` (CPU)."""
    semantics = backend.semantics(group, device)  # [Note: NCCL is not gloo] in backend.py
    check_settings(group, device, gather_impl)
    cuda = device.type == "cuda"
    executor_kind: type[Executor] = StreamExecutor if cuda else HostExecutor
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    executor = executor_kind(
        rank, world_size, device, timer, honoured_timeout(semantics, timeout), replicate_group is not None
    )
    if cuda:
        strategies = native_strategies()
        if symmetric_memory is not None:  # symm_mem.py: where the all-gather's output lives
            strategies = (SymmMemAllGather(symmetric_memory), *strategies[1:])
    else:
        if symmetric_memory is not None:
            warnings.warn("overlap.wrap: symmetric_memory=True applies to CUDA tensors only; ignored", stacklevel=2)
        strategies = cpu_strategies(
            group, device, executor.timeout, shared_memory, gather_impl, reduce_impl, replicate_group
        )
    wire = make_wire(group, device, semantics, reduce_impl, gather_impl, secondary_group)
    return Transport(executor, *strategies, wire)


def cpu_strategies(
    group: dist.ProcessGroup,
    device: torch.device,
    timeout: timedelta | None,
    shared_memory: str,
    gather_impl: str = "auto",
    reduce_impl: str = "auto",
    replicate_group: dist.ProcessGroup | None = None,
) -> tuple[AllGather, ReduceScatter, AllReduce]:
    """Shared memory for ranks on one host, gloo's mechanisms for the rest and across hosts. An
    all_gather_impl or reduce_scatter_impl set to other than "auto" names the backend's
    collective: that one stays on gloo. HSDP: the sums across replicas go through shared memory
    where every rank of `replicate_group` is on this host ([Note: shared-memory all-reduce] in
    shm_all_reduce.py), whatever the shard group does. Collective over both groups."""
    gloo = gloo_strategies()
    gather, reduce, all_reduce = gloo
    if replicate_group is not None and shm.usable(replicate_group, device, shared_memory):
        all_reduce = ShmAllReduce(replicate_group, timeout, gloo[2])
    if "auto" not in (gather_impl, reduce_impl) or not shm.usable(group, device, shared_memory):
        return gather, reduce, all_reduce
    plan = shm.ShmPlan(timeout)
    if gather_impl == "auto":
        gather = shm.ShmAllGather(plan, gloo[0])
    if reduce_impl == "auto":
        reduce = shm.ShmReduceScatter(plan, gloo[1])
    return gather, reduce, all_reduce


def check_settings(group: dist.ProcessGroup, device: torch.device, gather_impl: str) -> None:
    """Raise ValueError for a setting the transport of `device` cannot honour; `wrap` calls it
    before anything is sharded."""
    if device.type == "cuda":
        _check_stream_settings(backend.semantics(group, device), gather_impl)


__all__ = [
    "AllGather",
    "AllReduce",
    "Executor",
    "GatherResult",
    "HostExecutor",
    "ReduceScatter",
    "ShmAllReduce",
    "StreamExecutor",
    "SymmMemAllGather",
    "Transport",
    "UnitWire",
    "check_settings",
    "make_transport",
]
