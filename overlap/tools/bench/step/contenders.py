"""`overlap bench step`'s contenders: each one a model, its optimizer and its training step.

overlap and the peers are built by overlap.tools.bench.peers; the two floors are built here. The
package's docstring (overlap/tools/bench/step/__init__.py) lists the contenders.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlap.tools.bench import peers
from overlap.tools.bench.peers import parse_overrides
from overlap.tools.bench.step.config import ALL_CONTENDERS, StepBenchConfig
from overlap.tools.workloads.step import Batch, build_model, compute_loss, root_params, shard_units, train_step
from overlap.tools.worlds.collectives import all_gather_single, reduce_scatter_single
from overlap.transport import backend
from overlap.transport import collectives as comm


@dataclass
class Contender:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    step: Callable[..., torch.Tensor]
    """One training step, `step(on_stepped=None)`; returns the (detached) loss."""
    exposed_comm_ms: Callable[[], float] | None = None
    """The contender's own measure of the last step's exposed communication, if it has one."""
    overlap_efficiency: Callable[[], float] | None = None
    """Hidden comm / total comm of one extra, untimed, traced step (after a round's timed
    steps), from the engine's own trace."""
    trains_like_ddp: bool = True
    lossy: bool = False
    """Its communication changes the numbers: the parity check reports, it does not warn."""
    state_fn: Callable[[], int] | None = None
    """Its own state accounting (peers.Trainer.state_bytes); None: `state_bytes(model, opt)`."""
    settings: dict[str, Any] | None = None
    """What it was configured with (peers.Trainer.settings), for the JSON."""
    step_ms: list[list[float]] = field(default_factory=list)  # per round, per timed step
    exposed_ms: list[float] = field(default_factory=list)
    efficiency: list[float] = field(default_factory=list)  # one per round, mean over ranks
    state_bytes: int = 0
    parity_rel: float | None = None
    keep_alive: tuple[Any, ...] = ()
    """What lives exactly as long as the contender (its trace's temporary directory)."""


def standard(name: str, model: nn.Module, batch: Batch, lr: float, **kw: Any) -> Contender:
    """A contender whose step is the plain `train_step` of `model` under AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(on_stepped: Callable[[], None] | None = None) -> torch.Tensor:
        return train_step(model, opt, batch, on_stepped)

    return Contender(name, model, opt, step, **kw)


def train_setup(cfg: StepBenchConfig) -> peers.TrainSetup:
    """What every contender trains with: AdamW(lr), the model's units and width, no clipping."""
    return peers.TrainSetup(
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr),
        units_of=shard_units,
        micro_batch=cfg.batch,
        hidden_size=cfg.dim,
        num_replicas=cfg.hsdp,
    )


def trainer_step(t: peers.Trainer, batch: Batch, on_stepped: Callable[[], None] | None = None) -> torch.Tensor:
    """`train_step` through a trainer's own API (a DeepSpeed engine steps and zeroes itself)."""
    loss = compute_loss(t.model, batch)
    t.backward(loss)
    t.step()
    if on_stepped is not None:  # gradients still alive here: the accounting hook
        on_stepped()
    t.zero_grad()
    return loss.detach()


def from_trainer(t: peers.Trainer, batch: Batch, **kw: Any) -> Contender:
    def step(on_stepped: Callable[[], None] | None = None) -> torch.Tensor:
        return trainer_step(t, batch, on_stepped)

    return Contender(
        t.name, t.model, t.optimizer, step, lossy=t.lossy, state_fn=t.state_bytes,
        settings=t.settings, **kw,
    )  # fmt: skip


def make_overlap(cfg: StepBenchConfig, batch: Batch, name: str, overrides: dict) -> Contender:
    import overlap

    overrides = {"cpu_keep_freed_memory": cfg.keep_freed_memory, **overrides}
    trainer = peers.overlap_trainer(name, build_model(cfg), train_setup(cfg), overrides)
    model = trainer.model

    def exposed_comm_ms() -> float:
        stats = overlap.step_stats(model)  # None only before the first step
        return float("nan") if stats is None else stats.exposed_comm_ms

    # Overlap efficiency comes from the engine's trace (comm busy = union of the collectives'
    # issue->done spans, exposed = union of the waits; overlap.report), recorded in one extra
    # step after each round's timed steps: recording and rewriting the trace file cost 1-3% of
    # a step, which the timed steps must not carry (no other contender records anything).
    from overlap.observe.report import load_events, training_steps
    from overlap.observe.report import summarize as summarize_trace
    from overlap.observe.trace import TraceRecorder

    state = model._overlap_state
    # removed when the contender is collected or the process exits (TemporaryDirectory's finalizer)
    trace_dir = tempfile.TemporaryDirectory(prefix="overlap-bench-trace-")
    recorder = TraceRecorder(Path(trace_dir.name), dist.get_rank(), max_steps=2)
    contender = from_trainer(trainer, batch, exposed_comm_ms=exposed_comm_ms)

    def overlap_efficiency() -> float:
        """NaN when there is nothing to measure: world size 1 moves no bytes, or the trace has
        no complete training step."""
        if dist.get_world_size() == 1:
            return float("nan")
        state.trace = state.runtime.trace = recorder
        try:
            contender.step()  # untimed, traced
        finally:
            state.trace = state.runtime.trace = None
        try:
            events = load_events([recorder.path])
            steps = training_steps(events)
            summaries = summarize_trace(events, steps[-1]) if steps else []  # the step just traced
        except (FileNotFoundError, ValueError):
            return float("nan")
        return summaries[0].efficiency if summaries else float("nan")

    contender.overlap_efficiency = overlap_efficiency
    contender.keep_alive = (trace_dir,)
    contender.settings = {**(contender.settings or {}), "transport": transport_names(state)}
    return contender


