"""`overlap.wrap`: shard a model in place and install the hooks that drive the schedule.

The orchestrator. It turns module hooks into schedule events and hands the schedule's actions to
the runtime:

    root forward pre-hook   -> Schedule.begin_forward        (root unit gathered, prefetch starts)
    unit forward pre-hook   -> Schedule.pre_forward(u)       (wait for u, prefetch ahead)
    unit forward hook       -> Schedule.post_forward(u)      (free u; pre-backward hooks on outputs)
    root forward hook       -> Schedule.end_forward          (order check; backward prefetch)
    output gradient hook    -> Schedule.pre_backward(u)      (wait for u, prefetch ahead)
    post-accumulate-grad    -> Schedule.post_backward(u)     (when all of u's grads are in)
    autograd end callback   -> Schedule.end_backward         (flush buckets, wait reductions)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from datetime import timedelta
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from overlap import backend, comm, teardown
from overlap.compression import make_grad_codec, make_param_codec
from overlap.config import OverlapConfig
from overlap.fingerprint import TAG_NUMEL
from overlap.local_step import register_sharded
from overlap.guard import remember_replaced
from overlap.init import ParamInitFn, ScratchBuffer, materialize_and_shard
from overlap.monitor import Monitor
from overlap.replicated import ReplicatedParams, is_replicated  # ecosystem: scalar parameters
from overlap.runtime import Runtime, UnitTensors, keep_freed_cpu_memory
from overlap.schedule import Action, Phase, Schedule, ScheduleConfig, UnitState, order_hash
from overlap.stats import StatsRecorder
from overlap.timing import make_timer
from overlap.sync import SourcePlan, broadcast_tensors, pack_rank_major, plan_source, scatter_shard
from overlap.trace import TraceRecorder, trace_dir_from
from overlap.units import (
    CHUNK_ALIGN_NUMEL,
    ParamInfo,
    UnitLayout,
    find_unit_modules,
    group_units,
    make_layout,
    split_by_dtype,
    with_trainable,
)


class _GradReady:
    """The post-accumulate-grad hook of a unit's unsharded parameter; holds the state weakly.

    [Note: a wrapped model is collectable]
    torch keeps a parameter's post-accumulate-grad hooks where the garbage collector cannot see
    them (in C++), so a hook holding the state strongly closes a cycle the collector cannot
    break: parameter -> hook -> state -> units -> parameter. A wrapped model then lived until
    the process exited, whatever the user deleted: its flat buffers, shards, runtime and process
    group references (a notebook or a tuner that wraps model after model grew by a model each
    time). Held weakly, the state goes with the model. What a dropped model leaves for the
    collector is collected at exit at the latest ([Note: quiet exit] in teardown.py).
    """

    __slots__ = ("_state", "_index")

    def __init__(self, state: OverlapState, index: int) -> None:
        self._state = weakref.ref(state)
        self._index = index

    def __call__(self, param: torch.Tensor) -> None:
        state = self._state()
        if state is not None:  # None: the model was dropped while its graph lived on
            state._grad_ready(self._index, param)


class OverlapState:
    """Everything `wrap` attaches to a model (as `model._overlap_state`)."""

    def __init__(
        self,
        model: nn.Module,
        config: OverlapConfig,
        groups: Groups,
        units: list[UnitTensors],
        root_units: tuple[int, ...],
        hooked: list[HookedModules],
    ) -> None:
        self.config = config
        group = self.group = groups.shard  # all-gathers and reduce-scatters run here
        replicate_group = self.replicate_group = groups.replicate  # HSDP: reduced shards all-reduced here
        self.mesh = groups.mesh
        self.rank = dist.get_rank(group)  # rank within the shard group
        self.world_size = dist.get_world_size(group)  # shard group size
        self.num_replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.replica_rank = 0 if replicate_group is None else dist.get_rank(replicate_group)
        self.units = units
        # The root's units: the first is the schedule's root; the others are its parameters of
        # other dtypes ([Note: one dtype per unit] in units.py), gathered when the root's forward
        # starts and kept until their backward, as the root is.
        self.root_units = root_units
        self.root_unit = root_units[0] if root_units else None
        root_unit = self.root_unit
        self.stats = StatsRecorder()
        device = units[0].shard.device if units else torch.device("cpu")
        gather_dtype = config.param_dtype
        reduce_dtype = config.reduce_dtype or config.param_dtype
        self.schedule = Schedule(
            unit_bytes=[_held_bytes(u, gather_dtype) for u in units],
            grad_bytes=[_grad_bytes(u, reduce_dtype) for u in units],
            config=ScheduleConfig(
                prefetch_depth=config.prefetch_depth,
                max_inflight_bytes=config.max_inflight_allgather_bytes,
                reshard_after_forward=config.reshard_after_forward,
                bucket_bytes=config.reduce_scatter_bucket_bytes,
                max_reduce_inputs=config.max_reduce_inputs,
                keep_bytes=config.keep_for_backward_bytes,
            ),
            root=root_unit,
        )
        self.monitor = Monitor(
            self.rank,
            device,
            metrics_file=config.metrics_file,
            alert_exposed_comm_share=config.alert_exposed_comm_share,
            alert_collective_slowdown=config.alert_collective_slowdown,
            alert_step_gap_ms=config.alert_step_gap_ms,
            alert_memory_bytes=config.alert_memory_bytes,
        )
        trace_dir = trace_dir_from(config.trace_dir)
        self.trace = TraceRecorder(trace_dir, self.rank) if trace_dir is not None else None
        # exact completion times only where they are read ([Note: completion callbacks cost latency])
        self.timer = make_timer(
            device, precise=trace_dir is not None or config.alert_collective_slowdown is not None
        )
        self.runtime = Runtime(
            units,
            group,
            self.rank,
            self.world_size,
            device,
            gather_dtype,
            reduce_dtype,
            self.stats,
            timeout=None
            if config.collective_timeout_s is None
            else timedelta(seconds=config.collective_timeout_s),
            trace=self.trace,
            timer=self.timer,
            reduce_impl=_reduce_impl(config.reduce_scatter_impl, group, device),
            gather_impl=config.all_gather_impl,
            param_codec=None
            if config.param_compression is None
            else make_param_codec(config.param_compression, block_size=config.compression_block_size),
            grad_codec=None
            if config.grad_compression is None
            else make_grad_codec(
                config.grad_compression,
                block_size=config.compression_block_size,
                stochastic=config.stochastic_rounding,
                generator=_rounding_generator(device, self.rank) if config.stochastic_rounding else None,
            ),
            residual_dtype=config.error_feedback_dtype if config.error_feedback else None,
            replicate_group=replicate_group,
            secondary_group=groups.secondary if config.reshard_after_forward else None,
        )
        self._num_trainable = [sum(p.requires_grad for p in u.unsharded_params) for u in units]
        self._has_frozen = [not all(p.requires_grad for p in u.unsharded_params) for u in units]
        self._reduce_dtype = reduce_dtype
        self._hooked: set[int] = set()  # ids of unsharded parameters with a grad-ready hook
        self._num_ready = [0] * len(units)
        self._num_forwards = [0] * len(units)  # forwards this step that can report (b) below
        self._num_done = [0] * len(units)
        self._backward_queued = False
        self._handles: list[Any] = []
        # ecosystem: 0-dim parameters, whole on every rank ([Note: replicated parameters])
        self.replicated = ReplicatedParams(model, groups.everyone, self.runtime.timeout, self.stats)
        self._install_hooks(model, hooked)

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self, model: nn.Module, hooked: list[HookedModules]) -> None:
        self._handles.append(
            model.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True)
        )
        self._handles.append(model.register_forward_hook(self._root_post_forward))
        for modules, indices in hooked:  # a module's units: one per dtype ([Note: one dtype per unit])
            for position, module in enumerate(modules):
                last = position == len(modules) - 1
                self._handles.append(
                    module.register_forward_pre_hook(
                        functools.partial(self._unit_pre_forward, indices, position == 0),
                        prepend=True,
                    )
                )
                self._handles.append(
                    module.register_forward_hook(
                        functools.partial(self._unit_post_forward, indices, last)
                    )
                )
        for index in range(len(self.units)):
            self._hook_trainable(index)

    def _hook_trainable(self, index: int) -> None:
        for param in self.units[index].unsharded_params:
            if param.requires_grad and id(param) not in self._hooked:
                self._hooked.add(id(param))
                param.register_post_accumulate_grad_hook(_GradReady(self, index))

    # [Note: requires_grad after wrap]
    # Fine-tuning schedules freeze and unfreeze parameters between steps (gradual unfreezing,
    # frozen embeddings) through the parameters the user sees: the sharded ones. At the start
    # of each step the flags are compared with each unit's layout; where they changed, the unit
    # gets a new gradient layout: a frozen parameter gets no gradient, takes no column in the
    # reduce-scatter and no gradient memory, exactly as one frozen at wrap (and as under DDP,
    # whose find_unused_parameters leaves it without gradient); an unfrozen one gets them back.
    # Ranks that changed different parameters raise at the next forward all-gather of the unit,
    # whose tag carries its trainable pattern ([Note: collective fingerprints]), instead of
    # exchanging gradient buffers of different sizes. Error-feedback residuals of the changed
    # units restart from zero.
    def _sync_requires_grad(self) -> None:
        for index, unit in enumerate(self.units):
            flags = tuple(p.requires_grad for p in unit.sharded_params)
            if flags == tuple(s.requires_grad for s in unit.layout.slots):
                continue
            unit.set_layout(with_trainable(unit.layout, flags))
            self._num_trainable[index] = sum(flags)
            self._has_frozen[index] = not all(flags)
            self._hook_trainable(index)
            self.runtime.forget_residuals(index)
            self.schedule.set_grad_bytes(index, _grad_bytes(unit, self._reduce_dtype))

    def _run(self, actions: list[Action]) -> None:
        if actions:
            self.runtime.run(actions)

    # [Note: forward during backward]
    # Activation checkpointing (torch.utils.checkpoint) runs a unit's forward again inside
    # backward to recompute what it discarded. Those calls fire the forward hooks too; in the
    # BACKWARD phase they only make sure the unit is gathered (as its pre-backward would) and
    # never free it or register hooks, since its backward is about to use the parameters.

    # [Note: hooks under torch.compile]
    # A block compiled in place (`module.compile()`), or a unit inside a `torch.compile`d module
    # (unit_policy naming the inner class), has its forward hooks called from a frame that
    # dynamo traces. Traced, the schedule's Python state (unit states, cursors) becomes guards
    # that change every call: a recompile per unit and step until dynamo's recompile limit.
    # The forward hooks are therefore `torch.compiler.disable`d: dynamo breaks the graph around
    # them and they run eagerly; the block's own forward is still compiled, once for all units.

    @torch.compiler.disable
    def _root_pre_forward(
        self, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        if self.schedule.phase is Phase.BACKWARD:
            return None  # [Note: forward during backward]
        if self.schedule.phase is Phase.IDLE:
            self._sync_requires_grad()
            self.stats.begin_step()
            self.timer.begin_step()
            self.runtime.begin_step()
        self._run(self.schedule.begin_forward())
        for index in self.root_units[1:]:  # kept like the root: never post_forward-ed
            self._run(self.schedule.pre_forward(index))
        dtype = self.config.param_dtype
        if dtype is None:
            return None

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and not isinstance(x, DTensor):
                return x.to(dtype)
            return x

        return tree_map(cast, args), tree_map(cast, kwargs)

    @torch.compiler.disable  # [Note: hooks under torch.compile]
    def _root_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.schedule.phase is Phase.BACKWARD:
            return
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._on_backward_of(output, self.root_units)
        first = self.schedule.forward_order is None
        self._run(self.schedule.end_forward(grad_enabled))
        if first:  # hpZ: a unit kept for backward needs no secondary copy, nor do the root's
            for index in (*self.schedule.kept_units(), *self.root_units):
                self.runtime.units[index].needs_secondary = False
        if not grad_enabled:
            self._finish_step()

    @torch.compiler.disable  # [Note: hooks under torch.compile]
    def _unit_pre_forward(self, indices: tuple[int, ...], first: bool, module: nn.Module, args: tuple) -> Any:
        if self.schedule.phase is Phase.BACKWARD:
            for index in indices:
                self._run(self.schedule.pre_backward(index))  # [Note: forward during backward]
            return None
        for index in indices:
            self._run(self.schedule.pre_forward(index))
        if self.trace is not None and first:
            self.trace.begin("compute", f"forward {self.units[indices[0]].layout.label}")
        if first and torch.is_grad_enabled():
            return self._on_backward_done(args, indices)
        return None

    @torch.compiler.disable  # [Note: hooks under torch.compile]
    def _unit_post_forward(
        self, indices: tuple[int, ...], last: bool, module: nn.Module, args: tuple, output: Any
    ) -> None:
        if self.schedule.phase is Phase.BACKWARD:
            return
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._on_backward_of(output, indices)
        if last:
            if self.trace is not None:
                self.trace.end("compute", f"forward {self.units[indices[0]].layout.label}")
            for index in indices:
                self._run(self.schedule.post_forward(index, grad_enabled))

    def _on_backward_of(self, output: Any, indices: tuple[int, ...]) -> None:
        """Call `_pre_backward(indices)` when the first gradient w.r.t. `output` arrives."""
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if len(tensors) == 1:  # the common case: a plain tensor hook is several times cheaper
            tensors[0].register_hook(functools.partial(self._pre_backward_hook, indices))
        elif tensors:
            register_multi_grad_hook(
                tensors, functools.partial(self._pre_backward, indices), mode="any"
            )

    def _pre_backward_hook(self, indices: tuple[int, ...], grad: torch.Tensor) -> None:
        self._pre_backward(indices, grad)  # returns None: the gradient is left as it is

    # [Note: end of a unit's backward]
    # A unit's backward is over when (a) every trainable parameter's gradient has been
    # accumulated (post-accumulate-grad hooks, counted), or (b) the gradient w.r.t. its inputs
    # has been computed, once for each forward it ran this step (`_BackwardDone` on its inputs).
    # (b) covers units with frozen or unused parameters, whose count never completes. It is
    # safe because autograd runs AccumulateGrad nodes before any other ready node (they carry
    # the highest sequence number), so a parameter's gradient produced by the same node as the
    # input gradient is already accumulated. A gradient that still arrives after its unit was
    # reduced (a parameter used outside its unit's forward) raises instead of being lost.
    # (a) is not used for a unit with frozen parameters whose inputs need a gradient: its
    # backward may still need a frozen weight after the last trainable gradient is in (to pass
    # the gradient on to its inputs, e.g. a frozen attention before a trainable feed-forward),
    # so only (b) ends it. With no input needing a gradient, nothing after (a) reads a weight.

    def _on_backward_done(self, args: tuple, indices: tuple[int, ...]) -> tuple | None:
        if len(args) == 1 and isinstance(args[0], torch.Tensor):  # the most common case
            if not args[0].requires_grad:
                return None
            for index in indices:
                self._num_forwards[index] += 1
            # An identity view whose backward node reports (b): a hook on the node is several
            # times cheaper than an autograd.Function. The node runs when the gradient w.r.t.
            # this use of the input is complete, exactly as _BackwardDone.backward would.
            out = args[0].view_as(args[0])
            out.grad_fn.register_prehook(functools.partial(self._input_grad_done, indices))
            return (out,)
        if all(isinstance(a, torch.Tensor) for a in args):  # the common case, without pytree
            positions = [i for i, t in enumerate(args) if t.requires_grad]
            if not positions:
                return None
            for index in indices:
                self._num_forwards[index] += 1
            outs = _BackwardDone.apply(self, indices, *(args[i] for i in positions))
            new_args = list(args)
            for i, t in zip(positions, outs):
                new_args[i] = t
            return tuple(new_args)
        flat, spec = tree_flatten(args)
        positions = [
            i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not positions:
            return None  # nothing flows back into this unit's inputs; (a) or end_backward
        for index in indices:
            self._num_forwards[index] += 1
        outs = _BackwardDone.apply(self, indices, *(flat[i] for i in positions))
        for i, t in zip(positions, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _pre_backward(self, indices: tuple[int, ...], grad: Any) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            self.schedule.begin_backward()
            Variable._execution_engine.queue_callback(self._end_backward)
        for index in reversed(indices):  # in backward order: the prefetch starts after the last
            self._run(self.schedule.pre_backward(index))
            if self.trace is not None and index not in self.root_units:  # the root spans it all
                self.trace.begin("compute", f"backward {self.units[index].layout.label}")

    def _post_backward(self, index: int) -> None:
        if self.trace is not None:
            self.trace.end("compute", f"backward {self.units[index].layout.label}")
        self._run(self.schedule.post_backward(index))

    def _input_grad_done(self, indices: tuple[int, ...], grad_outputs: Any) -> None:
        for index in indices:  # returns None: the gradient is left as it is
            self._unit_backward_done(index)

    def _unit_backward_done(self, index: int) -> None:
        self._num_done[index] += 1
        if self._num_done[index] == self._num_forwards[index]:
            self._post_backward(index)

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        if self.schedule.states[index] is not UnitState.UNSHARDED:
            name = next(
                s.fqn
                for s, p in zip(self.units[index].layout.slots, self.units[index].unsharded_params)
                if p is param
            )
            raise RuntimeError(
                f"overlap: the gradient of {name!r} arrived after {self.units[index].layout.label} "
                "finished its backward; a parameter must be used inside its unit's forward (or "
                "choose a unit_policy that puts the module using it in the same unit)"
            )
        self._num_ready[index] += 1
        if self._num_ready[index] == self._num_trainable[index] and not (
            self._has_frozen[index] and self._num_forwards[index] > 0
        ):
            self._post_backward(index)

    def _end_backward(self) -> None:
        self._backward_queued = False
        self._num_ready = [0] * len(self.units)
        self._num_forwards = [0] * len(self.units)
        self._num_done = [0] * len(self.units)
        self._run(self.schedule.end_backward())
        self.replicated.reduce(self.schedule.sync_grads)  # ecosystem: [Note: replicated parameters]
        self._finish_step()
        for codec in (self.runtime.param_codec, self.runtime.grad_codec):
            if codec is not None:  # once per step; on CUDA a step late, without a sync
                codec.raise_if_nonfinite()

    def _finish_step(self) -> None:
        self.runtime.check_fingerprints()
        peak_units, peak_bytes = self.schedule.max_unsharded()
        self.stats.record_unsharded(peak_units, peak_bytes)
        self.stats.record_memory(self.runtime.memory.peak_total)
        spans = self.timer.harvest()
        self.stats.record_spans(spans)
        if self.trace is not None:
            self.trace.record_spans(spans)
            self.trace.finish_step()
        for stats in self.stats.finish(self.timer.oldest_open_step):
            self.monitor.on_step(stats)


def _rounding_generator(device: torch.device, rank: int) -> torch.Generator:
    """Independent stochastic-rounding noise per rank (correlated noise would not average out)."""
    return torch.Generator(device).manual_seed(0x5EED + rank)


def _reduce_impl(choice: str, group: dist.ProcessGroup, device: torch.device) -> comm.ReduceImpl:
    """See [Note: reduce-scatter through all-to-all] in comm.py; decided per device type
    ([Note: NCCL is not gloo] in backend.py)."""
    if choice != "auto":
        return choice  # type: ignore[return-value]
    return backend.semantics(group, device).auto_reduce_impl()  # type: ignore[return-value]


class _BackwardDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward reports that the unit's backward is over."""

    @staticmethod
    def forward(ctx: Any, state: OverlapState, indices: tuple[int, ...], *tensors: torch.Tensor) -> Any:
        ctx.state, ctx.indices = state, indices
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        for index in ctx.indices:
            ctx.state._unit_backward_done(index)
        return (None, None, *grads)


