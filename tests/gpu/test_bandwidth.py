"""GB/s of every Triton kernel (and the torch reference) at 8M and 64M elements as a share of a
device-to-device fp32 copy, a compressed reduce-scatter's codec work on one 8-rank bucket (one
launch each against the per-row launches of before), the copies on the runtime's tagged layouts
of a GPT block at world size 2 and 8; each row written as soon as it is measured. CPU: a tiny
size, measured, no bar."""

from __future__ import annotations

import gc

import pytest
import torch

from .helpers.bandwidth import Bandwidth
from .helpers.report import PartRecord

pytestmark = pytest.mark.cuda
SHARE_BAR = 0.8


@pytest.mark.part("bandwidth")
def test_bandwidth(device: torch.device, record: PartRecord) -> None:
    cuda = device.type == "cuda"
    record.bar = f"every Triton row at the largest size >= {SHARE_BAR} of the device-to-device copy's GB/s"
    bench = Bandwidth(device, [8 << 20, 64 << 20] if cuda else [64 << 10], record.progress)
    for numel in bench.numels:
        bench.size(numel)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    measured = bench.measured
    fast_rows = [r for r in measured["rows"] if r["backend"] == "triton" and r["largest_size"]]
    measured["below_bar"] = [
        f"{r['op']}: {r['share_of_d2d_copy']}" for r in fast_rows if not r["share_of_d2d_copy"] >= SHARE_BAR
    ]
    record.progress(measured)
    if not cuda:
        record.unjudged("CUDA only")
        return
    assert fast_rows and not measured["below_bar"] and not measured["errors"], (
        measured["below_bar"],
        measured["errors"],
    )
