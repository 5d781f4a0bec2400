"""A symmetric-memory all-gather for CUDA tensors: a new transport in one file ([Note: the seam]
in strategy.py), as FSDP2's `SymmMemAllGather`.

The output of every all-gather is allocated from torch's symmetric-memory pool
(`torch.distributed._symmetric_memory`) and rendezvoused across the group, so that NCCL (2.27+)
runs its symmetric kernels or, with its zero-CTA policy, the copy engines: one-shot copies
between the GPUs' buffers that leave the SMs to compute. Which collective is called is
unchanged (the backend's all-gather); only where its output lives is. The reductions keep the
backend's own. Selected with `OverlapConfig.symmetric_memory=True` (CUDA over NCCL; off by
default; ignored with a warning elsewhere); `benchmarks/gpu_check.py` runs it on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from overlap.transport import collectives as comm
from overlap.transport.strategy import AllGather, Wire


class SymmMemAllGather(AllGather):
    """The backend's all-gather into an output in symmetric memory."""

    def __init__(self, symm_mem: Callable[[], Any], backend: str = "NCCL") -> None:
        # torch's symmetric-memory module, reached through the engine's torch_compat (a private
        # torch API: [Note: private torch APIs] there), called where it is used (CUDA builds)
        self._symm_mem = symm_mem
        self.backend = backend

    def plan(self, wire: Wire) -> None:
        super().plan(wire)
        self._symm_mem().set_backend(self.backend)
        # the communicator exists before the first rendezvous (an empty one would be seen)
        dist.barrier(group=wire.group)

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # the pool reuses symmetric buffers: no allocation or rendezvous cost after the first
        with torch.cuda.use_mem_pool(self._symm_mem().get_mem_pool(device)):
            return torch.empty(numel, dtype=dtype, device=device)

    def __call__(
        self,
        index: int,
        send: torch.Tensor,
        dtype: torch.dtype,
        tag: int | None,
        tag_slot: torch.Tensor | None,
        for_backward: bool,
    ) -> comm.CommResult:
        w = self.wire
        out = self.allocate(w.world_size * send.numel(), dtype, send.device)
        self._symm_mem().rendezvous(out, group=w.group.group_name)  # an in-place gather: the output only
        return comm.all_gather_flat(send, w.group, w.world_size, dtype, tag, tag_slot, "native", None, out=out)