def _held_bytes(unit: UnitTensors, gather_dtype: torch.dtype | None) -> int:
    """Bytes a gathered unit holds, as the prefetch budget counts them: its unsharded storage
    (the all-gather output is the same size, alive only until copy-out), plus the cast of its
    shard into the gather dtype when there is one."""
    cast = 0
    if gather_dtype is not None and gather_dtype != unit.shard.dtype:
        cast = unit.shard.numel() * torch.empty(0, dtype=gather_dtype).element_size()
    return unit.unsharded_nbytes + cast


def _grad_bytes(unit: UnitTensors, reduce_dtype: torch.dtype | None) -> int:
    """Bytes the unit adds to a reduce-scatter bucket (0: nothing to reduce)."""
    dtype = reduce_dtype or unit.unsharded_flat.dtype
    numel = unit.layout.grad_shard_numel * unit.layout.world_size
    return numel * torch.empty(0, dtype=dtype).element_size()


# ---------------------------------------------------------------------- wrap


def wrap(
    model: nn.Module,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    config: OverlapConfig | None = None,
    *,
    param_init_fn: ParamInitFn | None = None,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> nn.Module:
    """Shard `model` in place across `group` and return it.

    Parameters become DTensor shards (`Shard(0)`) under their original names, ndim and dtype,
    so `torch.optim.AdamW(model.parameters())` builds a sharded optimizer. A unit whose
    parameters have several dtypes (fp32 norms beside bf16 weights) is split into one unit per
    dtype over the same modules ([Note: one dtype per unit] in units.py). Forward and backward
    all-gather each unit's parameters just ahead of use and reduce-scatter its gradients while
    backward goes on. `overrides` replace fields of `config` (e.g. `prefetch_depth=2`).
    Collective over `group`: every rank must call it with the same model structure.

    As DDP does, every rank ends with rank 0's parameter and buffer values (its shards are
    scattered from rank 0 unit by unit; see [Note: sync from the source] in sync.py), unless
    `sync_module_states=False`, with which each rank keeps its own rows of its own values.

    A model built on the meta device is materialized one unit at a time on `device` (default:
    the current CUDA device for an NCCL group, else the CPU) and initialized by
    `param_init_fn(module)` or each module's `reset_parameters()`, in the order eager
    construction uses (see [Note: init order] in init.py): the same values as the eager model
    built with the same seed, without ever holding the whole model unsharded. With
    `sync_module_states` only rank 0 initializes; the other ranks build nothing but their shards.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"overlap.wrap expects an nn.Module, got {type(model).__name__}")
    if getattr(model, "_overlap_state", None) is not None:
        raise ValueError("overlap.wrap: this model is already wrapped")
    config = (config or OverlapConfig()).replace(**overrides)
    if not dist.is_initialized():
        raise RuntimeError(
            "overlap.wrap needs torch.distributed: call dist.init_process_group first "
            "(or launch with torchrun / overlap.launch.run_local_world)"
        )
    model_device = _model_device(model)
    deferred = model_device.type == "meta"
    if device is not None:
        device = torch.device(device)
        if not deferred and device != model_device:
            raise ValueError(
                f"overlap.wrap: device={device} but the model is on {model_device}; `device` is "
                "for meta-device models (move a materialized model yourself)"
            )
    elif deferred:
        device = _default_device(group)
    else:
        device = model_device
    if not deferred and param_init_fn is not None:
        raise ValueError("overlap.wrap: param_init_fn is only used for meta-device models")
    pgs = _resolve_group(group, device, config.hybrid_mode)
    group, mesh = pgs.shard, pgs.mesh
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    _check_same_model(model, pgs.everyone, device)
    _check_same_config(config, pgs.everyone, device)
    source = _source_plan(pgs, device, config) if config.sync_module_states else None

    unit_fqns = find_unit_modules(model, config.unit_policy)
    modules = dict(model.named_modules())
    params_of = _params_by_unit_module(model, unit_fqns)
    numels = {fqn: sum(math.prod(p.shape) for p in params_of[fqn]) for fqn in unit_fqns}
    groups = group_units(unit_fqns, numels, config.min_unit_numel)

    layouts: list[UnitLayout] = []
    parts_of: list[tuple[int, ...]] = []  # per module group (the root's first): its units

    def add_units(members: tuple[str, ...], params: list[ParamInfo]) -> tuple[int, ...]:
        """One unit per dtype of `params` ([Note: one dtype per unit] in units.py)."""
        parts = split_by_dtype(params)
        indices = tuple(range(len(layouts), len(layouts) + len(parts)))
        for index, part in zip(indices, parts):
            label = _unit_label(index, members, part[0].dtype if len(parts) > 1 else None, index == indices[0])
            layouts.append(make_layout(index, label, members, part, world_size, CHUNK_ALIGN_NUMEL))
        parts_of.append(indices)
        return indices

    root_units: tuple[int, ...] = add_units(("",), params_of[""]) if params_of[""] else ()
    hooked: list[HookedModules] = []
    for members in groups:
        params = [p for fqn in members for p in params_of[fqn]]
        if not params:
            continue  # its parameters are tied to modules elsewhere and moved up to the root
        hooked.append(HookedModules(tuple(modules[fqn] for fqn in members), add_units(members, params)))

    if device.type == "cpu" and config.cpu_keep_freed_memory:
        keep_freed_cpu_memory()

    owner_modules = dict(model.named_modules(remove_duplicate=False))
    shards, packing = _shard_buffers(owner_modules, layouts, device, source, preallocate=deferred)

    def shard(index: int) -> UnitTensors:
        return _shard_unit(
            owner_modules, layouts[index], mesh, rank, config, device, source, shards[index], packing
        )

    def shard_group(group_index: int) -> list[UnitTensors]:  # in unit order: collectives pair
        return [shard(i) for i in parts_of[group_index]]

    # weakly: see guard.py; 0-dim parameters are kept as they are (replicated.py), not replaced
    remember_replaced((n, p) for n, p in model.named_parameters() if not is_replicated(p))

    if deferred:
        # materialized per module group, all of whose units (one per dtype) are then sharded
        root_group = 0 if root_units else None
        index_of = {
            fqn: g for g, parts in enumerate(parts_of) if g != root_group for fqn in layouts[parts[0]].module_fqns
        }
        unit_set = set(unit_fqns)

        def unit_of_module(fqn: str) -> int | None:
            return index_of.get(_unit_of_module(fqn, unit_set))

        params = [[slot.owners[0] for i in parts for slot in layouts[i].slots] for parts in parts_of]
        init_params = source is None or source.is_source
        done = materialize_and_shard(
            model, unit_of_module, params, root_group, device, param_init_fn, shard_group, init_params
        )
        units = [unit for parts in done for unit in parts]  # type: ignore[attr-defined]
    else:
        units = [shard(i) for i in range(len(layouts))]
    if source is not None:
        buffers = list(model.buffers())
        if buffers:
            broadcast_tensors(source, buffers)
    state = OverlapState(model, config, pgs, units, root_units, hooked)
    teardown.register()  # [Note: quiet exit]
    model._overlap_state = state
    register_sharded(p for unit in units for p in unit.sharded_params)  # [Note: local optimizer step]
    from overlap.module import as_overlap_module  # ecosystem; here: module.py imports api.py, which imports this file

    as_overlap_module(model)  # ecosystem: model.no_sync(), .unshard(), ... (overlap/module.py)
    return model


def _model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise ValueError("overlap.wrap: the model has no parameters to shard")
    if len(devices) > 1:
        where = {}
        for name, p in model.named_parameters():
            where.setdefault(p.device, name)
        raise ValueError(
            "overlap.wrap: parameters are on several devices "
            f"({', '.join(f'{d} (e.g. {n})' for d, n in where.items())}); move the model to one"
        )
    (device,) = devices
    return device


def _default_device(group: dist.ProcessGroup | DeviceMesh | None) -> torch.device:
    if isinstance(group, DeviceMesh):
        return torch.device(group.device_type)
    return backend.default_device(group)


class HookedModules(NamedTuple):
    """Modules whose forward hooks drive units together: a unit's modules, or (a group of
    modules with parameters of several dtypes) the units of each dtype ([Note: one dtype per
    unit] in units.py)."""

    modules: tuple[nn.Module, ...]  # in order: the first's pre-hook starts the units, the last's hook ends them
    units: tuple[int, ...]  # their unit indices, in forward order


def _unit_label(index: int, members: tuple[str, ...], dtype: torch.dtype | None, first: bool) -> str:
    """"unit3 (layers.3)", "root"; a module group's unit of one of several dtypes names it."""
    where = "root" if members == ("",) else f"{members[0]}{'..' + members[-1] if len(members) > 1 else ''}"
    kind = "" if dtype is None else str(dtype).removeprefix("torch.")
    if where == "root" and first:
        return f"root ({kind})" if kind else "root"
    return f"unit{index} ({where}{', ' + kind if kind else ''})"


