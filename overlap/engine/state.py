"""The wrapped model's state (`model._overlap_state`) and the hooks that turn module events into
schedule events:

    root forward pre-hook   -> Schedule.begin_forward        (root unit gathered, prefetch starts)
    unit forward pre-hook   -> Schedule.pre_forward(u)       (wait for u, prefetch ahead)
    unit forward hook       -> Schedule.post_forward(u)      (free u; pre-backward hooks on outputs)
    root forward hook       -> Schedule.end_forward          (order check; backward prefetch)
    output gradient hook    -> Schedule.pre_backward(u)      (wait for u, prefetch ahead)
    post-accumulate-grad    -> Schedule.post_backward(u)     (when all of u's grads are in)
    autograd end callback   -> Schedule.end_backward         (flush buckets, wait reductions)

The schedule's actions go to the runtime (runtime.py), which carries them out through the
transport chosen at wrap (overlap/transport/).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from overlap.compression import make_grad_codec, make_param_codec
from overlap.compression.feedback import warn_residual_memory
from overlap.config import OverlapConfig, check_divide_factor
from overlap.engine import torch_compat
from overlap.engine.autograd_hooks import BackwardCounts, GradReady, report_input_grads
from overlap.engine.autotune import AutoTuner
from overlap.engine.groups import Groups
from overlap.engine.lazy_torch import compile_disabled, is_dtensor
from overlap.engine.replicated import ReplicatedParams  # ecosystem: scalar parameters
from overlap.engine.runtime import Runtime
from overlap.engine.schedule import Action, Phase, Schedule, ScheduleConfig, UnitState
from overlap.engine.unit_tensors import UnitTensors
from overlap.engine.units import warn_lopsided_units, with_trainable
from overlap.observe.monitor import Monitor
from overlap.observe.stats import StatsRecorder
from overlap.observe.timing import make_timer
from overlap.observe.trace import TraceRecorder, trace_dir_from
from overlap.transport import make_transport


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
        writes_files: bool = True,  # metrics and trace files; not the experts' state (experts.py)
    ) -> None:
        self.config = config
        group = self.group = groups.shard  # all-gathers and reduce-scatters run here
        replicate_group = self.replicate_group = groups.replicate  # HSDP: reduced shards all-reduced here
        self.mesh = groups.mesh
        self.tensor_group = groups.tensor  # TP: [Note: tensor-parallel parameters] in compose.py
        self.rank = dist.get_rank(group)  # rank within the shard group
        self.world_size = dist.get_world_size(group)  # shard group size
        self.num_replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.replica_rank = 0 if replicate_group is None else dist.get_rank(replicate_group)
        self.units = units
        warn_lopsided_units(model, [u.layout for u in units])  # one unit with most of the blocks
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
            unit_bytes=[u.held_bytes(gather_dtype) for u in units],
            grad_bytes=[u.grad_bytes(reduce_dtype) for u in units],
            config=ScheduleConfig.from_config(config),
            root=root_unit,
        )
        self.monitor = Monitor(
            self.rank,
            device,
            metrics_file=config.metrics_file if writes_files else None,
            alert_exposed_comm_share=config.alert_exposed_comm_share,
            alert_collective_slowdown=config.alert_collective_slowdown,
            alert_step_gap_ms=config.alert_step_gap_ms,
            alert_memory_bytes=config.alert_memory_bytes,
        )
        trace_dir = trace_dir_from(config.trace_dir) if writes_files else None
        self.trace = TraceRecorder(trace_dir, self.rank) if trace_dir is not None else None
        # exact completion times only where they are read ([Note: completion callbacks cost latency])
        self.timer = make_timer(device, precise=trace_dir is not None or config.alert_collective_slowdown is not None)
        secondary_group = groups.secondary if config.reshard_after_forward else None
        transport = make_transport(  # chosen once, from the device and the group's backend
            group,
            device,
            self.timer,
            None if config.collective_timeout_s is None else timedelta(seconds=config.collective_timeout_s),
            reduce_impl=config.reduce_scatter_impl,
            gather_impl=config.all_gather_impl,
            replicate_group=replicate_group,
            secondary_group=secondary_group,
            shared_memory=config.shared_memory,
            symmetric_memory=torch_compat.symmetric_memory if config.symmetric_memory else None,
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
            transport,
            trace=self.trace,
            timer=self.timer,
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
            secondary_group=secondary_group,
            gradient_divide_factor=_divide_factor(config.gradient_divide_factor, groups),
            tensor_group=groups.tensor,
        )
        shard_numel = sum(u.layout.shard_numel for u in units)  # what a float32 residual costs: say so
        warn_residual_memory(self.runtime.residual_dtype, self.world_size, shard_numel, device)
        # expert parallelism: the experts' state, set by wrap ([Note: expert parallelism] in experts.py)
        self.experts: tuple[OverlapState, ...] = ()
        self._counts = BackwardCounts(  # [Note: end of a unit's backward] in autograd_hooks.py
            [sum(p.requires_grad for p in u.unsharded_params) for u in units],
            [not all(p.requires_grad for p in u.unsharded_params) for u in units],
        )
        self._reduce_dtype = reduce_dtype
        self._groups = groups
        self._hooked: set[int] = set()  # ids of unsharded parameters with a grad-ready hook
        self._backward_queued = False  # this autograd run's end callback is queued
        self._in_forward = False  # inside the root module's forward
        self._main_backward = False  # this step's main backward began: [Note: auxiliary backward runs]
        self._handles: list[Any] = []
        # ecosystem: 0-dim parameters, whole on every rank ([Note: replicated parameters])
        self.replicated = ReplicatedParams(model, groups.everyone, self.runtime.timeout, self.stats)
        self.autotuner = (
            None
            if not config.autotune
            else AutoTuner(
                self.schedule,
                self.stats,
                config,
                groups.job or groups.everyone,
                device,
                self.runtime.timeout,
                tune_buckets=config.grad_compression is None,
                num_ranks=dist.get_world_size(groups.shard),
                num_replicas=1 if groups.replicate is None else dist.get_world_size(groups.replicate),
                shared_memory=self.runtime.transport.all_gather.through_shared_memory,
            )
        )
        self._install_hooks(model, hooked)

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self, model: nn.Module, hooked: list[HookedModules]) -> None:
        self._handles.append(model.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._root_post_forward))
        if self.autotuner is not None:  # [Note: out of memory in a trial] in autotune_oom.py
            self._handles.append(model.register_forward_hook(self.autotuner.forward_raised, always_call=True))
        for modules, indices in hooked:  # a module's units: one per dtype ([Note: one dtype per unit])
            for position, module in enumerate(modules):
                last = position == len(modules) - 1
                self._handles.append(
                    module.register_forward_pre_hook(
                        functools.partial(self._unit_pre_forward, indices, position == 0), prepend=True
                    )
                )
                self._handles.append(
                    module.register_forward_hook(functools.partial(self._unit_post_forward, indices, last))
                )
        for index in range(len(self.units)):
            self._hook_trainable(index)

    def _hook_trainable(self, index: int) -> None:
        for position, param in enumerate(self.units[index].unsharded_params):
            if param.requires_grad and id(param) not in self._hooked:
                self._hooked.add(id(param))
                param.register_post_accumulate_grad_hook(GradReady(self, index, position))

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
            self._counts.set_trainable(index, sum(flags), not all(flags))
            self._hook_trainable(index)
            self.runtime.forget_residuals(index)
            self.schedule.set_grad_bytes(index, unit.grad_bytes(self._reduce_dtype))

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """`OverlapConfig.gradient_divide_factor` from the next step on, the experts' state's
        too ([Note: expert parallelism] in experts.py). Between steps; the same on every rank."""
        check_divide_factor(factor)
        if self.schedule.phase is not Phase.IDLE:
            raise ValueError(
                f"set_gradient_divide_factor was called in the middle of a step ({self.schedule.phase.value}); "
                "call it between steps"
            )
        for each in (self, *self.experts):
            each.config = each.config.replace(gradient_divide_factor=factor)
            each.runtime.gradient_divide_factor = _divide_factor(factor, each._groups)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward accumulates gradients locally and reduces nothing inside (`overlap.no_sync`)."""
        previous = self.schedule.sync_grads
        self.schedule.sync_grads = False
        try:
            with contextlib.ExitStack() as stack:  # the experts' states too ([Note: expert parallelism])
                for expert in self.experts:
                    stack.enter_context(expert.no_sync())
                yield
        finally:
            self.schedule.sync_grads = previous

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
    # The forward hooks are therefore `torch.compiler.disable`d (`compile_disabled`: when wrap
    # registers them, not at import, [Note: import cost] in lazy_torch.py): dynamo breaks the
    # graph around them and they run eagerly; the block's own forward is still compiled, once for
    # all units.

    @compile_disabled
    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.autotuner is not None:  # a trial step left unfinished: [Note: out of memory in a trial]
            self.autotuner.before_forward(self)
        if self.schedule.phase is Phase.BACKWARD:
            return None  # [Note: forward during backward]
        if self.schedule.phase is Phase.IDLE:
            self._sync_requires_grad()
            self.stats.begin_step()
            self.timer.begin_step()
            self.runtime.begin_step()
        self._in_forward = True
        self._run(self.schedule.begin_forward())
        for index in self.root_units[1:]:  # kept like the root: never post_forward-ed
            self._run(self.schedule.pre_forward(index))
        dtype = self.config.param_dtype
        if dtype is None:
            return None

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and not is_dtensor(x):
                return x.to(dtype)
            return x

        return tree_map(cast, args), tree_map(cast, kwargs)

    @compile_disabled  # [Note: hooks under torch.compile]
    def _root_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.schedule.phase is Phase.BACKWARD:
            return
        self._in_forward = False
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._on_backward_of(output, self.root_units, True)
        first = self.schedule.forward_order is None
        self._run(self.schedule.end_forward(grad_enabled))
        if first:  # hpZ: a unit kept for backward needs no secondary copy, nor do the root's
            for index in (*self.schedule.kept_units(), *self.root_units):
                self.runtime.units[index].needs_secondary = False
        if not grad_enabled:
            self._finish_step()

    @compile_disabled  # [Note: hooks under torch.compile]
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
            return report_input_grads(self, self._counts, args, indices)
        return None

    @compile_disabled  # [Note: hooks under torch.compile]
    def _unit_post_forward(
        self, indices: tuple[int, ...], last: bool, module: nn.Module, args: tuple, output: Any
    ) -> None:
        if self.schedule.phase is Phase.BACKWARD:
            return
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:  # inside the model's forward graph, or no root forward this step
            self._on_backward_of(output, indices, self._in_forward or self.schedule.phase is Phase.IDLE)
        if last:
            if self.trace is not None:
                self.trace.end("compute", f"forward {self.units[indices[0]].layout.label}")
            for index in indices:
                self._run(self.schedule.post_forward(index, grad_enabled))

    def _on_backward_of(self, output: Any, indices: tuple[int, ...], main: bool) -> None:
        """Call `_pre_backward(indices, main)` when the first gradient w.r.t. `output` arrives;
        `main`: `output` belongs to the model's forward graph ([Note: auxiliary backward runs])."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(tensors) == 1:  # the common case: a plain tensor hook is several times cheaper
            tensors[0].register_hook(functools.partial(self._pre_backward_hook, indices, main))
        elif tensors:
            register_multi_grad_hook(tensors, functools.partial(self._pre_backward, indices, main), mode="any")

    def _pre_backward_hook(self, indices: tuple[int, ...], main: bool, grad: torch.Tensor) -> None:
        self._pre_backward(indices, main, grad)  # returns None: the gradient is left as it is

    # [Note: end of a unit's backward] in autograd_hooks.py (BackwardCounts)

    # [Note: auxiliary backward runs]
    # A step may run several autograd runs before the model's own backward: a loss head applied
    # to the model's output chunk by chunk, each chunk with its own `backward()` (torchtitan's
    # chunked loss), then one backward through the model with the chunks' summed gradient. The
    # step's *main* backward is the run that reaches the model's forward graph: the gradient of
    # the root's output, or of a unit's output produced inside the root's forward. The others
    # are auxiliary: their gradients accumulate into the unsharded parameters of the units they
    # reach (the root stays unsharded from its forward to its backward; a unit called by the
    # head after the root's forward is gathered for it and kept), and the end of such a run ends
    # nothing. Those units finish when the step's backward ends ([Note: end of a unit's
    # backward] in autograd_hooks.py), so one reduction carries every chunk's gradient, as FSDP2
    # reduces its root's once; the units of the model's own backward reduce as early as before.
    # A gradient an auxiliary run leaves in a dtype narrower than reduce_dtype (bf16 parameters,
    # fp32 reduction) moves into the unit's sum in reduce_dtype at once ([Note: no_sync in
    # reduce_dtype] in reduction.py): the chunks add up in fp32, as FSDP2 adds up the head's
    # when its gradient sync is off for all chunks but the last (torchtitan's chunked loss).

    def _pre_backward(self, indices: tuple[int, ...], main: bool, grad: Any) -> None:
        if main:
            self._main_backward = True
        if not self._backward_queued:
            self._backward_queued = True
            self.schedule.begin_backward()
            self.runtime.sync_grads = self.schedule.sync_grads  # [Note: no_sync in reduce_dtype]
            Variable._execution_engine.queue_callback(self._autograd_run_ended)
        for index in reversed(indices):  # in backward order: the prefetch starts after the last
            self._run(self.schedule.pre_backward(index))
            if self.trace is not None and index not in self.root_units:  # the root spans it all
                self.trace.begin("compute", f"backward {self.units[index].layout.label}")

    def _post_backward(self, index: int) -> None:
        if self.trace is not None:
            self.trace.end("compute", f"backward {self.units[index].layout.label}")
        self._run(self.schedule.post_backward(index))

    def _unit_backward_done(self, index: int) -> None:
        if self._counts.input_done(index, self._main_backward):
            self._post_backward(index)

    def _grad_ready(self, index: int, position: int, param: torch.Tensor) -> None:
        if self.schedule.states[index] is not UnitState.UNSHARDED:
            name = self.units[index].layout.slots[position].fqn
            raise RuntimeError(
                f"overlap: the gradient of {name!r} arrived after {self.units[index].layout.label} "
                "finished its backward; a parameter must be used inside its unit's forward (or "
                "choose a unit_policy that puts the module using it in the same unit)"
            )
        if self._counts.grad_ready(index, position, self._main_backward):
            self._post_backward(index)
        elif not self._main_backward and self.runtime.reduce_dtype is not None:
            self.runtime._keep_grads(self.units[index])

    def _autograd_run_ended(self) -> None:
        """The engine's end-of-backward callback, once per autograd run that reached a unit."""
        self._backward_queued = False
        if self._main_backward:  # else an auxiliary run ended: [Note: auxiliary backward runs]
            self._end_backward()

    def _end_backward(self) -> None:
        """The step's backward is over (also how autotune ends a step it interrupted)."""
        self._backward_queued = False
        self._main_backward = self._in_forward = False
        self._counts.reset()
        self._run(self.schedule.end_backward())
        self.replicated.reduce(self.schedule.sync_grads)  # ecosystem: [Note: replicated parameters]
        step = self._finish_step()
        if self.autotuner is not None and self.schedule.sync_grads:  # [Note: autotune]
            self.autotuner.end_training_step(step)
        for codec in (self.runtime.param_codec, self.runtime.grad_codec):
            if codec is not None:  # once per step; on CUDA two steps late, without a sync
                codec.raise_if_nonfinite()

    def _finish_step(self) -> int:
        """Close the step's statistics; returns its StatsRecorder step."""
        step = self.stats.current.step
        self.runtime.check_fingerprints()
        peak_units, peak_bytes = self.schedule.max_unsharded()
        self.stats.record_unsharded(peak_units, peak_bytes)
        self.stats.record_memory(self.runtime.memory.peak_total)
        spans = self.timer.harvest()
        self.stats.record_spans(spans)
        if self.trace is not None:
            self.trace.record_spans(spans)
            self.trace.finish_step()
        published = self.stats.finish(self.timer.oldest_open_step)
        for stats in published:
            self.monitor.on_step(stats)
        if self.autotuner is not None:
            self.autotuner.observe(published)
        return step


def _divide_factor(factor: float | None, groups: Groups) -> float | None:
    """What the runtime divides the gradients' sum by: the user's factor, else the groups' own
    (the experts': every dp rank), else None (the number of ranks it reduces over)."""
    return factor if factor is not None else groups.gradient_divide_factor


def _rounding_generator(device: torch.device, rank: int) -> torch.Generator:
    """Independent stochastic-rounding noise per rank (correlated noise would not average out)."""
    return torch.Generator(device).manual_seed(0x5EED + rank)


class HookedModules(NamedTuple):
    """Modules whose forward hooks drive units together: a unit's modules, or (a group of
    modules with parameters of several dtypes) the units of each dtype ([Note: one dtype per
    unit] in units.py)."""

    modules: tuple[nn.Module, ...]  # in order: the first's pre-hook starts the units, the last's hook ends them
    units: tuple[int, ...]  # their unit indices, in forward order


def state_of(model: nn.Module) -> OverlapState:
    state = getattr(model, "_overlap_state", None)
    if state is None:
        raise ValueError("this model is not wrapped with overlap.wrap")
    return state


def iter_units(model: nn.Module) -> Iterable[UnitTensors]:
    return state_of(model).units
