"""What the collectives of a process group mean for one device: the one place that decides it.

[Note: NCCL is not gloo]
gloo and NCCL look alike through torch.distributed but behave differently where it matters:

- gloo runs a collective on its own worker threads; `Work.wait()` blocks the calling thread until
  the collective is done, `Work.wait(timeout)` bounds that wait, and the work's future completes
  when the data is there.
- NCCL (CUDA tensors) is stream-ordered: `Work.wait()` only makes the *current stream* wait, the
  future completes when the collective is *enqueued*, and `Work.wait(timeout)` blocks the CPU
  thread until the collective finishes — which cancels every overlap. NCCL hangs are bounded by
  the process group's timeout and the watchdog instead.

A process group may run several backends, one per device type: `dist.get_backend` then returns
"cpu:gloo,cuda:nccl", or "undefined" when `init_process_group()` was called without a backend
(torch then picks per device: gloo for CPU, NCCL for CUDA). Testing the string for "gloo" or
"nccl" gets both cases wrong, so everything that depends on the backend asks `semantics(group,
device)`, which decides per device type, here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_STREAM_ORDERED = frozenset({"nccl", "xccl"})


def backend_for(backend_string: str, device_type: str) -> str:
    """The backend that serves `device_type` in a group whose `dist.get_backend` is `backend_string`.

    "gloo" -> "gloo"; "cpu:gloo,cuda:nccl" + "cuda" -> "nccl"; "undefined" (no backend given
    to init_process_group) -> torch's default for the device type. Raises ValueError when the
    group has no backend for the device type."""
    text = str(backend_string).strip().lower()
    if text in ("", "undefined"):
        default = dist.Backend.default_device_backend_map.get(device_type)
        if default is None:
            raise ValueError(f"overlap: no default torch.distributed backend for device type {device_type!r}")
        return default
    if ":" not in text:
        return text
    pairs = dict(part.split(":", 1) for part in text.split(",") if ":" in part)
    if device_type not in pairs:
        raise ValueError(
            f"overlap: the process group's backends ({backend_string}) have none for {device_type} "
            f"tensors; initialize it with one, e.g. init_process_group('cpu:gloo,cuda:nccl')"
        )
    return pairs[device_type]


ALL_TO_ALL_GATHER_MAX_BYTES = 256 * 1024
"""`all_gather_impl="auto"` on gloo gathers shards up to this size through all-to-all
([Note: all-gather through all-to-all] in collectives.py)."""


@dataclass(frozen=True)
class CommSemantics:
    """How collectives over one group behave for tensors of one device type."""

    device_type: str
    backend: str
    stream_ordered: bool
    """Collectives and their waits are ordered by device streams (NCCL): `wait()` enqueues a stream
    wait, futures complete at enqueue, host-side timing of a collective means nothing."""

    @property
    def native_average(self) -> bool:
        """The backend's reduce-scatter and all-reduce take `ReduceOp.AVG` (NCCL does; gloo
        raises on it): a floating-point mean without a divide pass of our own."""
        return self.backend == "nccl" and self.device_type != "cpu"

    @property
    def wait_timeout_blocks_host(self) -> bool:
        """`Work.wait(timeout)` would block the CPU until the collective finishes: never pass one."""
        return self.stream_ordered

    @property
    def futures_complete_at_enqueue(self) -> bool:
        return self.stream_ordered

    @property
    def host_timing_valid(self) -> bool:
        """Whether wall time around a wait measures the collective (gloo) or only its enqueue."""
        return not self.stream_ordered

    @property
    def receive_first(self) -> bool:
        """An all-to-all goes as point-to-point messages, every receive posted before any send
        ([Note: receive before send] in pairwise.py): gloo with CPU tensors, whose own all-to-all
        can run the two directions of a link one after the other. Not gloo with CUDA tensors:
        gloo's point-to-point path hands the tensor's data pointer to its TCP pair as host memory
        and never synchronizes with the stream that writes it; its all-to-all (and all-gather)
        stage CUDA tensors through host copies in stream order."""
        return self.backend == "gloo" and self.device_type == "cpu"

    def auto_reduce_impl(self) -> str:
        """See [Note: reduce-scatter through all-to-all] in collectives.py: gloo's own reduce-scatter
        sends twice the bytes, so CPU tensors over gloo go through all-to-all."""
        return "all_to_all" if self.backend == "gloo" else "native"

    def auto_gather_impl(self, shard_bytes: int) -> str:
        """See [Note: all-gather through all-to-all] in collectives.py: small shards over gloo go
        through all-to-all, whose fixed cost per call is lower than gloo's all-gather's."""
        small = shard_bytes <= ALL_TO_ALL_GATHER_MAX_BYTES
        return "all_to_all" if self.backend == "gloo" and small else "native"


def wait_timeout(sem: CommSemantics, timeout: timedelta | None) -> timedelta | None:
    """The timeout to pass to `Work.wait`: `timeout` where the wait blocks the calling thread
    anyway (gloo), None where a timeout would make it block the host (NCCL)."""
    return None if sem.wait_timeout_blocks_host else timeout


def semantics_of(backend_string: str, device: torch.device) -> CommSemantics:
    """`CommSemantics` from a backend string (as `dist.get_backend` returns it) and a device."""
    backend = backend_for(backend_string, device.type)
    return CommSemantics(device.type, backend, backend in _STREAM_ORDERED and device.type != "cpu")


def semantics(group: dist.ProcessGroup | None, device: torch.device) -> CommSemantics:
    """`CommSemantics` of `group` (None: the default group) for tensors on `device`."""
    return semantics_of(str(dist.get_backend(group)), device)


def default_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a meta-device model is materialized when `wrap` is given no device: the current
    CUDA device when CUDA is available and the group runs a GPU backend for CUDA tensors (NCCL,
    given alone, per device, or chosen by torch for "undefined"), else the CPU (a gloo-only
    group trains on the CPU even on a machine with GPUs)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        cuda_backend = backend_for(str(dist.get_backend(group)), "cuda")
    except ValueError:
        return torch.device("cpu")
    if cuda_backend in _STREAM_ORDERED:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
