"""Values of a small device tensor for the host, without a device-wide sync.

`tensor.tolist()` on a CUDA tensor waits for everything queued on the current stream, and
`torch.cuda.set_sync_debug_mode` counts it. A `HostRead` instead enqueues, where the tensor is
produced, one non-blocking copy into pinned memory and an event; `values()` waits for that event
alone (the used counts of a reduction: enqueued right behind it and read as late as the end of
backward allows, [Note: used counts] in engine/reduction.py).
CPU tensors are read at `values()`, after whatever the caller waited for since (an all-reduce
still in flight on a gloo thread, say).
"""

from __future__ import annotations

import torch


class HostRead:
    """The values of `tensor` as of `stream`'s position now (CUDA), or as of `values()` (CPU)."""

    __slots__ = ("_event", "_pinned", "_tensor")

    def __init__(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        self._tensor: torch.Tensor | None = tensor
        self._pinned: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            stream = stream or torch.cuda.current_stream(tensor.device)
            self._pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                self._pinned.copy_(tensor, non_blocking=True)
                self._event = stream.record_event()
            self._tensor = None  # the copy is ordered on the stream that made it: no reference needed

    def values(self) -> list:
        if self._tensor is not None:
            return self._tensor.tolist()
        assert self._pinned is not None and self._event is not None
        self._event.synchronize()  # this copy only, not the device
        return self._pinned.tolist()
