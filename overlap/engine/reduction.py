"""Reductions: a bucket's gradients copied into one rank-major buffer, reduce-scattered through the
transport, and the reduced shard added into the sharded parameters' `.grad`.

`Reductions` is the reduction half of the runtime (runtime.py holds the gathers and the
dispatch); it is a base class of `Runtime` and uses its fields (units, transport, timer, stats,
memory, codecs).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlap import kernels
from overlap.compression.feedback import FeedbackResidual, make_residual_format
from overlap.engine.compose import grad_data
from overlap.engine.unit_tensors import UnitTensors
from overlap.engine.units import CHUNK_ALIGN_NUMEL
from overlap.observe.labels import phase as _phase
from overlap.observe.memory import nbytes
from overlap.transport import collectives as comm
from overlap.transport.fingerprint import TRAIL_MASK
from overlap.transport.readback import HostRead
from overlap.transport.strategy import held_bytes

FLAG_PATTERNS = 64
"""Used-flag patterns kept on the device per runtime (least recently used dropped first)."""


def flag_cols(num_flags: int) -> int:
    """Columns the used flags take in each row of a reduction: `num_flags`, padded to the chunk
    alignment so that the row stays a multiple of 16 elements ([Note: used flags])."""
    return -(-num_flags // CHUNK_ALIGN_NUMEL) * CHUNK_ALIGN_NUMEL


def _widest(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype a bucket of units of `dtypes` is reduced in, without `reduce_dtype`: the widest
    ([Note: one dtype per unit] in units.py). A bf16 or fp16 gradient summed in fp32 and rounded
    once equals its sum in its own dtype at two ranks (the double rounding is innocuous: fp32 has
    more than 2p+2 bits), so parity with DDP, which reduces each dtype's bucket on its own, holds."""
    return functools.reduce(torch.promote_types, dtypes)


def gradient_divisors(ranks: int, dtype: torch.dtype, native_average: bool) -> tuple[float, float, bool]:
    """(pre, post, native): how the sum of `ranks` gradients of `dtype` becomes their mean.

    [Note: dividing the sum]
    DDP and FSDP2 average gradients over ranks. Three ways, by what the backend and dtype allow:
    - native: the collectives average themselves (`ReduceOp.AVG`, NCCL, fp32 and bf16), as FSDP2
      does: no pass of ours. NCCL averages a float as the sum of each input times 1/N, which
      at a power-of-two N is the sum of g/N exactly: DDP's pre-divided sum.
    - fp16 (any backend): the sum of N gradients GradScaler scaled up to 2^16 overflows fp16's
      65504 where no single one did. Each input is divided by `pre` before the sum (a power of
      two near sqrt(N): exact) and the sum by `post` = N / pre after, so neither the inputs nor
      the sum leave the range. At two ranks pre = 2, post = 1: DDP's g/2 + g/2 bitwise.
    - otherwise (a backend without a mean, fp32/bf16): the sum, divided by N once (in the
      strategy's summing pass where it has one, [Note: one pass for the sum]); at two ranks (a + b) / 2 equals DDP's
      a/2 + b/2 bitwise, a division by two being exact.
    """
    if ranks == 1:  # nothing to divide; a gradient_divide_factor below 1 still multiplies
        return 1.0, 1.0, False
    if dtype == torch.float16:
        pre = float(2 ** math.ceil(math.log2(ranks) / 2))
        return pre, ranks / pre, False
    if native_average:
        return 1.0, 1.0, True
    return 1.0, float(ranks), False


