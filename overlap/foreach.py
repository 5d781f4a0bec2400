"""On CPU, optimizers over overlap's fp32 sharded parameters step them with their foreach kernels.

[Note: foreach on CPU]
The optimizer sees overlap's parameters as DTensors (the API contract, as FSDP2's). Every
tensor op on a DTensor goes through DTensor's Python dispatch, ~20-40 µs on two CPU cores, and
torch's single-tensor optimizers issue about ten ops per parameter and step: on the 4-block GPT
of `overlap bench step`, AdamW's step over the half-size shards costs 21 ms against 15 ms for
DDP's full plain tensors. torch picks the foreach implementation by itself for tensors on CUDA
(DTensor included: `torch.optim.optimizer._foreach_supported_types`), where it dispatches once per
op and list, but never on CPU, where for plain tensors it gains nothing. For DTensors it does:
8 ms for the same step. So the first `step()` of an SGD, Adam or AdamW whose parameter group
left `foreach` unset (None) and holds only overlap's fp32 CPU parameters, at most
`FOREACH_MAX_GROUP_BYTES` of local shards, sets `foreach=True` for that group. The cap: foreach
allocates temporaries as large as the group's shards (AdamW's denominator), which for a large
model would raise the peak past what the single-tensor step holds (one parameter's worth), and
there the dispatch cost is small beside the arithmetic anyway. On CPU these three optimizers give the same bits either way for fp32
(tests/test_foreach.py checks it on every run, so a torch release that changed it would be
caught); in bf16 and fp16 they do not (SGD with momentum, Adam in fp16), so those groups keep
the single-tensor step. An explicit `foreach=False` is left alone, as are other optimizers,
mixed groups and `fused`. A global step
pre-hook does it (step_hooks.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from overlap.step_hooks import StepCheck

_ours: WeakIdKeyDictionary = WeakIdKeyDictionary()  # overlap's sharded fp32 CPU parameters
FOREACH_MAX_GROUP_BYTES = 16 << 20
"""Largest parameter group (bytes of local shards) switched to foreach: its temporaries stay small."""
BITWISE_FOREACH = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose foreach and single-tensor steps agree bitwise on CPU for fp32 (tests/test_foreach.py)."""


def register_sharded(params: Iterable[torch.Tensor]) -> None:
    """Record `wrap`'s sharded fp32 parameters that live on the CPU; installs the step hook once."""
    for param in params:
        if param.device.type == "cpu" and param.dtype == torch.float32:
            _ours[param] = True
    _hook.registered()


def _prefer_foreach(optimizer: torch.optim.Optimizer) -> None:
    if type(optimizer) not in BITWISE_FOREACH:
        return
    for group in optimizer.param_groups:
        params = group["params"]
        unset = group.get("foreach", False) is None and not group.get("fused") and not group.get("differentiable")
        if unset and params and all(p in _ours for p in params) and _local_bytes(params) <= FOREACH_MAX_GROUP_BYTES:
            group["foreach"] = True


def _local_bytes(params: list[torch.Tensor]) -> int:
    return sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in params)


_hook = StepCheck(_prefer_foreach)
