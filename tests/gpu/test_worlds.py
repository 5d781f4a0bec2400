"""Worlds of ranks spawned on the one GPU over gloo with CUDA tensors, so the runtime's streams and
events move real data between ranks (gloo's CUDA work copies on its own streams); the dry run
spawns them with CPU tensors and `time.sleep` delays.

  world2   2 ranks with reduce_scatter_impl / all_gather_impl "native" (the NCCL-shaped path:
           tags, the tagged copy-out, the CUDA fingerprint branch, division, used flags). The
           model has a parameter only rank 0 uses (used flags that differ by rank, read back on
           the host) and one no rank uses. Configs: plain fp32, bf16 params with no_sync
           micro-batches, int8 gradients + error feedback, int8 params (the encoded exchanges:
           all-to-all), fp16 with the ShardedGradScaler and an overflow in one rank's shard
           ([Note: one shard overflows] in helpers/common.py: every rank skips the step, the
           same scale everywhere); SGD. Each config runs twice, the second time with delays
           injected ([Note: injected delays] in helpers/delays.py); bar: the two runs bitwise
           equal on every rank, delays were injected, and plain fp32 bitwise equal to a
           one-process reference (both ranks' half-batches on the unsharded model, gradients
           summed in rank order and divided by 2, SGD). A probe first runs gloo's native
           reduce-scatter and all-gather on the device's tensors; one gloo refuses is replaced by
           "all_to_all" for every config, and the refusal is recorded (`probe`). Rank 0 records
           the copies the runtime issued in its first plain step with their Triton launch
           variants (`copy_plans`), and whether their row strides are the ones
           runtime_copy_out_layout / runtime_copy_in_layout give (`layout_mirror`: numerics and
           bandwidth use those).
  hsdp2x2  the same on 4 ranks as a 2x2 mesh (replicate x shard): the all-reduce stream too; the
           reference sums (g0 + g1) + (g2 + g3) and divides by 4, as the shard pairs and the
           all-reduce do.
  world3   3 ranks (a middle rank in every all-to-all, a non-power-of-two average): plain, int8
           gradients + error feedback, fp16 with the scaler; plain within fp32 rounding of the
           reference (the backend's summation order is not the reference's).
  tp2x2    dp x tp against one process (helpers/world_tp.py): the delayed run bitwise equal to
           the plain one, the same scale on every rank (and a step skipped where the overflow
           is), fp32 within fp32 rounding of the reference (rowwise partial sums reorder a sum).
  memory   no run of its own: per rank of each world config, the allocator's peak during the
           steps above what the rank held after wrap, against what is accounted for it:
           overlap.memory_stats' peak (the library's buffers) plus what a step of the unwrapped
           model allocates (activations and full gradients). Bar (CUDA): no rank above that.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .helpers.report import PartRecord
from .helpers.world_dp import BAR, WORLD3_CONFIGS, WORLD_CONFIGS, measure_world
from .helpers.world_tp import TP_CONFIGS, measure_tp

pytestmark = [pytest.mark.cuda, pytest.mark.slow]
MEMORY_SLACK_BYTES = 2 << 20  # the allocator's rounding and small tensors nothing accounts


def check_world(device: torch.device, record: PartRecord, world_results: dict[str, Any], part: str, nproc: int,
                hsdp: bool, configs: dict[str, dict[str, Any]]) -> None:  # fmt: skip
    record.bar = BAR
    measured = measure_world(device, nproc, hsdp, configs, record.progress)
    world_results[part] = measured
    failed = [name for name in configs if not measured["configs"].get(name, {}).get("ok", False)]
    assert not failed, f"configs that missed the bar: {failed}"


@pytest.mark.part("world2")
def test_world2(device: torch.device, record: PartRecord, world_results: dict[str, Any]) -> None:
    check_world(device, record, world_results, "world2", 2, False, WORLD_CONFIGS)


@pytest.mark.part("hsdp2x2")
def test_hsdp2x2(device: torch.device, record: PartRecord, world_results: dict[str, Any]) -> None:
    check_world(device, record, world_results, "hsdp2x2", 4, True, WORLD_CONFIGS)


@pytest.mark.part("world3")
def test_world3(device: torch.device, record: PartRecord, world_results: dict[str, Any]) -> None:
    check_world(device, record, world_results, "world3", 3, False, WORLD3_CONFIGS)


@pytest.mark.part("tp2x2")
def test_tp2x2(device: torch.device, record: PartRecord) -> None:
    record.bar = ("every config on every rank: the delayed run bitwise equal to the plain run, delays injected, "
                  "the same scale on every rank; fp32 within fp32 rounding of the one-process reference")  # fmt: skip
    measured = measure_tp(device, record.progress)
    failed = [name for name in TP_CONFIGS if not measured["configs"].get(name, {}).get("ok", False)]
    assert not failed, f"configs that missed the bar: {failed}"


def memory_rows(world_results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world, config and rank: what the allocator saw against what is accounted."""
    rows = []
    for world, measured in world_results.items():
        plain_step = measured.get("plain_step", {})
        for name, config in (measured.get("configs") or {}).items():
            for rank, r in config.get("ranks", {}).items():
                m = r.get("memory")
                if not m:
                    continue
                row = {
                    "world": world,
                    "config": name,
                    "rank": rank,
                    **{k: v for k, v in m.items() if k != "library_peak"},
                }
                if "steps_peak_bytes" in m and plain_step:
                    used = m["steps_peak_bytes"] - m["after_wrap_bytes"]
                    accounted = m["library_peak_bytes"] - m["sharded_param_bytes"] + plain_step["step_peak_bytes"]
                    row.update(steps_bytes=used, accounted_bytes=accounted, over_bytes=max(0, used - accounted))
                rows.append(row)
    return rows


@pytest.mark.part("memory")
def test_memory(device: torch.device, record: PartRecord, world_results: dict[str, Any]) -> None:
    rows = memory_rows(world_results)
    record.progress({"rows": rows, "slack_bytes": MEMORY_SLACK_BYTES})
    if not rows:
        pytest.skip("no world part ran")
    record.bar = ("per rank and config: the allocator's peak during the steps above what the rank held after wrap <= "
                  "the library's accounted peak + one unwrapped step's activations and gradients + slack")  # fmt: skip
    if device.type != "cuda":
        record.unjudged("CUDA only")
        return
    judged = [r for r in rows if "over_bytes" in r]
    over = [r for r in judged if r["over_bytes"] > MEMORY_SLACK_BYTES]
    assert judged and not over, f"ranks over their accounted memory: {over[:4]}"