@dataclass
class PendingReduce:
    """A bucket from its reduce-scatter to the end of backward ([Note: reduce buffers] in
    schedule.py): first with its input alive (`result`), then released, with only the reduced
    shard (`reduced`, 1/N of the input) and, under HSDP, its all-reduce across replicas."""

    result: comm.CommResult | None  # the reduce-scatter while its input is alive
    event: (
        torch.cuda.Event | None
    )  # CUDA: the reduce stream after the reduce-scatter and its sum (ReleaseReduce waits for it)
    used: tuple[bool, ...]  # per trainable parameter of the bucket: this rank produced its gradient
    input_bytes: int  # accounted bytes of the input buffers (released with `result`)
    reduced: torch.Tensor | None = None  # [summed gradients | used counts]
    averaged: bool = False  # the reduction's sum already divided its gradients ([Note: one pass for the sum])
    post: float = 1.0  # what wait_reduce divides the sum by, unless averaged ([Note: dividing the sum])
    native: bool = False  # the collectives average themselves (ReduceOp.AVG): the HSDP all-reduce too
    counts: HostRead | None = None  # the used counts, read back when this rank left a gradient out
    all_reduce: comm.CommResult | None = None  # HSDP: the sum of `reduced` across replicas
    all_reduce_event: torch.cuda.Event | None = None  # CUDA: the all-reduce stream after it
    ready: torch.cuda.Event | None = None  # CUDA: after `_finish_shard`'s division and cast (WaitReduce waits for it)

    @property
    def all_used(self) -> bool:
        """This rank produced a gradient for every trainable parameter of the bucket."""
        return all(self.used)