class Groups(NamedTuple):
    """The process groups `wrap` runs on. See [Note: hybrid sharding]."""

    shard: dist.ProcessGroup  # all-gathers and reduce-scatters
    replicate: dist.ProcessGroup | None  # HSDP: reduced shards are all-reduced across replicas
    secondary: dist.ProcessGroup | None  # hpZ: backward all-gathers from the secondary copy
    mesh: DeviceMesh  # the mesh of the sharded parameters' DTensors
    everyone: dist.ProcessGroup  # every rank of the model: the same-model/config checks


def _resolve_group(
    group: dist.ProcessGroup | DeviceMesh | None, device: torch.device, hybrid_mode: str
) -> Groups:
    """The groups for `wrap`'s `group` argument.

    [Note: hybrid sharding]
    A 2-D DeviceMesh is (outer, inner), e.g. (nodes, GPUs per node).
    hybrid_mode="replicate" (HSDP): parameters are sharded over the inner dimension (the shard
    group) and replicated over the outer one. All-gathers and reduce-scatters run inside the
    shard group; each reduced gradient shard is then summed across replicas by an all-reduce in
    the replicate group and divided by the total number of ranks, which makes the update DDP's
    average over every rank. Parameters are DTensors with placements (Replicate(), Shard(0)).
    hybrid_mode="secondary" (hpZ): parameters are sharded over every rank of the mesh (a 1-D
    mesh over the flattened group, so DTensors, checkpoints and state dicts are those of plain
    sharding over all ranks); after a unit's forward all-gather each rank keeps the parts that
    its inner group needs (1/inner of the unit), and the unit's backward all-gather runs inside
    the inner group from those copies ([Note: secondary copy] in runtime.py). Gradients are
    reduce-scattered over every rank.
    """
    if not isinstance(group, DeviceMesh) or group.ndim == 1:
        if isinstance(group, DeviceMesh):
            pg, mesh = group.get_group(), group
        else:
            pg = group if group is not None else dist.group.WORLD
            assert pg is not None
            mesh = DeviceMesh.from_group(pg, device.type)
        return Groups(pg, None, None, mesh, pg)
    if group.ndim != 2:
        raise ValueError(
            f"overlap.wrap: a {group.ndim}-D DeviceMesh was given; pass a 1-D mesh (shard) or a "
            "2-D mesh (replicate, shard), e.g. init_device_mesh('cpu', (2, 2))"
        )
    ranks = group.mesh.flatten().tolist()
    everyone = dist.new_group(ranks=sorted(ranks))  # collective over the default group, as wrap is
    if hybrid_mode == "replicate":
        replicate = group.get_group(0) if group.size(0) > 1 else None
        return Groups(group.get_group(1), replicate, None, group, everyone)
    if ranks != sorted(ranks):
        raise ValueError(
            "overlap.wrap: hybrid_mode='secondary' needs a mesh laid out in rank order (as "
            f"init_device_mesh makes it); got ranks {group.mesh.tolist()}"
        )
    flat_mesh = DeviceMesh.from_group(everyone, group.device_type)
    secondary = group.get_group(1) if group.size(0) > 1 and group.size(1) > 1 else None
    return Groups(everyone, None, secondary, flat_mesh, everyone)


