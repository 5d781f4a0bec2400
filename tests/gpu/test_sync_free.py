"""Steps 2-3 under torch.cuda.set_sync_debug_mode("warn") for plain, strict ZeRO-3, bucketed,
int8 + error feedback and int8 params; also counts and times torch.cuda.Event.synchronize, which
sync debug mode does not see. CUDA only."""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from .helpers.common import Sizes, make_input, synchronize, train_step, wrapped
from .helpers.delays import counted_event_waits
from .helpers.report import PartRecord

pytestmark = pytest.mark.cuda


def sync_warnings(sizes: Sizes, device: torch.device, overrides: dict[str, Any]) -> dict[str, Any]:
    model, opt = wrapped(sizes, device, **overrides)
    x = make_input(sizes, device)
    train_step(model, opt, x)  # step 1: allowed to sync (order recording, first allocations)
    synchronize(device)
    waits: list[float] = []
    with warnings.catch_warnings(record=True) as caught, counted_event_waits(waits):
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(2):
                train_step(model, opt, x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    synchronize(device)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    where = Counter(f"{Path(w.filename).as_posix().split('site-packages/')[-1]}:{w.lineno}" for w in syncs)
    return {"sync_warnings": len(syncs), "in_overlap": sum(n for k, n in where.items() if "overlap/" in k),
            "where": dict(where.most_common(12)), "event_synchronize_calls": len(waits),
            "event_synchronize_ms": round(sum(waits), 3)}  # fmt: skip


@pytest.mark.part("sync_free")
@pytest.mark.usefixtures("world1")
def test_sync_free(device: torch.device, sizes: Sizes, record: PartRecord) -> None:
    record.bar = "0 sync warnings in steps 2-3, per config (Event.synchronize calls reported, not held to a bar)"
    layer_bytes = sum(p.numel() for p in nn.TransformerEncoderLayer(sizes.d, sizes.heads, sizes.ff).parameters()) * 4
    configs = {
        "plain": {},
        "strict-zero3": {"keep_for_backward_bytes": 0},  # backward gathers too
        "bucketed": {"reduce_scatter_bucket_bytes": 3 * layer_bytes},
        "int8+ef": {"grad_compression": "int8", "error_feedback": True},  # encodes nothing at ws=1 (own row)
        "int8-params": {"param_compression": "int8"},  # encodes and decodes every gather at ws=1
    }
    measured: dict[str, Any] = {}
    for name, overrides in configs.items():
        try:
            measured[name] = {"overrides": overrides, **sync_warnings(sizes, device, overrides)}
        except Exception:
            measured[name] = {"overrides": overrides, "error": traceback.format_exc()[-3000:]}
        record.progress(measured)
    syncing = {
        name: m.get("sync_warnings", m.get("error", "")[-300:])
        for name, m in measured.items()
        if m.get("sync_warnings") != 0
    }
    assert not syncing, f"configs that synchronized the host in steps 2-3: {syncing}"
