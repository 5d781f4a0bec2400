"""Measured trials and the two collectives of a decision: timings in to rank 0, decision out.

[Note: rank 0 decides]
Every rank times its own steps, and the clocks disagree: one rank waits in a collective while its
peer computes, a rank shares its core with a noisy neighbour. If every rank ranked candidates by
its own timings, two ranks could keep different survivors, build different models and deadlock in
mismatched collectives. So the timings of a round travel to rank 0 (`gather_to_rank0`), rank 0
alone scores and ranks them, and the decision (survivors, scores) is broadcast
(`broadcast_from_rank0`); every other rank acts only on what it received. The same goes for the
pruned candidate list (it depends on rank 0's profile) and for a cache hit (rank 0's file
system). "Rank 0" is rank 0 of the tuning group.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from overlap.config import OverlapConfig
from overlap.tools.tune.predict import OptimizerFn, StepFn
from overlap.transport.backend import default_device

TrialFn = Callable[[OverlapConfig, int], list[float]]
"""`trial(config, num_steps)`: build, wrap and warm up a model under `config`, time `num_steps`
training steps; this rank's step times in seconds. Every rank calls it with the same arguments."""

T = TypeVar("T")


def process_group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError("overlap.tune: only a 1-D DeviceMesh (or a ProcessGroup) is supported")
        return group.get_group()
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError(
            "overlap.tune needs torch.distributed: call dist.init_process_group first "
            "(or launch with torchrun / overlap.launch.run_local_world)"
        )
    return pg


def _object_device(pg: dist.ProcessGroup) -> torch.device | None:
    """The device object collectives stage through: the current GPU on NCCL, else the CPU."""
    device = default_device(pg)  # [Note: NCCL is not gloo] in backend.py
    return device if device.type == "cuda" else None


def gather_to_rank0(value: T, pg: dist.ProcessGroup) -> list[T] | None:
    """Every rank's `value`, in rank order, on rank 0 of `pg`; None on the others."""
    out: list[Any] | None = [None] * pg.size() if pg.rank() == 0 else None
    dist.gather_object(value, out, group=pg, group_dst=0)
    return out


def broadcast_from_rank0(value: T | None, pg: dist.ProcessGroup) -> T:
    """Rank 0's `value` on every rank (the others pass None). See [Note: rank 0 decides]."""
    box: list[Any] = [value]
    dist.broadcast_object_list(box, group=pg, group_src=0, device=_object_device(pg))
    return box[0]


def check_same_on_all_ranks(value: str, what: str, pg: dist.ProcessGroup) -> None:
    """Raise on every rank (not only the odd one: a lone raise would hang its peers) unless all
    ranks hold the same `value`."""
    values: list[Any] = [None] * pg.size()
    dist.all_gather_object(values, value, group=pg)
    if len(set(values)) != 1:
        raise ValueError(
            f"overlap.tune: ranks disagree on the {what} ({values}); every rank must tune the "
            "same model with the same space and options"
        )


def _sync(model: nn.Module) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MeasuredTrial:
    """The real trial: a fresh `model_fn()` wrapped under the candidate config, `warmup_steps`
    untimed steps (the first step records the unit order and allocates), then timed steps, each
    started together after a barrier.

    With `keep_models`, a candidate's model and optimizer stay alive after its trial, so its next
    trial (a survivor in the next round) only runs the timed steps; `retain` releases the models
    of the candidates that did not survive. Otherwise each trial builds its model and releases it
    before returning (one model in memory at a time).
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        step_fn: StepFn,
        optimizer_fn: OptimizerFn,
        pg: dist.ProcessGroup,
        group: dist.ProcessGroup | DeviceMesh | None,
        warmup_steps: int,
        keep_models: bool = False,
    ) -> None:
        self.model_fn, self.step_fn, self.optimizer_fn = model_fn, step_fn, optimizer_fn
        self.pg, self.group = pg, group
        self.warmup_steps = warmup_steps
        self.keep_models = keep_models
        self._live: dict[OverlapConfig, tuple[nn.Module, torch.optim.Optimizer]] = {}
        self.num_builds = 0

    def _build(self, config: OverlapConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
        import overlap

        self.num_builds += 1
        model = overlap.wrap(self.model_fn(), group=self.group, config=config)
        opt = self.optimizer_fn(model.parameters())
        for _ in range(self.warmup_steps):
            self.step_fn(model, opt)
        return model, opt

    def __call__(self, config: OverlapConfig, num_steps: int) -> list[float]:
        live = self._live.pop(config, None)
        model, opt = live if live is not None else self._build(config)
        times = []
        for _ in range(num_steps):
            _sync(model)
            dist.barrier(group=self.pg)
            t0 = time.perf_counter()
            self.step_fn(model, opt)
            _sync(model)
            times.append(time.perf_counter() - t0)
        if self.keep_models:
            self._live[config] = (model, opt)
        else:
            del model, opt, live
            gc.collect()  # wrapped models hold reference cycles (hooks): free them now
        return times

    def retain(self, configs: Collection[OverlapConfig]) -> None:
        """Release every kept model except those of `configs`."""
        for config in [c for c in self._live if c not in configs]:
            del self._live[config]
        gc.collect()

    def close(self) -> None:
        self.retain(())
