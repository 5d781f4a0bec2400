"""Scalar (0-dim) parameters: kept whole on every rank, their gradients averaged as DDP does.

[Note: replicated parameters]
A 0-dim parameter (CLIP's and SigLIP's `logit_scale`, a learned temperature or gate) has no dim 0
to shard. It stays an ordinary parameter of its module, whole on every rank and outside every
unit: forward uses it as it is, the optimizer finds it in `model.parameters()`, state dicts hold
it as a plain tensor (DCP saves it once, as any replicated value; `overlap.full_state_dict` and
`load_full_state_dict` copy it as they copy buffers). `wrap` leaves such parameters out of the
units (`params_by_unit_module` in sharding.py) and `ReplicatedParams`:
- broadcasts their values from rank 0 at wrap (DDP's promise: every rank starts from rank 0's);
- at the end of every backward that syncs gradients (not inside `no_sync`), sums the gradients of
  all of them in one all-reduce over every rank of the model (with HSDP: the whole mesh) and
  divides by the number of ranks, which is DDP's average (bitwise at world size 2, where
  (a + b) / 2 == a / 2 + b / 2). `OverlapState._end_backward` calls `reduce` after the units'
  reductions, so the collective has the same place in the sequence on every rank.
A gradient this rank did not produce counts as zeros; a parameter no rank produced one for keeps
`.grad` None, as under DDP with `find_unused_parameters=True` (a used flag per parameter rides in
the same all-reduce, as in [Note: used flags] in reduction.py). Their values are not cast to
`param_dtype`. Gradient clipping must count them once, not once per rank: see
`ReplicatedParams.holds`.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from overlap.observe.stats import StatsRecorder
from overlap.transport import collectives as comm


def is_replicated(param: torch.Tensor) -> bool:
    """Whether `wrap` keeps `param` whole on every rank instead of sharding it."""
    return param.dim() == 0


class ReplicatedParams:
    """The model's replicated parameters and their end-of-backward all-reduce."""

    def __init__(
        self, model: nn.Module, group: dist.ProcessGroup, timeout: timedelta | None, stats: StatsRecorder | None = None
    ) -> None:
        self.group = group  # every rank of the model: gradients are averaged over all of them
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = timeout
        self.stats = stats
        named = [(n, p) for n, p in model.named_parameters() if is_replicated(p)]  # ties: once
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._ids = {id(p) for p in self.params}
        self._flags: dict[tuple[tuple[bool, ...], torch.dtype], torch.Tensor] = {}
        self._broadcast_from_rank0()

    def holds(self, param: torch.Tensor) -> bool:
        """Whether `param` is one of the replicated parameters (whole on every rank)."""
        return id(param) in self._ids

    def _by_dtype(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """`params` grouped by dtype, groups in first-appearance order (the same on every rank)."""
        groups: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            groups.setdefault(p.dtype, []).append(p)
        return list(groups.values())

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        if self.num_ranks == 1:
            return
        src = dist.get_global_rank(self.group, 0)
        for params in self._by_dtype(self.params):
            values = torch.stack([p.detach() for p in params])
            self._wait(comm.CommResult(values, dist.broadcast(values, src, self.group, async_op=True), ()))
            for p, value in zip(params, values):
                p.copy_(value)

    @torch.no_grad()
    def reduce(self, sync: bool) -> None:
        """End of backward: average the trainable replicated parameters' gradients over every
        rank (one all-reduce per dtype, usually one in all). Nothing when `sync` is False
        (inside `no_sync`: the gradients accumulate locally and the next synced backward
        averages the sum, as DDP does)."""
        if not sync:
            return
        trainable = [p for p in self.params if p.requires_grad]
        for params in self._by_dtype(trainable):
            with record_function("overlap::all_reduce replicated"):
                self._reduce(params)

    def _reduce(self, params: list[nn.Parameter]) -> None:
        num = len(params)
        used = tuple(p.grad is not None for p in params)
        zero = torch.zeros((), dtype=params[0].dtype, device=params[0].device)
        grads = [p.grad.reshape(()) if p.grad is not None else zero for p in params]
        buffer = torch.cat([torch.stack(grads), self._flags_for(used, zero)])
        self._wait(comm.all_reduce_flat(buffer, self.group))
        if self.stats is not None:
            self.stats.record_issue("all_reduce", buffer.numel() * buffer.element_size())
        averaged = buffer[:num].div_(self.num_ranks)
        # The counts are read back (a device sync on CUDA) only when this rank left a gradient
        # out; otherwise every count is >= 1.
        # at most once per step (end of backward), and only when this rank left a gradient out
        counts = [1.0] * num if all(used) else buffer[num:].tolist()
        for p, value, count in zip(params, averaged, counts):
            if count == 0:
                continue  # no rank produced a gradient: .grad stays None
            if p.grad is None:
                p.grad = value.clone()
            else:
                p.grad.copy_(value)

    def _flags_for(self, used: tuple[bool, ...], like: torch.Tensor) -> torch.Tensor:
        """Used flags for a pattern, built from host data once and cached on the device."""
        key = (used, like.dtype)
        flags = self._flags.get(key)
        if flags is None:
            flags = self._flags[key] = torch.tensor(used, dtype=like.dtype).to(like.device)
        return flags

    def _wait(self, result: comm.CommResult) -> None:
        """See [Note: collective failures] in transport/results.py."""
        try:
            comm.wait(result, self.timeout)
        except comm.CollectiveError as e:
            raise comm.CollectiveError(
                f"overlap: rank {self.rank}: the all-reduce of the replicated parameters ({', '.join(self.names)}) {e}"
            ) from e
