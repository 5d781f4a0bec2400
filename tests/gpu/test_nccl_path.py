"""World size 1 on NCCL (OVERLAP_FORCE_COLLECTIVES=1 makes it issue real collectives): the c10d
collectives per step under torch.profiler, and the NCCL kernels CUPTI saw. The dry run: gloo."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from .helpers.common import STEPS, Sizes, make_input, synchronize, train_step, wrapped
from .helpers.report import PartRecord

pytestmark = pytest.mark.cuda


@pytest.mark.part("nccl_path")
@pytest.mark.usefixtures("world1")
def test_nccl_path(device: torch.device, sizes: Sizes, record: PartRecord) -> None:
    record.bar = "> 0 c10d collectives issued per step (CUDA: on nccl, and NCCL kernels if CUPTI sees kernels)"
    cuda = device.type == "cuda"
    model, opt = wrapped(sizes, device)
    x = make_input(sizes, device)
    for _ in range(2):  # step 1 records the unit order
        train_step(model, opt, x)
    synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(STEPS):
            train_step(model, opt, x)
        synchronize(device)
    events = prof.events()
    issued = Counter(e.name for e in events if e.name.startswith("c10d::") and "barrier" not in e.name)
    ran = Counter(e.name for e in events if e.name.startswith(("nccl:", "gloo:")))
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl_kernels = Counter(e.name.split("(")[0] for e in kernels if "nccl" in e.name.lower())
    backend = str(dist.get_backend())
    per_step = sum(issued.values()) / STEPS
    record.progress({"backend": backend, "OVERLAP_FORCE_COLLECTIVES": os.environ.get("OVERLAP_FORCE_COLLECTIVES"),
                     "collectives_per_step": per_step, "issued": dict(issued), "backend_events": dict(ran),
                     "num_kernel_events": len(kernels), "nccl_kernels": dict(nccl_kernels)})  # fmt: skip
    assert per_step > 0, "no collective issued at world size 1"
    if cuda:
        assert backend == "nccl", backend
        if kernels:  # CUPTI works here: the collectives must show as NCCL kernels too
            assert sum(nccl_kernels.values()) > 0, "CUPTI saw kernels but no NCCL kernel"
