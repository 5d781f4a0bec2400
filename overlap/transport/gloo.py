"""gloo's own mechanisms, as collective strategies ([Note: the seam] in strategy.py).

What makes gloo cheaper on a CPU, all decided from sizes every rank shares (`GlooPlan`):
- small units gathered through all-to-all ([Note: all-gather through all-to-all] in
  collectives.py), and gradients reduced through it ([Note: reduce-scatter through all-to-all]);
- every all-to-all as point-to-point messages, receives posted first, sends off the training
  thread ([Note: receive before send], [Note: sends posted off the training thread] in
  pairwise.py);
- the receive slack every all-to-all leaves ([Note: receive slack] in collectives.py);
- the backward all-gather travelling in a reduction's all-to-all ([Note: fused exchange]);
- at two ranks, the gather of a pair ([Note: gather of a pair] in collectives.py).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from overlap.compression import Codec
from overlap.compression.feedback import FeedbackResidual
from overlap.transport import coded
from overlap.transport import collectives as comm
from overlap.transport.strategy import AllGather, AllReduce, ReduceScatter, Wire

# [Note: fused exchange]
# In backward, a unit's gradient reduction and the prefetch all-gather of a unit further on
# are issued back to back (the schedule's post_backward: Free, Reduce, Gather). When both
# go through all-to-all in the same group (reduce_scatter_impl and all_gather_impl resolve to
# all_to_all, no codec, no cast, no hpZ), they travel as one: the reduction is held back
# ([Note: coalesced collectives] in strategy.py), and if the next collective asked for is such
# a backward gather, row r of the send buffer becomes [the gradient chunk for rank r | this
# rank's shard], so rank r receives its chunk to sum and every rank's shard
# ([collectives.reduce_scatter_and_gather]). One collective instead of two per unit in
# backward: on two CPU cores a gloo collective costs ~200-300 µs of CPU whatever its size at
# these sizes, while the copies into the send rows cost a few. The values exchanged are the
# same, so results are bitwise those of the two collectives. Every rank sees the same actions in
# the same order ([Note: collective order] in engine/schedule.py) and decides from sizes and
# settings they share, so the collectives still pair.


class GlooPlan:
    """What the gloo strategies decide once per wrap, shared by the gather and the reduction,
    and the reduction held back for a gather to ride in ([Note: fused exchange])."""

    def __init__(self) -> None:
        self.wire: Wire | None = None
        self.gather_impls: list[comm.GatherImpl] = []
        self.fusable: list[bool] = []
        self.slack: comm.RecvSlack | None = None  # [Note: receive slack]
        self.pair = False  # [Note: gather of a pair]
        self.held: HeldReduce | None = None

    def plan(self, wire: Wire) -> None:
        self.wire = wire
        self.gather_impls = [self._resolve_gather_impl(i) for i in range(len(wire.units))]
        self.fusable = [self._can_fuse(i) for i in range(len(wire.units))]
        self.slack = self._receive_slack()
        self.pair = (  # two ranks, uncompressed, impl "auto"
            wire.world_size == 2
            and wire.gather_impl == "auto"
            and not wire.compressed_params
            and wire.secondary_group is None
            and not comm.runs_locally(wire.world_size)
        )

    def _resolve_gather_impl(self, index: int) -> comm.GatherImpl:
        """Unit `index`'s uncompressed all-gather ([Note: all-gather through all-to-all])."""
        w = self.wire
        assert w is not None
        if w.gather_impl != "auto":
            return w.gather_impl  # type: ignore[return-value]
        return w.semantics.auto_gather_impl(w.world_size * w.part_bytes(index))  # type: ignore[return-value]

    def _receive_slack(self) -> comm.RecvSlack | None:
        """What every all-to-all leaves room for ([Note: receive slack]): the largest message of
        a small exchange, an all-to-all gather or a unit's reduction, or both at once where they
        fuse. From the layouts (every parameter trainable: an upper bound), so every rank
        computes the same."""
        w = self.wire
        assert w is not None
        small = [i for i, impl in enumerate(self.gather_impls) if impl == "all_to_all"]
        if comm.runs_locally(w.world_size) or not small:
            return None
        most_gather = max(w.part_bytes(i) for i in small)
        most_reduce = max(w.units[i].reduce_row_bytes for i in small)
        floor = most_gather + most_reduce if any(self.fusable) else max(most_gather, most_reduce)
        return comm.RecvSlack(w.rank, -(-floor // 64) * 64)

    def _can_fuse(self, index: int) -> bool:
        """Whether a backward all-gather of unit `index` may ride in a reduction's all-to-all
        ([Note: fused exchange]): more than one rank, no cast, no hpZ (and no codec: neither a
        compressed gather nor a compressed reduction is held)."""
        w = self.wire
        assert w is not None
        return (
            self.gather_impls[index] == "all_to_all"
            and w.reduce_impl == "all_to_all"
            and w.secondary_group is None
            and w.units[index].same_dtype
            and not comm.runs_locally(w.world_size)
        )

    def fits_with(self, reduce_cols: int, index: int, itemsize: int) -> bool:
        """Whether a reduction of `reduce_cols` per row and unit `index`'s shard fit in the
        receive slack together ([Note: receive slack])."""
        assert self.slack is not None and self.wire is not None
        return (reduce_cols + self.wire.units[index].gather_numel) * itemsize <= self.slack.floor_bytes

    def flush(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.issue()

    @property
    def floor_bytes(self) -> int:
        return 0 if self.slack is None else self.slack.floor_bytes


class _HeldWork:
    """The work handle of a held reduction: waiting on it issues the reduction first."""

    def __init__(self, held: HeldReduce) -> None:
        self._held = held

    def wait(self, timeout: timedelta | None = None) -> bool:
        real = self._held.issue()
        if real.work is None:
            return True
        # gloo strategies serve CPU tensors only: this host wait never meets NCCL work
        return real.work.wait() if timeout is None else real.work.wait(timeout)

    def get_future(self) -> Any:
        raise RuntimeError("getFuture not implemented: a held reduction has no future")


class HeldReduce:
    """A reduce-scatter through all-to-all held back for a gather to ride in ([Note: fused
    exchange]): `result` is what the runtime keeps; it is issued alone or with a gather."""

    def __init__(self, plan: GlooPlan, full: torch.Tensor, divide: comm.Divide | None) -> None:
        self.plan, self.full, self.divide = plan, full, divide
        self.real: comm.CommResult | None = None
        self.result = comm.CommResult(full, _HeldWork(self), (full,), self._finish)

    def issue(self) -> comm.CommResult:
        """Issue it alone, unless it went already (idempotent)."""
        if self.real is None:
            w = self.plan.wire
            assert w is not None
            if self.plan.held is self:
                self.plan.held = None
            self.real = comm.reduce_scatter_flat(
                self.full.view(-1), w.group, w.world_size, "all_to_all", self.plan.slack, self.divide
            )
        return self.real

    def _finish(self, _: torch.Tensor) -> Any:
        real = self.issue()
        return real.output if real.finish is None else real.finish(real.output)

    def carry(self, index: int, send: torch.Tensor) -> comm.CommResult:
        """Issue it with unit `index`'s backward all-gather of `send` (tagged, uncast): the
        gather's result, holding its share of the exchange's bytes."""
        w = self.plan.wire
        assert w is not None and self.real is None
        n = w.world_size
        full = self.full.view(n, -1)
        reduce_cols, g = full.shape[1], send.numel()
        rows = torch.empty(n, reduce_cols + g, dtype=full.dtype, device=full.device)
        rows[:, :reduce_cols].copy_(full)
        rows[:, reduce_cols:].copy_(send.expand(n, g))
        reduce, gather = comm.reduce_scatter_and_gather(rows, reduce_cols, w.group, self.plan.slack, self.divide)
        self.real = reduce
        total = rows.numel() * rows.element_size() + reduce.output.numel() * reduce.output.element_size()
        return gather._replace(nbytes=total * g // (reduce_cols + g))


class GlooAllGather(AllGather):
    """All-gathers through all-to-all where small, as a pair's exchange at two ranks, and in a
    held reduction's all-to-all in backward ([Note: fused exchange])."""

    def __init__(self, plan: GlooPlan) -> None:
        self.shared = plan

    def plan(self, wire: Wire) -> None:
        super().plan(wire)
        self.shared.plan(wire)

    def flush(self) -> None:
        self.shared.flush()

    def __call__(
        self,
        index: int,
        send: torch.Tensor,
        dtype: torch.dtype,
        tag: int | None,
        tag_slot: torch.Tensor | None,
        for_backward: bool,
    ) -> comm.CommResult:
        plan, w = self.shared, self.wire
        held, plan.held = plan.held, None
        if held is not None:
            if (
                for_backward
                and plan.fusable[index]
                and dtype == send.dtype == held.full.dtype
                and plan.fits_with(held.full.numel() // w.world_size, index, dtype.itemsize)
            ):
                return held.carry(index, comm._send_of(send, dtype, tag, tag_slot))
            held.issue()
        if plan.pair:
            return comm.all_gather_pair(send, w.group, w.rank, dtype, tag, tag_slot, plan.slack)
        return comm.all_gather_flat(
            send, w.group, w.world_size, dtype, tag, tag_slot, plan.gather_impls[index], plan.slack
        )

    def nbytes(self, index: int) -> int:
        """Natively the output and the shard sent; through all-to-all the send copies and the
        receive buffer with its slack ([Note: receive slack])."""
        w, plan = self.wire, self.shared
        part, floor = w.part_bytes(index), plan.floor_bytes
        if plan.pair:  # the shard sent and the peer's part received ([Note: gather of a pair])
            return part + max(part, floor)
        if comm.runs_locally(w.world_size) or plan.gather_impls[index] == "native":
            return (w.world_size + 1) * part
        return w.world_size * part + part + (w.world_size - 1) * max(part, floor)

    def gathered_bytes(self, index: int, received: torch.Tensor) -> int:
        # every rank's part, as a native gather delivers (a pair receives the peer's only, an
        # all-to-all leaves slack, a fused exchange carries gradients too)
        return self.wire.world_size * self.wire.part_bytes(index)

    @property
    def receive_floor_bytes(self) -> int:
        return self.shared.floor_bytes


class GlooReduceScatter(ReduceScatter):
    """Reduce-scatters through all-to-all with the receive slack, held back for a backward
    gather to ride in where one may ([Note: fused exchange])."""

    def __init__(self, plan: GlooPlan) -> None:
        self.shared = plan
        self._least_rider_numel: int | None = None  # set by plan

    def plan(self, wire: Wire) -> None:
        super().plan(wire)
        self.shared.plan(wire)
        fusable = [wire.units[i].gather_numel for i, ok in enumerate(self.shared.fusable) if ok]
        # the smallest shard that may ride: a reduction leaving no room for it is never held
        self._least_rider_numel = min(fusable) if fusable and self.shared.slack is not None else None

    def flush(self) -> None:
        self.shared.flush()

    def __call__(self, full: torch.Tensor, divide: comm.Divide | None, average: bool = False) -> comm.CommResult:
        assert not average, "gloo has no ReduceOp.AVG: the runtime divides (averages() is False)"
        plan, w = self.shared, self.wire
        plan.flush()
        least = self._least_rider_numel
        if least is not None and (full.numel() // w.world_size + least) * full.element_size() <= plan.floor_bytes:
            plan.held = HeldReduce(plan, full, divide)
            return plan.held.result
        return comm.reduce_scatter_flat(full.view(-1), w.group, w.world_size, w.reduce_impl, plan.slack, divide)

    def encoded(
        self, full: torch.Tensor, flags: torch.Tensor, codec: Codec, residual: FeedbackResidual | None
    ) -> comm.CommResult:
        self.flush()
        w = self.wire
        return coded.reduce_scatter_encoded(full, flags, w.group, w.world_size, codec, residual, self.shared.slack)

    def averages(self, dtype: torch.dtype) -> bool:
        return False


class GlooAllReduce(AllReduce):
    """The backend's all-reduce, after what the gloo strategies held back."""

    def __init__(self, plan: GlooPlan) -> None:
        self.shared = plan

    def flush(self) -> None:
        self.shared.flush()

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup, average: bool = False) -> comm.CommResult:
        self.shared.flush()
        return comm.all_reduce_flat(tensor, group, average)


def gloo_strategies() -> tuple[GlooAllGather, GlooReduceScatter, GlooAllReduce]:
    """The three gloo strategies, sharing one plan."""
    plan = GlooPlan()
    return GlooAllGather(plan), GlooReduceScatter(plan), GlooAllReduce(plan)
