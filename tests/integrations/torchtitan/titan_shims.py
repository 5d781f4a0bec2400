"""What torchtitan 0.3 needs to train on a CPU with gloo, installed by each rank before it imports
torchtitan. None of this is overlap's: a GPU run of torchtitan needs none of it (the attention
swap aside, which only keeps both implementations on the same attention). Every shim is applied
to FSDP2's runs and overlap's alike.

- Device selection: torchtitan picks `_get_available_device_type() or "cuda"` at import, so on a
  machine without an accelerator its Trainer calls `torch.cuda.set_device`; "cpu" is returned
  instead, and `torch.cpu` gets what torchtitan's memory monitor and barriers call on the device
  module (peak RSS stands in for the allocator's peak).
- `torch.distributed.set_timeout` (called after step 1) is torch 2.13's `_set_pg_timeout`.
- Attention: FlexAttention has no backward on CPU, varlen is CUDA-only and torchtitan refuses SDPA
  for language models, so each layer's inner attention is swapped to SDPA in the model config, as
  torchtitan's own graph_trainer tests do (`build_decoder_config_for_backend`).
- Pipeline schedules: torchtitan 0.3 hands `step` micro-batches already split (`arg_mbs`,
  `kwarg_mbs`, `target_mbs`), a torch nightly's API; torch 2.13 takes them in
  `_step_microbatches`, which `step` calls after its per-step stage setup, done here the same way.
- FSDP2 on gloo: torchtitan sets the gradient divide factor to 1, which FSDP2 reduces with
  PREMUL_SUM (not in gloo); forcing sum reduction (`set_force_sum_reduction_for_comms`) is what
  torchtitan itself does with symmetric memory.
"""

from __future__ import annotations

import resource
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _memory_stats(device: Any = None) -> dict[str, int]:
    peak = peak_rss_bytes()
    return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0, "num_ooms": 0}


def install_device() -> None:
    """Before torchtitan is imported: the CPU is its device."""
    if "torchtitan" in sys.modules:
        raise RuntimeError("shims.install_device() must run before torchtitan is imported")
    torch._utils._get_available_device_type = lambda: "cpu"
    cpu = torch.cpu
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: SimpleNamespace(total_memory=64 * 2**30)
    cpu.memory_stats = _memory_stats
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    cpu.current_device = lambda: 0  # torch.cpu's is the string "cpu"; barrier(device_ids=[...]) wants an int
    if not hasattr(dist, "set_timeout"):
        from torch.distributed import distributed_c10d

        dist.set_timeout = lambda timeout, group=None: distributed_c10d._set_pg_timeout(timeout, group)


def install_fsdp_sum() -> None:
    """FSDP2 on gloo under torchtitan's divide factor 1: reduce by sum."""
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule

    original = titan_fsdp.disable_fsdp_gradient_division
    if getattr(original, "_cpu_shim", False):
        return

    def disable_division_and_sum(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    disable_division_and_sum._cpu_shim = True  # type: ignore[attr-defined]
    titan_fsdp.disable_fsdp_gradient_division = disable_division_and_sum


def install_pipeline_step() -> None:
    """torch 2.13's multi-stage `step` with torchtitan 0.3's pre-split micro-batches."""
    from torch.distributed.pipelining import schedules

    original = schedules.PipelineScheduleMulti.step
    if getattr(original, "_cpu_shim", False):
        return

    def step(
        self: Any,
        *args: Any,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        losses: Any = None,
        return_outputs: bool = True,
        loss_kwargs: Any = None,
        **kwargs: Any,
    ) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return original(
                self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kwargs
            )
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        return None

    step._cpu_shim = True  # type: ignore[attr-defined]
    schedules.PipelineScheduleMulti.step = step


def use_sdpa(model_config: Any) -> Any:
    """Each layer's inner attention as SDPA (a model config built with the flex backend)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return model_config