class Reductions:
    """The reduction verbs of `Runtime` (Reduce, ReleaseReduce, WaitReduce) and what they keep."""

    def reduce(self, bucket: int, indices: tuple[int, ...]) -> None:
        """Copy the bucket's unsharded gradients into one rank-major buffer (the reduce-scatter
        strategy's `allocate`); reduce-scatter it.

        [Note: used flags] After the gradient columns, each trainable parameter adds one column
        holding 1 where this rank produced a gradient for it, else 0 (padded with zero columns
        to a multiple of 16, `flag_cols`, so that every row stays aligned for the copy-in). Every row of that column
        has the same value, so after the reduce-scatter each rank holds the number of ranks
        that used the parameter. A parameter no rank used keeps `.grad` None, as DDP
        (find_unused_parameters=True) leaves it, instead of getting zeros that an optimizer
        with weight decay or momentum would act on. The flags tensor for a pattern is built
        once and cached on the device; the counts are read back only when this rank left some
        parameter of the bucket without gradient (otherwise every count is >= 1): [Note: used
        counts] in `wait_reduce`.
        """
        self.reduce_trail = hash((self.reduce_trail, indices)) & TRAIL_MASK  # [Note: reduction trail]
        n = self.world_size
        dtype = self.reduce_dtype or _widest(self.units[i].unsharded_flat.dtype for i in indices)
        with _phase("reduce", f"bucket{bucket}"):
            # One fused pass (kernels.copy_in): gradients cast to the reduce dtype, padded, a
            # missing gradient as zeros, into the rank-major buffer ([Note: flat layout]).
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor | None] = []
            spans: list[int] = []  # per gradient, its padded span of each rank-major row
            data_cols: list[int] = []  # per gradient, the columns of each row holding data
            for index in indices:
                unit = self.units[index]
                params += unit.grad_params
                if unit.grad_sums is None:
                    for param in unit.grad_params:
                        grads.append(param.grad)
                        param.grad = None
                else:
                    grads += self._take_grads(unit)
                spans += unit.grad_spans
                data_cols += unit.grad_cols
            # TP: [Note: tensor-parallel parameters]; the bucket's Partial() gradients summed together
            srcs = grad_data(params, grads, self._sum_over)
            del params, grads
            used = tuple(g is not None for g in srcs)
            # riding with the gradients (no codec), the flags take their dtype: one copy launch
            # (kernels/triton_copy.py launches once per source dtype); 0 and 1 are exact in any
            flag_dtype = dtype if self.grad_codec is not None else next((g.dtype for g in srcs if g is not None), dtype)
            flags = self._flags_for(used, flag_dtype)
            width_grads = sum(spans)
            sizes = [n * span for span in spans]
            if self.grad_codec is None:  # flags ride in the same buffer
                srcs, sizes, data_cols = [*srcs, flags], [*sizes, n * flag_cols(len(used))], [*data_cols, len(used)]
            strategy, executor = self.transport.reduce_scatter, self.transport.executor
            full = strategy.allocate(n, sum(sizes) // n, dtype, self.device)
            self._copy_in(indices, used, srcs, full, sizes, data_cols)
            del srcs
            ranks = n * self.num_replicas  # the mean over them, or over all of dp for experts:
            divide_by = self.gradient_divide_factor or ranks  # [Note: expert parallelism] in experts.py
            native_ok = self.grad_codec is None and strategy.averages(dtype) and divide_by == ranks
            pre, post, native = gradient_divisors(divide_by, dtype, native_ok)
            if pre != 1:  # fp16: [Note: dividing the sum]; the used flags stay > 0 (1/pre, exact)
                full.div_(pre)
            executor.before_reduce()
            span = self.timer.start(
                "collective", "reduce", self._span_label(indices), executor.reduce_stream, nbytes(full)
            )
            # [Note: one pass for the sum] Through all-to-all, the received chunks are summed
            # here, and the average (sum, then divide, as wait_reduce does otherwise) is taken in
            # the same pass (kernels.sum_rows); not under HSDP, which divides after its all-reduce.
            divide = comm.Divide(width_grads, post) if self.replicate_group is None and post != 1 else None
            host_divides = divide is not None and self.grad_codec is None and strategy.divides
            averaged = native or post == 1 or host_divides
            with executor.on(executor.reduce_stream):
                if self.grad_codec is None:
                    result = strategy(full, divide, native)
                else:  # gradient rows contiguous for the encoder; flags exact, beside them
                    residual = self._residual(indices, width_grads)
                    result = strategy.encoded(full, flags.view(n, -1), self.grad_codec, residual)
                del full
                # CUDA: the reduced shard and its event now, on the reduce stream ([Note: streams])
                event, reduced = executor.reduce_issued(result, span)
        if result.nbytes is not None:
            input_bytes = held_bytes(result)
        else:
            input_bytes = nbytes(*result.inputs) + (nbytes(result.output) if result.finish is not None else 0)
        self.memory.add("reduce_inputs", input_bytes)
        pending = PendingReduce(result, event, used, input_bytes, averaged=averaged, post=post, native=native)
        self._pending[bucket] = pending
        self._pending_units[bucket] = indices
        self.stats.record_issue("reduce", nbytes(result.inputs[0]))
        if reduced is not None:
            self._reduced(bucket, indices, pending, reduced)

    def _sum_over(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Sum `tensor` in place over `group` where the executor runs reductions."""
        self.transport.executor.sum_over(tensor, group, self.transport.all_reduce)

    # [Note: no_sync in reduce_dtype]
    # Under no_sync, autograd sums each micro-batch's gradient into the unsharded parameter's
    # `.grad`, in the parameter's dtype: with param_dtype=bf16 and reduce_dtype=fp32 every
    # micro-batch's add would round to bf16 (8 bits of mantissa) before the fp32 reduction. So,
    # as FSDP2 does, when a unit is freed after a backward that does not reduce, each gradient
    # narrower than reduce_dtype moves into a sum in reduce_dtype (`UnitTensors.grad_sums`,
    # upcast at the first, added into after), and `.grad` starts again from None; the backward
    # that reduces adds its own gradient into that sum and copies the sum in. A backward that
    # reduces right away (no accumulation) is unchanged: its gradients are cast in the copy-in.

    def _keep_grads(self, unit: UnitTensors) -> None:
        """Move the unit's gradients narrower than reduce_dtype into their sums ([Note: no_sync
        in reduce_dtype])."""
        dtype = self.reduce_dtype
        assert dtype is not None
        for slot, param in zip(unit.grad_slots, unit.grad_params):
            grad = param.grad
            if grad is None or grad.dtype.itemsize >= dtype.itemsize:
                continue
            if unit.grad_sums is None:  # per slot: the trainable ones may change in between
                unit.grad_sums = [None] * len(unit.layout.slots)
            total = unit.grad_sums[slot]
            if total is None:
                unit.grad_sums[slot] = grad.to(dtype)
            else:
                total.add_(grad)
            param.grad = None

    def _take_grads(self, unit: UnitTensors) -> list[torch.Tensor | None]:
        """The unit's gradients to reduce: each one added into its sum where it has one."""
        assert unit.grad_sums is not None
        grads: list[torch.Tensor | None] = []
        for slot, param in zip(unit.grad_slots, unit.grad_params):
            grad, total = param.grad, unit.grad_sums[slot]
            param.grad = None
            if total is not None:
                grad = total if grad is None else total.add_(grad)
            grads.append(grad)
        unit.grad_sums = None
        return grads

    def discard_accumulated(self, set_to_none: bool = True) -> None:
        """`model.zero_grad()`: the gradients accumulated under no_sync and not yet reduced (the
        unsharded parameters' `.grad` and their sums) are dropped, or zeroed in place, as DDP's
        zero_grad drops what its no_sync accumulated ([Note: zero_grad after no_sync] in module.py)."""
        for unit in self.units:
            for param in unit.grad_params:
                if param.grad is not None:
                    if set_to_none:
                        param.grad = None
                    else:
                        param.grad.zero_()
            if unit.grad_sums is not None:
                if set_to_none:
                    unit.grad_sums = None
                else:
                    for total in unit.grad_sums:
                        if total is not None:
                            total.zero_()

    def _copy_in(
        self,
        indices: tuple[int, ...],
        used: tuple[bool, ...],
        srcs: list[torch.Tensor | None],
        full: torch.Tensor,
        sizes: list[int],
        data_cols: list[int],
    ) -> None:
        """kernels.copy_in, checked once per bucket layout and then bound ([Note: bound copies]
        in kernels/copy.py)."""
        if not all(s is None or s.is_contiguous() for s in srcs):
            srcs = [s if s is None else s.contiguous() for s in srcs]
        key = (indices, used, len(sizes), full.dtype, *(s.dtype for s in srcs if s is not None))
        bound = self._bound_copy_in.get(key)
        if bound is not None and bound[0] == sizes and bound[1] == data_cols:  # layouts may change
            bound[2](srcs, full)
            return
        kernels.copy_in(srcs, full, sizes=sizes, data_cols=data_cols, num_rows=self.world_size)
        fn = kernels.bind_copy_in(set(key[3:]), full.device, sizes, data_cols, self.world_size)
        self._bound_copy_in[key] = (sizes, data_cols, fn)

    def _flags_for(self, used: tuple[bool, ...], dtype: torch.dtype) -> torch.Tensor:
        """The used-flag columns for every row ([Note: used flags]), cached on the device per
        pattern: built from host data once, never again in steady state. On CUDA the upload is
        a non-blocking copy from pinned memory (no host sync); the cache keeps the
        `FLAG_PATTERNS` most recently used patterns (MoE routing makes new ones every step)."""
        key = (used, dtype)
        flags = self._flags.get(key)
        if flags is None:
            host = torch.tensor(used, dtype=dtype).repeat(self.world_size)
            if self.device.type == "cuda":
                flags = host.pin_memory().to(self.device, non_blocking=True)
            else:
                flags = host.to(self.device)
            self._flags[key] = flags
            while len(self._flags) > FLAG_PATTERNS:
                self._flags.popitem(last=False)
        else:
            self._flags.move_to_end(key)
        return flags

    def release_reduce(self, bucket: int) -> None:
        """Done with the bucket's reduce-scatter input ([Note: reduce buffers] in schedule.py)."""
        pending = self._pending[bucket]
        if pending.result is None:
            return
        with _phase("release_reduce", f"bucket{bucket}"):
            reduced = self.transport.executor.release_reduce(pending.result, pending.event)  # host: now
            pending.result = None
            self.memory.sub("reduce_inputs", pending.input_bytes)
        if reduced is not None:
            self._reduced(bucket, self._pending_units[bucket], pending, reduced)

    def _reduced(self, bucket: int, indices: tuple[int, ...], pending: PendingReduce, reduced: torch.Tensor) -> None:
        """The bucket's reduced shard exists (or is enqueued): keep it; HSDP: sum it across
        replicas ([Note: hybrid sharding] in groups.py), on CUDA on its own stream behind the
        reduce-scatter's event, on CPU right away (in bucket order on every rank)."""
        grad_numel = sum(self.units[i].layout.grad_shard_numel for i in indices)
        if self.replicate_group is None:  # HSDP: after its all-reduce, in wait_reduce
            if not pending.all_used:  # [Note: used counts]: copied right behind the reduction
                pending.counts = HostRead(reduced[grad_numel:], self.transport.executor.reduce_stream)
            reduced = self._finish_shard(indices, pending, reduced)
        pending.reduced = reduced
        self.memory.add("reduce_outputs", nbytes(reduced))
        if self.replicate_group is not None:
            with _phase("all_reduce", f"bucket{bucket}"):
                assert self.replicate_group is not None
                group, all_reduce = self.replicate_group, self.transport.all_reduce
                pending.all_reduce, pending.all_reduce_event = self.transport.executor.all_reduce(
                    lambda: all_reduce(reduced, group, pending.native),
                    reduced,
                    pending.event,
                    self._span_label(indices),
                )
            self.stats.record_issue("all_reduce", nbytes(reduced))
            if not pending.all_used:  # the counts over every replica: behind the all-reduce
                pending.counts = HostRead(reduced[grad_numel:], self.transport.executor.all_reduce_stream)

    def _finish_shard(self, indices: tuple[int, ...], pending: PendingReduce, reduced: torch.Tensor) -> torch.Tensor:
        """Divide the reduced gradients ([Note: dividing the sum]) and cast them to the sharded
        parameters' dtype, once per bucket, where the reduction ran (on CUDA the reduce stream,
        behind the reduce-scatter), so that the end of backward is left only the `.grad`
        DTensors to make. The used counts ride along (small integers: exact in any dtype)."""
        dtypes = {param.dtype for i in indices for param, *_ in self.units[i].grad_locals}
        cast = dtypes.pop() if len(dtypes) == 1 else None  # mixed: per parameter, in _accumulate
        if cast == reduced.dtype:
            cast = None
        if pending.averaged and cast is None:
            return reduced
        grad_numel = sum(self.units[i].layout.grad_shard_numel for i in indices)

        def finish() -> torch.Tensor:
            if not pending.averaged:
                reduced[:grad_numel].div_(pending.post)
            return reduced if cast is None else reduced.to(cast)

        # [Note: gather event] in streams.py, for reductions: ReleaseReduce keeps waiting for the
        # reduce-scatter alone (`event`), only WaitReduce for the division and cast (`ready`)
        reduced, pending.ready = self.transport.executor.after_reduction(finish, pending.event)
        pending.averaged = True
        return reduced

    def forget_residuals(self, unit: int) -> None:
        """Drop the error-feedback residuals of every bucket holding `unit` (its gradient layout
        changed: the residual's columns no longer match). They restart from zero."""
        for indices in [k for k in self.residuals if unit in k]:
            self.memory.sub("residuals", self.residuals.pop(indices).nbytes)

    def _residual(self, indices: tuple[int, ...], width: int) -> FeedbackResidual | None:
        """This bucket's error-feedback residual (zeros the first time), or None when off.

        Keyed by the bucket's units: the schedule forms the same buckets every step. One loaded
        from a checkpoint of another gradient layout restarts from zero, with a warning."""
        if self.residual_dtype is None:
            return None
        assert self.grad_codec is not None, f"rank {self.rank}: error feedback without a gradient codec"
        residual = self.residuals.get(indices)
        if residual is not None and residual.numel != width:
            warnings.warn(
                f"overlap: the error-feedback residual of units {indices} has {residual.numel} "
                f"columns, their gradients {width} (a checkpoint of another layout?): it restarts from zero",
                stacklevel=2,
            )
            self.forget_residuals(indices[0])
            residual = None
        if residual is None:
            fmt = make_residual_format(self.residual_dtype, self.grad_codec)
            residual = FeedbackResidual.zeros(fmt, self.rank, self.world_size, width, self.device)
            self.residuals[indices] = residual
            self.memory.add("residuals", residual.nbytes)
        return residual

    def wait_reduce(self, bucket: int, indices: tuple[int, ...]) -> None:
        """The bucket's reduced shard is usable on the compute stream: add it into `.grad`.

        [Note: used counts]
        Whether a parameter has a `.grad` after backward is seen by the user: an optimizer skips
        a None gradient, while weight decay, momentum and Adam's moments act on zeros. So it is
        decided before backward returns, as DDP (find_unused_parameters=True) decides it, which
        reads its all-reduced map of used parameters back at the end of every backward. A
        parameter this rank used has a count >= 1 from its own flag (`PendingReduce.used`, on
        the host): its `.grad` needs nothing from the device. Only one this rank left out needs
        its count, i.e. the other ranks' flags, which reach this rank with the reduction. So
        the counts' pinned copy (`HostRead`) is enqueued right behind the reduce-scatter (HSDP:
        its all-reduce), ahead of the division and cast, and every `.grad` this rank used is
        made before the counts are read: the host waits, if at all, for that copy alone, after
        the rest of the bucket's work is on its way; a bucket whose every parameter this rank
        used reads nothing. (A zero `.grad`, dropped a step later when the counts arrive, would
        never wait, but the optimizer step in between would act on it: not DDP's semantics.)
        """
        pending = self._pending[bucket]
        stall = self.timer.start("stall", "reduce", self._span_label(indices))
        with _phase("wait_reduce", f"bucket{bucket}"):
            self.release_reduce(bucket)
            del self._pending[bucket]
            del self._pending_units[bucket]
            self.transport.executor.finish_reduce(
                pending.ready or pending.event, pending.all_reduce, pending.all_reduce_event
            )
        reduced = pending.reduced
        assert reduced is not None, f"rank {self.rank}: bucket {bucket} has no reduced shard"
        if self.grad_codec is not None:  # its last element: every rank's count ([Note: collective finite check])
            self.grad_codec.agree_nonfinite(reduced[-1:])
        self.timer.stop(stall)
        units = [self.units[i] for i in indices]
        for unit in units:
            self._drop_secondary(unit)  # [Note: secondary copy]
            self._drop_encoded(unit)  # see _encoded_shard
        grad_numel = sum(u.layout.grad_shard_numel for u in units)
        self.memory.sub("reduce_outputs", nbytes(reduced))
        with torch.no_grad():
            grads = reduced[:grad_numel]
            assert reduced.numel() - grad_numel >= len(pending.used), f"rank {self.rank}: bucket {bucket}'s used counts"
            if not pending.averaged:  # [Note: dividing the sum]
                grads.div_(pending.post)
            # [Note: used counts]: what this rank used first, without reading anything back
            self._accumulate(units, grads, [float(u) for u in pending.used])
            if pending.counts is not None:  # then what it left out and another rank used
                counts = pending.counts.values()
                self._accumulate(units, grads, [0.0 if u else c for u, c in zip(pending.used, counts)])

    def _accumulate(self, units: list[UnitTensors], grads: torch.Tensor, num_users: list[float]) -> None:
        """Add the bucket's reduced gradients (`grads`, the units' shards in order) into the
        sharded parameters' `.grad`, for the parameters of a nonzero `num_users` (one per
        trainable parameter of the bucket, in order)."""
        from torch.distributed.tensor import DTensor  # loaded: the parameters are DTensors

        offset, first = grads.storage_offset(), 0
        for unit in units:
            for k, (param, grad_offset, shape, stride) in enumerate(unit.grad_locals):
                if num_users[first + k] == 0:
                    continue  # [Note: used flags]
                local = grads.as_strided(shape, stride, offset + grad_offset)
                if local.dtype != param.dtype:
                    local = local.to(param.dtype)
                if param.grad is None:
                    # The parameter's own spec (mesh, placements, global shape and stride, dtype):
                    # the DTensor is built directly, without from_local's autograd function and
                    # argument checks (microseconds per parameter and step).
                    param.grad = DTensor(local, param._spec, requires_grad=False)  # type: ignore[call-arg]
                else:
                    param.grad._local_tensor.add_(local)
            first += len(unit.grad_locals)
            offset += unit.layout.grad_shard_numel
