"""How bytes move between ranks: collectives as pure functions, and transports made of an
executor and collective strategies ([Note: the seam] in strategy.py).

`backend` decides what a process group's collectives mean for a device; `collectives` issues
them (pure functions), on gloo through `pairwise` (an all-to-all as point-to-point messages,
receives first), and `coded` those that go through a codec; `fingerprint` is the tag every
all-gather carries and its check. `strategy` holds the strategy interfaces and the backend's
native collectives, `gloo` gloo's own mechanisms as strategies; `executor` is where the work
after a collective runs, `streams` (CUDA) and `host` (CPU) its two kinds; `base` is the
`Transport` the runtime drives, one chosen at wrap by `make_transport`. The engine imports this
package, never the reverse.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from overlap.transport import backend
from overlap.transport.base import Transport, honoured_timeout, make_wire
from overlap.transport.executor import Executor
from overlap.transport.gloo import gloo_strategies
from overlap.transport.host import HostExecutor
from overlap.transport.streams import StreamExecutor
from overlap.transport.streams import check_settings as _check_stream_settings
from overlap.transport.strategy import AllGather, AllReduce, GatherResult, ReduceScatter, UnitWire, native_strategies


def make_transport(
    group: dist.ProcessGroup,
    device: torch.device,
    timer: Any,
    timeout: timedelta | None,
    reduce_impl: str,
    gather_impl: str,
    replicate_group: dist.ProcessGroup | None = None,
    secondary_group: dist.ProcessGroup | None = None,
) -> Transport:
    """The transport for `device`'s tensors over `group`, chosen once at wrap: CUDA tensors
    through comm streams and events and the backend's collectives; CPU tensors through host
    waits and gloo's own mechanisms. Raises ValueError for a setting it cannot honour."""
    semantics = backend.semantics(group, device)  # [Note: NCCL is not gloo] in backend.py
    check_settings(group, device, gather_impl)
    cuda = device.type == "cuda"
    executor_kind: type[Executor] = StreamExecutor if cuda else HostExecutor
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    executor = executor_kind(
        rank, world_size, device, timer, honoured_timeout(semantics, timeout), replicate_group is not None
    )
    strategies = native_strategies() if cuda else gloo_strategies()
    wire = make_wire(group, device, semantics, reduce_impl, gather_impl, secondary_group)
    return Transport(executor, *strategies, wire)


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
    "StreamExecutor",
    "Transport",
    "UnitWire",
    "check_settings",
    "make_transport",
]
