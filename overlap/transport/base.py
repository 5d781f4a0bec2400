"""The transport the runtime drives: one executor and three collective strategies.

The runtime decides *what* moves and when (the schedule's actions: which unit, which bucket, in
which order); a transport decides *how* ([Note: the seam] in strategy.py): its executor where the
work after a collective runs, its strategies which collective moves the bytes and where they
live. One is chosen once at wrap by `make_transport` (transport/__init__.py) from the device,
the group's backend ([Note: NCCL is not gloo] in backend.py) and where its ranks live. A setting
a transport cannot honour raises ValueError at wrap, naming it.

A new transport is a strategy in one file (symm_mem.py is the example, about forty lines): an
`AllGather` whose `allocate` places the output and whose call issues the collective. It is
chosen in `make_transport`, or set on a wrapped model before its first step with
`set_custom_all_gather` (tests inject stand-in executors the same way, `set_executor`).
"""

from __future__ import annotations

import dataclasses
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from overlap.transport import backend
from overlap.transport import collectives as comm
from overlap.transport.executor import Executor
from overlap.transport.fingerprint import FingerprintCheck
from overlap.transport.strategy import AllGather, AllReduce, ReduceScatter, UnitWire, Wire


def honoured_timeout(semantics: backend.CommSemantics, timeout: timedelta | None) -> timedelta | None:
    """The timeout the transport's waits pass on (`backend.wait_timeout`); warns, once per wrap,
    when `OverlapConfig.collective_timeout_s` is set where it cannot be honoured. [Note: NCCL is
    not gloo]: on NCCL a timeout would make every wait block the CPU, so its hangs are bounded by
    the process group's timeout and its watchdog instead."""
    honoured = backend.wait_timeout(semantics, timeout)
    if timeout is not None and honoured is None:
        warnings.warn(
            f"overlap.wrap: collective_timeout_s={timeout.total_seconds():g} does not bound the "
            f"training all-gathers and reduce-scatters of {semantics.device_type} tensors over "
            f"{semantics.backend}: a wait with a timeout there would block the CPU on every "
            "collective. A hung collective ends in the process group's watchdog abort instead, "
            "after the timeout given to torch.distributed.init_process_group(timeout=...) (10 "
            "minutes by default for NCCL): set that one. collective_timeout_s still bounds the "
            "blocking waits of wrap's rank-0 sync and of the full state dict's export and load.",
            stacklevel=2,
        )
    return honoured


class Transport:
    """An executor and the all-gather, reduce-scatter and all-reduce strategies it runs."""

    def __init__(
        self,
        executor: Executor,
        all_gather: AllGather,
        reduce_scatter: ReduceScatter,
        all_reduce: AllReduce,
        wire: Wire,
    ) -> None:
        self.executor = executor
        self.all_gather = all_gather
        self.reduce_scatter = reduce_scatter
        self.all_reduce = all_reduce
        self.wire = wire
        self._planned = False

    @property
    def timeout(self) -> timedelta | None:
        """What a wait on a collective is bounded by (None: the process group's timeout)."""
        return self.executor.timeout

    def plan(self, units: list[UnitWire], compressed_params: bool) -> None:
        """Every strategy decides per unit, once, from sizes every rank shares."""
        self.wire = dataclasses.replace(self.wire, units=tuple(units), compressed_params=compressed_params)
        for strategy in (self.all_gather, self.reduce_scatter, self.all_reduce):
            strategy.plan(self.wire)
        self._planned = True

    def aliases(self, compressed_params: bool) -> bool:
        """Whether units gathered without a cast may be views of their shards ([Note: aliased
        units] in engine/unit_tensors.py): over one rank, without a codec or forced collectives."""
        return comm.runs_locally(self.wire.world_size) and not compressed_params

    def fingerprints(self) -> FingerprintCheck:
        return FingerprintCheck(self.wire.rank, self.wire.device)

    def flush(self) -> None:
        """Issue what a strategy held back ([Note: coalesced collectives] in strategy.py): the
        runtime calls it when a batch of actions ends and before a collective of its own."""
        for strategy in (self.all_gather, self.reduce_scatter, self.all_reduce):
            strategy.flush()

    # ------------------------------------------------------------------ injection
    def set_custom_all_gather(self, all_gather: AllGather) -> None:
        """Gather with `all_gather` from now on (FSDP2's `set_custom_all_gather`): between
        steps, with nothing in flight; it is planned for the same units."""
        self.flush()
        self.all_gather = all_gather
        if self._planned:
            all_gather.plan(self.wire)

    def set_custom_reduce_scatter(self, reduce_scatter: ReduceScatter) -> None:
        """Reduce with `reduce_scatter` from now on (FSDP2's `set_custom_reduce_scatter`)."""
        self.flush()
        self.reduce_scatter = reduce_scatter
        if self._planned:
            reduce_scatter.plan(self.wire)

    def set_executor(self, executor: Executor) -> None:
        """Run the work after collectives through `executor` from now on (between steps)."""
        self.flush()
        self.executor = executor


def make_wire(
    group: dist.ProcessGroup,
    device: torch.device,
    semantics: backend.CommSemantics,
    reduce_impl: str,
    gather_impl: str,
    secondary_group: dist.ProcessGroup | None,
) -> Wire:
    """The wire before the units are known (`Transport.plan` adds them)."""
    return Wire(
        group=group,
        rank=dist.get_rank(group),
        world_size=dist.get_world_size(group),
        device=device,
        semantics=semantics,
        gather_impl=gather_impl,
        # [Note: reduce-scatter through all-to-all] in collectives.py
        reduce_impl=reduce_impl if reduce_impl != "auto" else semantics.auto_reduce_impl(),  # type: ignore[arg-type]
        secondary_group=secondary_group,
    )
