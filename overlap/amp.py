"""fp16 mixed precision: a gradient scaler for sharded gradients.

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is scaled up before
backward, and a scale that is too large overflows to inf. `torch.amp.GradScaler` scales the
loss, unscales the gradients before the optimizer, skips the step when it finds an inf or NaN
and adapts the scale. With overlap every rank holds only a shard of each gradient, so an
overflow is seen only by the rank whose shard holds it, and a step skipped on one rank but taken
on the others would leave the replicas of the optimizer state out of step for good.

Usage (fp32 master shards and optimizer state, fp16 all-gather, compute and gradients):

    model = overlap.wrap(model, param_dtype=torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scaler = overlap.ShardedGradScaler(model=model)     # device from the model ("cuda", "cpu")
    for batch in loader:
        loss = model(batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)                  # optional, before anything that reads gradients
        overlap.clip_grad_norm_(model, 1.0)   # clips the true (unscaled) gradients
        scaler.step(opt)                      # skipped on every rank if any rank found inf/NaN
        scaler.update()                       # the same new scale on every rank
        opt.zero_grad()

Gradients are reduce-scattered in `reduce_dtype`, which defaults to `param_dtype`. So that the
sum over N ranks of scaled fp16 gradients does not overflow where no single rank's gradient did,
each is divided by a power of two near sqrt(N) before the sum and the sum by the rest after, as
FSDP2 does ([Note: dividing the sum] in engine/reduction.py); an overflow left is caught as any
other (skip, halve the scale). bfloat16 has fp32's exponent range and needs no scaler.

[Note: found-inf across ranks]
`unscale_` unscales every gradient's local shard in place (one fused check-and-unscale per
device and dtype) and then makes one all-reduce (MAX) of the found-inf flag per process group of
the model (shard, replicate, tensor-parallel, in turn: the max over the whole job), on every
rank, whatever gradients it holds. `step` then skips on all ranks or on none, and `update` moves
the scale identically everywhere. torch's own GradScaler on DTensor gradients gets a found-inf
all-reduce from DTensor's dispatcher instead, one per (device, dtype) group of gradients that a
rank holds, over the first gradient's mesh: a rank without gradients of some dtype then skips a
collective the others make (a hang), and an optimizer mixing DTensor and plain gradients cannot
run the fused op at all.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from overlap.engine.lazy_torch import is_dtensor
from overlap.engine.state import state_of
from overlap.engine.verdict import job_groups


class ShardedGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` for models wrapped by `overlap.wrap` (see the module docstring).

    Arguments as `torch.amp.GradScaler`, plus:
      model: the wrapped model; the found-inf flag is reduced over its process groups (the
        shard group, the replicate group of a 2-D mesh and the tensor-parallel group), and
        `device` defaults to its device type.
      process_group: reduce over this group instead (e.g. several wrapped models in one
        optimizer). Default without `model`: the default (world) group.
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        model: nn.Module | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if model is not None and process_group is not None:
            raise ValueError("ShardedGradScaler: pass model or process_group, not both")
        groups: list[dist.ProcessGroup | None] = [process_group]
        if model is not None:
            state = state_of(model)
            # MAX over the shard, replicate and tensor-parallel groups in turn: the max over the
            # whole job ([Note: job-wide verdicts] in engine/verdict.py); the experts' state is
            # inside the model's, whose shard group spans all of dp ([Note: expert parallelism])
            groups = job_groups(state.group, state.replicate_group, state.tensor_group)
            if device is None:
                device = state.units[0].shard.device.type if state.units else "cpu"
        super().__init__(
            device or "cuda",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._found_inf_groups = groups

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale the local gradient shards in place; the found-inf flag, reduced across ranks.

        Overrides `GradScaler`'s hook (called by `unscale_`, and by `step` when `unscale_` was not
        called). fp16 gradients are allowed (`allow_fp16` is ignored): they are what fp16 master
        parameters have, and they are unscaled in fp16 as torch's FSDP scaler does.
        """
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for param_group in optimizer.param_groups:
                for param in param_group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if is_dtensor(grad):
                        grad = grad.to_local()  # this rank's shard, unscaled in place
                    if grad.is_sparse:
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()  # duplicates would sum past fp16
                        grad = grad._values()
                    by_device[grad.device][grad.dtype].append(grad)
            found_on: dict[torch.device, torch.Tensor] = {found_inf.device: found_inf}
            for device, by_dtype in by_device.items():
                if device not in found_on:
                    found_on[device] = torch.zeros_like(found_inf, device=device)
                scale_here = inv_scale.to(device)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_on[device], scale_here)
            # [Note: found-inf across ranks] one flag, one all-reduce per group, on every rank
            flag = found_inf.clone()
            for device, found in found_on.items():
                if device != found_inf.device:
                    flag += found.to(found_inf.device)
            for group in self._found_inf_groups:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            for found in found_on.values():
                found.copy_(flag)
        return found_on
