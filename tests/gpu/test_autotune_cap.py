"""Autotune within its memory cap, at world size 1 with AdamW: the peak of 3 steps without autotune
(optimizer state included), then AUTOTUNE_STEPS steps with `autotune=True` and
`autotune_memory_bytes` that peak plus half a layer (CPU, whose peak RSS is noisier: 64 MiB), so
that keeping or prefetching one more layer would cross it."""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any

import pytest
import torch

import overlap

from .helpers.common import Sizes, build_plain, make_input, synchronize, train_step
from .helpers.internals import measured_peak_bytes
from .helpers.report import PartRecord

pytestmark = pytest.mark.cuda
AUTOTUNE_STEPS = 20  # the baseline decision at step 10 on CUDA (6 on CPU), then a first trial


@pytest.mark.part("autotune")
@pytest.mark.usefixtures("world1")
def test_autotune(device: torch.device, sizes: Sizes, record: PartRecord) -> None:
    record.bar = ("a baseline decision taken, the tuner's limit the cap given, and the measured peak (CUDA: "
                  "max_memory_allocated; CPU: peak RSS) <= that cap after its trials")  # fmt: skip
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    x = make_input(sizes, device)
    untuned = overlap.wrap(build_plain(sizes, device))
    opt = torch.optim.AdamW(untuned.parameters(), lr=1e-4)  # state the cap must hold
    for _ in range(3):
        train_step(untuned, opt, x)
    synchronize(device)
    layer_bytes = sum(p.numel() * p.element_size() for p in next(iter(untuned.children())).parameters())
    untuned_peak = measured_peak_bytes(device)
    del untuned, opt
    gc.collect()  # the untuned model's memory back before the tuned one allocates
    cap = untuned_peak + (layer_bytes // 2 + (1 << 20) if cuda else 64 << 20)
    model = overlap.wrap(build_plain(sizes, device), autotune=True, autotune_memory_bytes=cap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(AUTOTUNE_STEPS):
        train_step(model, opt, x)
    synchronize(device)
    tuner = model._overlap_state.autotuner
    peak = measured_peak_bytes(device)
    decisions = [{k: str(v)[:200] for k, v in vars(d).items()} for d in tuner.policy.decisions]
    measured: dict[str, Any] = {
        "steps": AUTOTUNE_STEPS, "cap_bytes": cap, "untuned_peak_bytes": untuned_peak, "layer_bytes": layer_bytes,
        "peak_bytes": peak, "decisions": decisions[-10:], "actions": dict(Counter(d["action"] for d in decisions)),
    }  # fmt: skip
    record.progress(measured)
    budget = tuner.memory
    assert budget is not None, "the tuner took no memory budget"
    measured.update(
        limit_bytes=budget.limit_bytes, baseline_peak_bytes=budget.baseline_peak_bytes, budget_step=budget.step
    )
    record.progress(measured)
    assert any(d["action"] == "baseline" for d in decisions), measured["actions"]
    assert budget.limit_bytes == cap, (budget.limit_bytes, cap)
    assert peak <= cap, f"peak {peak} over the cap {cap}"