def transport_names(state: Any) -> dict[str, str]:
    """Which strategy carries each of an overlap model's collectives, and over how many ranks
    (e.g. HSDP on one host: shared memory in the shard group, the replicas' sum on gloo)."""
    transport, runtime = state.runtime.transport, state.runtime
    summed = "n/a (no replicas)"
    if runtime.replicate_group is not None:
        summed = f"{type(transport.all_reduce).__name__} x{runtime.num_replicas}"
    return {
        "all_gather": f"{type(transport.all_gather).__name__} x{runtime.world_size}",
        "reduce_scatter": f"{type(transport.reduce_scatter).__name__} x{runtime.world_size}",
        "all_reduce": summed,
    }


def attach_zero3_comm(
    module: nn.Module, params: list[nn.Parameter], works: list[dist.Work], gather_in_backward: bool
) -> None:
    """Hooks that issue the ZeRO-3 collectives of `params` (owned by `module`); see
    [Note: what floor-compute||comm issues, and when] in bench/step/__init__.py."""
    world = dist.get_world_size()
    padded_numel = -(-sum(p.numel() for p in params) // world) * world
    shard = torch.zeros(padded_numel // world)
    gathered_fwd, gathered_bwd = torch.zeros(padded_numel), torch.zeros(padded_numel)
    grad_flat, grad_shard = torch.zeros(padded_numel), torch.zeros(padded_numel // world)
    num_grads_ready = 0

    # gloo: the exchanges overlap's CPU transport uses, the cheapest this backend has (a pair's
    # gather, the all-to-all reduction, both receive-first); elsewhere the native collectives
    group = dist.group.WORLD
    gloo = backend.semantics(group, shard.device).backend == "gloo"

    def gather(out: torch.Tensor) -> Any:
        if gloo and world == 2:
            return comm.all_gather_pair(shard, group, dist.get_rank(), torch.float32).work
        return all_gather_single(out, shard, async_op=True)

    def gather_fwd(_module: nn.Module, _inputs: Any) -> None:
        works.append(gather(gathered_fwd))

    def gather_bwd(_grad: torch.Tensor) -> None:
        works.append(gather(gathered_bwd))

    def arm_gather_bwd(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        output.register_hook(gather_bwd)

    def reduce_when_ready(_param: torch.Tensor) -> None:
        nonlocal num_grads_ready
        num_grads_ready += 1
        if num_grads_ready == len(params):
            num_grads_ready = 0
            if gloo and world > 1:
                works.append(comm.reduce_scatter_flat(grad_flat, group, world, "all_to_all").work)
            else:
                works.append(reduce_scatter_single(grad_shard, grad_flat, async_op=True))

    module.register_forward_pre_hook(gather_fwd)
    if gather_in_backward:
        module.register_forward_hook(arm_gather_bwd)
    for p in params:
        p.register_post_accumulate_grad_hook(reduce_when_ready)


def make_floor_with_comm(cfg: StepBenchConfig, batch: Batch) -> Contender:
    """The local step with ZeRO-3's collectives beside it, waited for at the end of the step."""
    model = build_model(cfg)
    works: list[dist.Work] = []
    units = shard_units(model)
    for unit in units:
        attach_zero3_comm(unit, list(unit.parameters()), works, gather_in_backward=True)
    own = root_params(model, units)
    if own:
        attach_zero3_comm(model, own, works, gather_in_backward=False)
    c = standard("floor-compute||comm", model, batch, cfg.lr, trains_like_ddp=False)
    local_step = c.step

    def step(on_stepped: Callable[[], None] | None = None) -> torch.Tensor:
        loss = local_step(on_stepped)
        for work in works:
            work.wait()
        works.clear()
        return loss

    c.step = step
    return c


def contender_names(cfg: StepBenchConfig) -> list[str]:
    """The contenders `cfg` asks for, in the report's order (ALL_CONTENDERS', each overlap
    config right after the default overlap)."""
    names = []
    for name in ALL_CONTENDERS:
        if name in cfg.contenders:
            names.append(name)
            if name == "overlap":
                names += [f"overlap[{spec}]" for spec in cfg.overlap_configs]
    return names


def build_contender(cfg: StepBenchConfig, batch: Batch, name: str) -> Contender:
    spec = peers.overlap_spec(name)
    if spec is not None:
        return make_overlap(cfg, batch, name, parse_overrides(spec))
    if name == "floor-compute":
        return standard(name, build_model(cfg), batch, cfg.lr, trains_like_ddp=False)
    if name == "floor-compute||comm":
        return make_floor_with_comm(cfg, batch)
    return from_trainer(peers.build_trainer(name, build_model(cfg), train_setup(cfg)), batch)


def build_contenders(cfg: StepBenchConfig, batch: Batch) -> list[Contender]:
    return [build_contender(cfg, batch, name) for name in contender_names(cfg)]
