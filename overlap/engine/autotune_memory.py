"""What autotune may spend in memory: the peak it measures, the cap it keeps under, and what each
candidate move is predicted to add before it is tried.

[Note: autotune memory]
The cap is on what the device really holds, not on the library's own account: a keep or prefetch
move that fits the library's budget can still run a device out of memory once the activations
and the optimizer state are in. So:

- The peak is measured: on CUDA the caching allocator's `max_memory_allocated` (the library
  never resets it: a user's own peak measurement stays theirs); on CPU the process's peak
  resident set (VmHWM). Both are high-water marks since the process started, read on the host
  without a device sync.
- The limit is `OverlapConfig.autotune_memory_bytes` per rank, else MEMORY_FRACTION of the
  device's total memory (CPU: the host's physical RAM), shared evenly by the ranks on that
  device (or host); the rest is for what the allocator does not count (the CUDA context, NCCL's
  buffers, fragmentation).
- Both are read at the baseline decision, after WARMUP steps and a measured window: by then the
  optimizer has stepped (its state exists) and every buffer of a step has been allocated. Read
  at wrap, the peak would miss the optimizer state and the activations, and the headroom would
  be the whole device. The headroom is `limit - baseline peak` (the ranks' smallest).
- Each candidate move is priced before it is tried (`price_bytes`: the bytes the schedule holds
  at its peak under the new knobs minus under the old, from the units' sizes: units gathered
  ahead, units kept from forward to backward, reduce-scatter inputs alive at once); the model's
  proposals carry their own `extra_bytes` and the larger of the two counts. A move whose
  predicted peak (the baseline's, plus what the best knobs measured above it, plus the price)
  crosses the limit is never tried: it is logged as refused, with the bytes.
- A trial whose measured peak crossed the limit is reverted, as one whose step is not faster.
An out-of-memory error that still happens inside a trial: [Note: out of memory in a trial] in
engine/autotune_oom.py.
"""

from __future__ import annotations

import hashlib
import os
import resource
import socket
from dataclasses import dataclass, replace

import torch

from overlap.engine.autotune_policy import Knobs
from overlap.engine.schedule import Schedule, ScheduleConfig

MEMORY_FRACTION = 0.9
"""Of a device's total memory (CPU: the host's RAM), what its ranks' measured peaks may reach
together when `autotune_memory_bytes` is not set."""


@dataclass(frozen=True)
class MemoryBudget:
    """What autotune may spend, read at its baseline decision ([Note: autotune memory])."""

    limit_bytes: int
    """The cap on any rank's measured peak (the ranks' smallest)."""
    baseline_peak_bytes: int
    """The largest measured peak of any rank at the baseline, optimizer state included."""
    step: int
    """The training step it was read at."""

    @property
    def headroom_bytes(self) -> int:
        return self.limit_bytes - self.baseline_peak_bytes


def measured_peak_bytes(device: torch.device) -> int:
    """This process's memory high-water mark on `device`: CUDA's `max_memory_allocated`, on CPU
    the peak resident set. Host-side, no device sync."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return process_peak_rss_bytes()


def process_peak_rss_bytes() -> int:
    """The OS's high-water mark of this process's resident memory (VmHWM).

    [Note: ru_maxrss of a spawned rank] getrusage(RUSAGE_SELF).ru_maxrss also counts the image
    the process had before exec: a spawned child is forked from its launcher first, so it reports
    at least the launcher's RSS (measured: 834 MB in a child whose own peak was 15 MB). VmHWM is
    the high-water mark of the current image only. ru_maxrss is the fallback without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def device_total_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_key(device: torch.device) -> int:
    """Equal on the ranks that share this device's memory (CPU: the host); exact in a float64."""
    index = torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index
    name = f"{socket.gethostname()}/{device.type}:{index if device.type == 'cuda' else ''}"
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:6], "little")


def local_limit_bytes(configured: int | None, device: torch.device, num_sharing: int) -> int:
    """This rank's cap: the configured one, else its share of MEMORY_FRACTION of the device."""
    if configured is not None:
        return configured
    return int(MEMORY_FRACTION * device_total_bytes(device)) // max(1, num_sharing)


def held_bytes(schedule: Schedule, config: ScheduleConfig) -> int:
    """The most unsharded and reduce-input bytes the schedule holds at once under `config`
    (an upper bound from the units' sizes): the kept units, a window of `prefetch_depth + 2`
    consecutive units (the computing one, those prefetched, the one being reduced; within
    `max_inflight_allgather_bytes` plus the one needed now) and `max_reduce_inputs` of the largest bucket."""
    order = [u for u in schedule.forward_order or range(schedule.num_units) if u != schedule.root]
    sizes = [schedule.unit_bytes[u] for u in order]
    n = config.prefetch_depth + 2
    window = max((sum(sizes[i : i + n]) for i in range(max(1, len(sizes) - n + 1))), default=0)
    if config.max_inflight_allgather_bytes is not None:
        window = min(window, config.max_inflight_allgather_bytes + max(sizes, default=0))
    kept = schedule.choose_kept(config) if schedule.forward_order is not None else frozenset()
    kept_bytes = sum(schedule.unit_bytes[u] for u in kept)
    largest, size = 0, 0
    for unit in schedule.backward_units():
        size += schedule.grad_bytes[unit]
        largest = max(largest, size)
        if size >= config.reduce_scatter_bucket_bytes:
            size = 0
    return kept_bytes + window + config.max_reduce_inputs * largest


def price_bytes(schedule: Schedule, old: ScheduleConfig, new: ScheduleConfig) -> int:
    """What moving from `old` to `new` adds to the peak (negative: frees)."""
    return held_bytes(schedule, new) - held_bytes(schedule, old)


def knobs_config(base: ScheduleConfig, knobs: Knobs) -> ScheduleConfig:
    """`base` with the tuner's knobs set to `knobs`."""
    return replace(
        base,
        prefetch_depth=knobs.prefetch_depth,
        max_inflight_allgather_bytes=knobs.max_inflight_allgather_bytes,
        reduce_scatter_bucket_bytes=knobs.reduce_scatter_bucket_bytes,
        keep_for_backward_bytes=knobs.keep_for_backward_bytes,
        max_reduce_inputs=knobs.max_reduce_inputs,
    )