def shard_placements(mesh: DeviceMesh) -> list[Placement]:
    """DTensor placements of a sharded parameter (and its gradient) on `mesh`."""
    return [Replicate()] * (mesh.ndim - 1) + [Shard(0)]


def _check_same_model(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank must wrap the same structure (parameters, and buffers, which the rank-0 sync
    broadcasts); a mismatch raises on every rank."""
    signature = tuple(
        (name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in model.named_parameters()
    ) + tuple((name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers())
    hashes = comm.all_gather_int(order_hash(signature), group, device)  # type: ignore[arg-type]
    if len(set(hashes)) != 1:
        raise ValueError(
            "overlap.wrap: the model differs across ranks (parameter or buffer names, shapes, "
            f"dtypes or requires_grad); signature hashes by rank: {hashes}. Build the same model "
            "on every rank."
        )


def _source_plan(pgs: Groups, device: torch.device, config: OverlapConfig) -> SourcePlan:
    """Where `sync_module_states` sends every rank's values from: see [Note: sync from the source]."""
    timeout = None if config.collective_timeout_s is None else timedelta(seconds=config.collective_timeout_s)
    return plan_source(pgs.shard, pgs.replicate, pgs.mesh, device, timeout)


# Fields that only change what this rank records or how it allocates, never which collectives
# run or in what order: they may differ across ranks (e.g. a per-rank metrics file).
_RANK_LOCAL_FIELDS = frozenset(
    {
        "cpu_keep_freed_memory",
        "collective_timeout_s",
        "trace_dir",
        "metrics_file",
        "alert_exposed_comm_share",
        "alert_collective_slowdown",
        "alert_step_gap_ms",
        "alert_memory_bytes",
    }
)


def _config_signature(config: OverlapConfig) -> dict[str, str]:
    """The fields that decide the collectives, as strings equal on ranks that agree."""

    def describe(value: Any) -> str:
        if isinstance(value, frozenset):  # a unit_policy set of classes
            return repr(sorted(f"{c.__module__}.{c.__qualname__}" for c in value))
        if callable(value) and not isinstance(value, type):  # a unit_policy callable
            return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
        return repr(value)

    return {
        f.name: describe(getattr(config, f.name))
        for f in dataclasses.fields(config)
        if f.name not in _RANK_LOCAL_FIELDS
    }


def _check_same_config(config: OverlapConfig, group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank must wrap with the same config (prefetch depth, buckets, dtypes, codecs decide
    the sequence and sizes of the collectives); a mismatch raises on every rank, naming the field."""
    signature = _config_signature(config)
    hashes = comm.all_gather_int(order_hash(tuple(signature.items())), group, device)  # type: ignore[arg-type]
    if len(set(hashes)) == 1:
        return
    # Every rank saw the same hashes, so all take this branch and run the same collectives.
    differing = [
        name
        for name, value in signature.items()
        if len(set(comm.all_gather_int(order_hash((value,)), group, device))) > 1  # type: ignore[arg-type]
    ]
    mine = ", ".join(f"{name}={signature[name]}" for name in differing)
    raise ValueError(
        f"overlap.wrap: the OverlapConfig differs across ranks in {', '.join(differing)} (on rank "
        f"{dist.get_rank(group)}: {mine}); config hashes by rank: {hashes}. Pass the same config "
        "(and keyword overrides) on every rank: these fields decide which collectives run, in "
        "what order and with what sizes. Only rank-local fields may differ: "
        f"{', '.join(sorted(_RANK_LOCAL_FIELDS))}."
    )


def _unit_of_module(module_fqn: str, unit_set: set[str]) -> str:
    """The unit module containing `module_fqn` ("" = the root unit)."""
    parts = module_fqn.split(".") if module_fqn else []
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in unit_set:
            return prefix
    return ""


def _params_by_unit_module(model: nn.Module, unit_fqns: list[str]) -> dict[str, list[ParamInfo]]:
    """Assign every parameter to the unit module that contains it ("" = root unit); 0-dim ones
    to none (see [Note: replicated parameters] in replicated.py).

    A parameter held by several modules (tied weights, e.g. GPT-2's embedding and LM head)
    belongs to the unit of their lowest common ancestor, as FSDP does: the one unit containing
    all its owners, or the root unit when they sit in different units.
    """
    unit_set = set(unit_fqns)
    found: dict[int, tuple[str, list[tuple[str, str]], nn.Parameter]] = {}
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            if is_replicated(param):
                continue  # kept whole on every rank: [Note: replicated parameters] in replicated.py
            if param.is_sparse or param.is_complex() or not param.dtype.is_floating_point:
                raise ValueError(
                    f"overlap.wrap: parameter {fqn!r} ({param.dtype}, layout {param.layout}) is "
                    "not a dense real floating tensor, which is all overlap can shard"
                )
            entry = found.setdefault(id(param), (fqn, [], param))
            if (module_fqn, name) not in entry[1]:
                entry[1].append((module_fqn, name))
    if not found:
        scalars = [n for n, p in model.named_parameters() if is_replicated(p)]
        raise ValueError(
            f"overlap.wrap: every parameter of the model is a scalar (0-dim: {scalars}), so there "
            "is nothing to shard; use torch.nn.parallel.DistributedDataParallel for this model"
        )
    by_unit: dict[str, list[ParamInfo]] = {fqn: [] for fqn in unit_fqns}
    by_unit[""] = []
    for fqn, owners, param in found.values():
        units = {_unit_of_module(module_fqn, unit_set) for module_fqn, _ in owners}
        unit = units.pop() if len(units) == 1 else ""
        info = ParamInfo(fqn, tuple(owners), param.shape, param.requires_grad, param.dtype)
        by_unit[unit].append(info)
    return by_unit


def _unit_params(
    modules: dict[str, nn.Module], layout: UnitLayout
) -> tuple[list[list[tuple[nn.Module, str]]], list[nn.Parameter], torch.dtype]:
    """The unit's (module, attribute) owners per parameter, its current full parameters, and
    their one dtype ([Note: one dtype per unit] in units.py)."""
    owners = [[(modules[m], name) for m, name in slot.owners] for slot in layout.slots]
    full = [holders[0][0]._parameters[holders[0][1]] for holders in owners]
    dtypes = {p.dtype for p in full}
    assert len(dtypes) == 1, f"rank {dist.get_rank()}: {layout.label} has dtypes {dtypes} (split_by_dtype)"
    (dtype,) = dtypes
    return owners, full, dtype  # type: ignore[return-value]


def _new_shard(layout: UnitLayout, dtype: torch.dtype, device: torch.device, source: SourcePlan | None) -> torch.Tensor:
    """The unit's flat shard buffer: zeros where this rank copies its own rows (the padding must
    be zero), uninitialized where the scatter fills all of it."""
    alloc = torch.zeros if source is None else torch.empty
    # TAG_NUMEL more behind the shard: the all-gather's tag ([Note: collective fingerprints])
    return alloc(layout.shard_numel + TAG_NUMEL, dtype=dtype, device=device)[: layout.shard_numel]


def _shard_buffers(
    modules: dict[str, nn.Module],
    layouts: list[UnitLayout],
    device: torch.device,
    source: SourcePlan | None,
    preallocate: bool,
) -> tuple[list[torch.Tensor | None], ScratchBuffer]:
    """Every unit's shard buffer when `preallocate` (else None: `_shard_unit` allocates it), and
    the buffer the source packs each unit into, sized for the largest unit.

    [Note: shards first]
    The shards outlive wrap; a deferred unit's full parameters and the source's packed copy do
    not (they live in ScratchBuffers, init.py). Allocated one by one between those temporaries,
    every shard would pin a hole in the heap (glibc on CPU; split segments in CUDA's caching
    allocator); allocated before the walk, they stay out of the temporaries' way.
    """
    dtypes = [_unit_params(modules, layout)[2] for layout in layouts]
    shards: list[torch.Tensor | None] = [None] * len(layouts)
    if preallocate:
        shards = [_new_shard(layout, dtype, device, source) for layout, dtype in zip(layouts, dtypes)]
    packing = ScratchBuffer(device)
    if source is not None and source.is_source:
        sizes = [ScratchBuffer.aligned(l.unsharded_numel * d.itemsize) for l, d in zip(layouts, dtypes)]
        packing.reserve(max(sizes))
    return shards, packing


def _shard_unit(
    modules: dict[str, nn.Module],
    layout: UnitLayout,
    mesh: DeviceMesh,
    rank: int,
    config: OverlapConfig,
    device: torch.device,
    source: SourcePlan | None,
    shard: torch.Tensor | None = None,
    packing: ScratchBuffer | None = None,
) -> UnitTensors:
    """Replace the unit's parameters by DTensor shards that are views of one flat shard buffer
    (`shard` if preallocated, see [Note: shards first]).

    The shard holds this rank's rows of the source's values (`source`, [Note: sync from the
    source]; the full parameters need to be real on the source only) or, without a source, of
    this rank's own values. `modules` maps every module FQN (duplicates kept) to its module;
    `packing` holds the source's rank-major copy (see ScratchBuffer in init.py)."""
    owners, full, dtype = _unit_params(modules, layout)
    world_size = layout.world_size
    if shard is None:
        shard = _new_shard(layout, dtype, device, source)
    if source is not None:
        packed = None
        if source.is_source:
            out = None if packing is None else packing.take([(torch.Size([layout.unsharded_numel]), dtype)])[0]
            packed = pack_rank_major(layout, full, dtype, device, out)
        scatter_shard(source, shard, packed)
        del packed
    gather_dtype = config.param_dtype or dtype
    unsharded_flat = torch.empty(layout.unsharded_numel, dtype=gather_dtype, device=device)
    sharded_params, unsharded_params = [], []
    for slot, param in zip(layout.slots, full):
        rows, local_rows = slot.rows_per_rank, slot.local_rows(rank)
        chunk = shard[slot.shard_offset : slot.shard_offset + slot.chunk_numel]
        local = chunk.view(rows, *slot.shape[1:])[:local_rows]
        if source is None:
            with torch.no_grad():
                local.copy_(param.detach()[rank * rows : rank * rows + local_rows])
        dtensor = DTensor.from_local(
            _own_storage(local), mesh, shard_placements(mesh), run_check=False, shape=param.shape, stride=param.stride()
        )
        sharded_params.append(nn.Parameter(dtensor, requires_grad=param.requires_grad))
        padded = unsharded_flat[
            slot.unsharded_offset : slot.unsharded_offset + world_size * slot.chunk_numel
        ]
        view = padded.view(world_size * rows, *slot.shape[1:])[: slot.shape[0]]
        unsharded_params.append(nn.Parameter(view, requires_grad=param.requires_grad))
    unsharded_flat.untyped_storage().resize_(0)
    unit = UnitTensors(layout, shard, sharded_params, unsharded_flat, unsharded_params, owners)
    unit.swap_in(sharded_params)
    return unit


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """`view`'s memory as a tensor with a storage object of its own, covering exactly its bytes.

    [Note: shards with their own storage]
    A sharded parameter's local tensor is this rank's rows in the unit's flat shard buffer: the
    optimizer writes there and the all-gather reads from there. As a plain view it would carry
    the flat buffer's storage, with an offset, and `torch.save(model.state_dict())` would fail
    (torch 2.13 gives the DTensor wrapper the local's storage offset, so pickling takes the plain
    tensor path and reads the wrapper's null storage) or, where it succeeds, write the whole
    flat buffer once per parameter. Through DLPack the local tensor shares the memory (in-place
    writes land in the flat buffer; the DLPack capsule keeps that buffer alive) but owns a storage
    of its own bytes at offset 0: saving writes each parameter's bytes and nothing else.
    Nothing may rely on `untyped_storage()` identity between a local tensor and its flat shard;
    `data_ptr()` is shared."""
    return torch.from_dlpack(view)


def state_of(model: nn.Module) -> OverlapState:
    state = getattr(model, "_overlap_state", None)
    if state is None:
        raise ValueError("this model is not wrapped with overlap.wrap")
    return state


def iter_units(model: nn.Module) -> Iterable[UnitTensors]:
    return state_of(model).units

