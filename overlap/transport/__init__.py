"""How bytes move between ranks: collectives as pure functions and one transport per execution model.

`backend` decides what a process group's collectives mean for a device; `collectives` issues
them (pure functions), on gloo through `pairwise` (an all-to-all as point-to-point messages,
receives first), and `coded` those that go through a codec; `fingerprint` is the tag every
all-gather carries and its check; `base`
is the interface the runtime drives, `streams` (CUDA) and `host` (CPU/gloo) its two
implementations, one chosen at wrap by `make_transport`. The engine imports this package, never
the reverse.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from overlap.transport import backend
from overlap.transport.base import Transport, UnitWire
from overlap.transport.host import HostTransport
from overlap.transport.streams import StreamTransport


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
    """The transport for `device`'s tensors over `group`, chosen once at wrap: CUDA tensors go
    through comm streams and events (`StreamTransport`), CPU tensors through gloo's threads and
    host waits (`HostTransport`). Raises ValueError for a setting the transport cannot honour."""
    semantics = backend.semantics(group, device)  # [Note: NCCL is not gloo] in backend.py
    kind = transport_class(device)
    return kind(group, device, semantics, timer, timeout, reduce_impl, gather_impl, replicate_group, secondary_group)


def transport_class(device: torch.device) -> type[Transport]:
    """The execution model of `device`'s tensors: comm streams and events, or host waits."""
    return StreamTransport if device.type == "cuda" else HostTransport


def check_settings(group: dist.ProcessGroup, device: torch.device, gather_impl: str) -> None:
    """Raise ValueError for a setting the transport of `device` cannot honour; `wrap` calls it
    before anything is sharded."""
    transport_class(device).check_settings(backend.semantics(group, device), gather_impl)


__all__ = ["HostTransport", "StreamTransport", "Transport", "UnitWire", "check_settings", "make_transport"]
